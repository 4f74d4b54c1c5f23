# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The release gate on a built fastcomms wheel (scripts/wheel.sh runs it; docs/release.md).

  python tools/wheel_gate.py check WHEEL --torch X.Y [--backend B]

check fails (exit 1, every broken rule listed) unless:
  - METADATA: Name fastcomms, Version = the VERSION file, Requires-Python, License-Expression,
    exactly one torch requirement and it is torch==X.Y.* (written by the build:
    tools/build/torch_requirement.py, NOTE [one torch per build]);
  - every ELF's NEEDED libraries are on the allow-list (libc and friends, libstdc++, libgcc,
    torch's, the CUDA runtime, libnccl.so.2 which torch's nvidia-nccl package provides) or are
    shipped in the wheel itself, whose own NEEDED obey the same rule; RPATH/RUNPATH only
    $ORIGIN-relative;
  - our own ELFs (fastcomms/*.so) export no third-party symbols: no C symbol but PyInit_* and the
    linker's, nothing of gloo, OpenSSL or another library's namespace, and no non-template
    std:: / C++ runtime symbol (a static libstdc++ copy);
  - the wheel installs into a fresh folder, imports there with the expected backends, and
    `fastcomms check` passes from the installed copy (on --backend, default gloo on CPU).
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ALLOWED_NEEDED = [
    r"libc\.so\.6",
    r"libm\.so\.6",
    r"libdl\.so\.2",
    r"librt\.so\.1",
    r"libpthread\.so\.0",
    r"ld-linux-x86-64\.so\.2",
    r"ld-linux-aarch64\.so\.1",
    r"libstdc\+\+\.so\.6",
    r"libgcc_s\.so\.1",
    r"lib(torch|torch_cpu|torch_cuda|torch_python|c10|c10_cuda)\.so",  # torch's
    r"libcudart\.so\.\d+",  # the CUDA runtime (torch's nvidia-cuda-runtime package)
    r"libnccl\.so\.2",  # torch's nvidia-nccl package (loaded by torch first)
]
LINKER_SYMBOLS = {"_init", "_fini", "_edata", "_end", "__bss_start"}
THIRD_PARTY = re.compile(
    r"^(gloo|hiredis|ibv|EVP_|HMAC|CRYPTO_|OPENSSL|SSL_|uv_|google|absl|fmt|spdlog)"
)


def _readelf(path):
    out = subprocess.run(
        ["readelf", "-dW", str(path)], capture_output=True, text=True, check=True
    ).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", out)
    paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library r(?:un)?path: \[(.+?)\]", out)
    return needed, [p for entry in paths for p in entry.split(":")]


def _exports(path):
    """Strong (T, D, B, R) defined dynamic symbols, demangled."""
    out = subprocess.run(
        ["nm", "-D", "--defined-only", "-C", str(path)], capture_output=True, text=True, check=True
    ).stdout
    syms = []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in "TDBR":
            syms.append(parts[2])
    return syms


def _bad_export(sym):
    if sym in LINKER_SYMBOLS or sym.startswith("PyInit_"):
        return None
    if THIRD_PARTY.match(sym):
        return "a third-party library's symbol"
    if "fastcomms" in sym:
        return None
    if "(" not in sym and "::" not in sym:
        return "a C symbol that is not ours"
    if sym.startswith(("operator new", "operator delete", "__cxa_", "__gxx_")):
        return "a C++ runtime symbol (a static libstdc++ copy)"
    head = sym.split("(")[0]
    if re.search(r"\)( const)?::", sym):  # a function-local static of an inline header
        return None  # function, a const member's too (guard, tag)
    if head.startswith(("std::", "__gnu_cxx::", "vtable for std::", "typeinfo for std::")):
        if "<" in sym or "(" not in sym:  # template instantiations; C++17 inline variables
            return None  # (std::piecewise_construct, ...) that every TU using them emits
        return "a non-template std:: function (a static libstdc++ copy)"
    if head.startswith(("c10::", "at::", "torch::", "pybind11::", "typeinfo", "vtable")):
        return None  # template instantiations and type info of the headers we build against
    return "a symbol outside fastcomms"


def check_metadata(meta_text, torch_mm, version):
    errors = []
    meta = email.parser.Parser().parsestr(meta_text)
    if meta["Name"] != "fastcomms":
        errors.append(f"METADATA Name is {meta['Name']!r}, expected 'fastcomms'")
    if meta["Version"] != version:
        errors.append(f"METADATA Version is {meta['Version']!r}, VERSION says {version!r}")
    if not meta["Requires-Python"]:
        errors.append("METADATA has no Requires-Python")
    if not (meta["License-Expression"] or meta["License"]):
        errors.append("METADATA has no License-Expression (or License)")
    torch_reqs = [r for r in meta.get_all("Requires-Dist") or [] if re.match(r"torch\b(?![-_])", r)]
    want = f"torch=={torch_mm}.*"
    if [r.replace(" ", "") for r in torch_reqs] != [want]:
        errors.append(f"METADATA Requires-Dist for torch is {torch_reqs}, expected [{want!r}]")
    return errors


def check_elves(unpacked):
    errors = []
    elves = [p for p in unpacked.rglob("*.so*") if p.is_file()]
    shipped = {p.name for p in elves}
    allowed = [re.compile(f"^{a}$") for a in ALLOWED_NEEDED]
    for elf in elves:
        rel = elf.relative_to(unpacked)
        needed, rpaths = _readelf(elf)
        for lib in needed:
            if lib not in shipped and not any(a.match(lib) for a in allowed):
                errors.append(f"{rel}: needs {lib}, neither on the allow-list nor in the wheel")
        for rp in rpaths:
            if rp and not rp.startswith("$ORIGIN"):
                errors.append(f"{rel}: RPATH/RUNPATH entry {rp!r} is not $ORIGIN-relative")
        if rel.parts[0] == "fastcomms":  # our own ELFs
            bad = [(s, why) for s in _exports(elf) if (why := _bad_export(s))]
            for s, why in bad[:10]:
                errors.append(f"{rel}: exports {s[:120]!r}: {why}")
            if len(bad) > 10:
                errors.append(f"{rel}: ... and {len(bad) - 10} more bad exports")
    if not any(p.name.startswith("_C.") for p in elves):
        errors.append("the wheel holds no fastcomms/_C extension")
    return errors, len(elves)


def check_install(wheel, backend, nproc):
    """Installs into a fresh folder and runs from there (the source tree out of sys.path)."""
    with tempfile.TemporaryDirectory() as d:
        site = Path(d) / "site"
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--target",
                str(site),
                str(wheel),
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode:
            return [f"pip install failed: {r.stderr.strip()[-500:]}"]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PYTHONPATH"] = str(site)
        probe = (
            "import sys, fastcomms; "
            "assert fastcomms.__file__.startswith(sys.argv[1]), fastcomms.__file__; "
            "print(fastcomms.__version__, ','.join(fastcomms.built_backends()))"
        )
        r = subprocess.run(
            [sys.executable, "-c", probe, str(site)],
            cwd=d,
            env=env,
            capture_output=True,
            text=True,
        )
        if r.returncode:
            return [f"import from a fresh folder failed: {r.stderr.strip()[-800:]}"]
        print(f"  imported from {site}: version, backends = {r.stdout.strip()}")
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "fastcomms",
                "check",
                "--backend",
                backend,
                "--nproc",
                str(nproc),
            ],
            cwd=d,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        print("\n".join("  " + line for line in r.stdout.strip().splitlines()[-14:]))
        if r.returncode:
            return [
                f"fastcomms check --backend {backend} failed from the installed wheel: "
                f"{(r.stdout + r.stderr).strip()[-800:]}"
            ]
    return []


def cmd_check(args):
    version = (ROOT / "VERSION").read_text().split()[0]
    wheel = Path(args.wheel)
    print(f"release gate: {wheel.name} (torch {args.torch}.*, VERSION {version})")
    errors = []
    with tempfile.TemporaryDirectory() as d, zipfile.ZipFile(wheel) as z:
        z.extractall(d)
        metas = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        if len(metas) != 1:
            errors.append(f"expected one METADATA, found {metas}")
        else:
            errors += check_metadata(z.read(metas[0]).decode(), args.torch, version)
        elf_errors, n = check_elves(Path(d))
        errors += elf_errors
        print(f"  {n} ELF files checked (NEEDED, RPATH, exports)")
    if not args.no_install:
        errors += check_install(wheel, args.backend, args.nproc)
    for e in errors:
        print(f"  FAIL {e}")
    print("release gate: " + ("PASSED" if not errors else f"FAILED ({len(errors)} problems)"))
    return 1 if errors else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="run the gate")
    c.add_argument("wheel")
    c.add_argument("--torch", required=True, help="X.Y the wheel must pin")
    c.add_argument("--backend", default="gloo", help="fastcomms check's backend (default gloo)")
    c.add_argument("--nproc", type=int, default=2)
    c.add_argument("--no-install", action="store_true", help="skip the install and check run")
    args = ap.parse_args(argv)
    return cmd_check(args)


if __name__ == "__main__":
    sys.exit(main())
