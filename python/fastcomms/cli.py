# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The fastcomms command line (API.md §3), installed as the ``fastcomms`` console script (also
``python -m fastcomms``): ``bench`` times the Ulysses all-to-all against permute +
torch.distributed.all_to_all_single + permute on the best backend present and checks every result
bit for bit; ``check`` runs every op once on a backend against values each rank computes;
``doctor`` reports versions, GPUs, NVLink and the transport a group would take, and with
``--preflight`` what to fix before a job. Ranks are started with torch.multiprocessing, or the
command runs as one rank under torchrun."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from fastcomms._bench import GatedTimer, permute_all_to_all_4d

DTYPES = {
    name: getattr(torch, name)
    for name in ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32")
}


def _nvlink(devices):
    from . import _C

    return _C.nvlink_matrix(devices)


def _driver_cuda_version():
    """(major, minor) of the CUDA version the installed driver supports, or None without one
    (cuDriverGetVersion through libcuda.so.1; no CUDA context is created)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return None
    return v.value // 1000, (v.value % 1000) // 10


def _mm(text):
    """(major, minor) of a version string like '2.11.0+cu130' or '13.0.88'."""
    parts = text.split("+")[0].split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


MULTICAST_OFF = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def preflight_checks(build=None):
    """[(check, status, detail, fix)] with status OK, WARN or FAIL: this machine against what
    the installed build was made for (`fastcomms doctor --preflight`)."""
    from . import _C

    build = build or _C.build_info()
    rows = []

    def add(check, status, detail, fix=""):
        rows.append((check, status, detail, fix))

    def warn_if(check, bad, ok_detail, bad_detail, fix):
        add(check, "WARN" if bad else "OK", bad_detail if bad else ok_detail, fix if bad else "")

    add(
        "fastcomms build",
        "OK",
        f"{build['version']}: torch {build['torch']}"
        + (f", CUDA {build['cuda']} ({build['cuda_archs']})" if build["cuda"] else ", no CUDA")
        + (f", NCCL {build['nccl']}" if build["nccl"] else ""),
    )
    tv = torch.__version__
    if _mm(tv) == _mm(build["torch"]):
        add("torch", "OK", f"{tv} (built against {build['torch']})")
    else:
        want = "{}.{}".format(*_mm(build["torch"]))
        add(
            "torch",
            "FAIL",
            f"{tv}, but this build was made against torch {build['torch']} (the extension's "
            "ABI follows torch's minor version)",
            f"pip install 'torch=={want}.*', or build fastcomms against torch {tv}",
        )
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not build["cuda"]:
        add(
            "CUDA",
            "WARN" if ngpu else "OK",
            "this build has no CUDA layer: gloo (CPU) only",
            "build on a machine with nvcc (scripts/wheel.sh) for nccl and nvlink" if ngpu else "",
        )
        return rows
    driver = _driver_cuda_version()
    need = _mm(build["cuda"])
    if driver is None:
        add(
            "NVIDIA driver",
            "FAIL" if ngpu else "WARN",
            "no driver (libcuda.so.1 not found or not answering): CUDA tensors cannot run",
            "install the NVIDIA driver" if ngpu else "",
        )
    elif driver[0] < need[0]:
        add(
            "NVIDIA driver",
            "FAIL",
            f"supports CUDA {driver[0]}.{driver[1]}, this build needs CUDA {need[0]}.x",
            f"upgrade the driver to one for CUDA {need[0]}.{need[1]} or newer",
        )
    elif driver < need:
        add(
            "NVIDIA driver",
            "WARN",
            f"supports CUDA {driver[0]}.{driver[1]} < {need[0]}.{need[1]} built with (minor "
            "version compatibility: most features work)",
            f"upgrade the driver to one for CUDA {need[0]}.{need[1]}",
        )
    else:
        add("NVIDIA driver", "OK", f"supports CUDA {driver[0]}.{driver[1]}")
    if torch.version.cuda is None:
        add(
            "torch CUDA",
            "FAIL" if ngpu else "WARN",
            "torch is a CPU build: the nccl and nvlink backends cannot run",
            "install torch's CUDA wheel" if ngpu else "",
        )
    elif _mm(torch.version.cuda)[0] != need[0]:
        add(
            "torch CUDA",
            "FAIL",
            f"torch uses CUDA {torch.version.cuda}, this build CUDA {build['cuda']}",
            f"use a torch built for CUDA {need[0]}.x, or rebuild fastcomms with that toolkit",
        )
    else:
        add("torch CUDA", "OK", f"{torch.version.cuda} (built with {build['cuda']})")
    if build["nccl"] and torch.version.cuda is not None:
        try:
            rt = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - a torch without NCCL
            add("NCCL", "FAIL", f"torch has no NCCL ({e})", "install torch's CUDA wheel")
        else:
            pin = "install the nvidia-nccl package torch pins"
            if _mm(rt)[0] != _mm(build["nccl"])[0]:
                add("NCCL", "FAIL", f"runtime {rt}, built with {build['nccl']}", pin)
            elif _mm(rt) < _mm(build["nccl"]):
                add("NCCL", "WARN", f"runtime {rt} older than {build['nccl']} built with", pin)
            else:
                add("NCCL", "OK", f"runtime {rt} (built with {build['nccl']})")
    archs = [int(a) for a in build["cuda_archs"].split(",") if a.strip().isdigit()]
    for i in range(ngpu):
        cc = torch.cuda.get_device_capability(i)
        ok = any(a // 10 == cc[0] and a % 10 <= cc[1] for a in archs)
        add(
            f"cuda:{i} architecture",
            "OK" if ok else "FAIL",
            f"{torch.cuda.get_device_name(i)}, sm_{cc[0]}{cc[1]}; built for "
            + ", ".join(f"sm_{a}" for a in archs),
            "" if ok else f"rebuild with FASTCOMMS_CUDA_ARCH={cc[0]}{cc[1]} (scripts/wheel.sh)",
        )
    if ngpu >= 2:
        no_peer = [
            (a, b)
            for a in range(ngpu)
            for b in range(ngpu)
            if a != b and not torch.cuda.can_device_access_peer(a, b)
        ]
        warn_if(
            "GPU peer access",
            no_peer,
            "every pair",
            f"no peer access for {no_peer[:6]}",
            "the nvlink transport needs it; the collective path (nccl) works without",
        )
        matrix, why = _nvlink(list(range(ngpu)))
        if matrix is None:
            add(
                "NVLink",
                "WARN",
                f"NVML cannot say ({why}); the nvlink transport is not chosen",
                "install the driver's NVML (libnvidia-ml.so.1) or pass transport='nvlink'",
            )
        else:
            missing = [(a, b) for (a, b), v in sorted(matrix.items()) if a < b and not v]
            warn_if(
                "NVLink",
                missing,
                "every GPU pair NVLink-joined",
                f"not joined: {missing[:6]}",
                "groups spanning those pairs take the collective path",
            )
    unset = {k: v for k, v in MULTICAST_OFF.items() if os.environ.get(k) != v}
    warn_if(
        "multicast off",
        unset,
        "set",
        "not set: " + ", ".join(unset),
        "on shared or partitioned GPUs: export " + " ".join(f"{k}={v}" for k, v in unset.items()),
    )
    return rows


def _preflight() -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    rows = preflight_checks()
    table = Table(title="fastcomms doctor --preflight")
    for col in ("check", "status", "detail", "fix"):
        table.add_column(col)
    colour = {"OK": "green", "WARN": "yellow", "FAIL": "red"}
    for check, status, detail, fix in rows:
        table.add_row(check, f"[{colour[status]}]{status}[/]", escape(detail), escape(fix))
    console = Console()
    console.print(table)
    fails = sum(r[1] == "FAIL" for r in rows)
    console.print(
        "preflight passed" + (" (with warnings)" if any(r[1] == "WARN" for r in rows) else "")
        if not fails
        else f"[red]preflight FAILED: {fails} to fix[/]"
    )
    return 1 if fails else 0


def doctor(args) -> int:
    if getattr(args, "preflight", False):
        return _preflight()
    import fastcomms

    print(f"python      {sys.version.split()[0]}")
    print(f"torch       {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"fastcomms   {fastcomms.__file__}")
    print(f"backends    {', '.join(fastcomms.built_backends())}")
    from . import _bootstrap

    try:
        launch = _bootstrap.detect()
        none = (
            "none (new_comm needs store=, or a launcher: torchrun, srun, mpirun, or "
            "RANK/WORLD_SIZE with MASTER_ADDR/MASTER_PORT)"
        )
        print(f"launcher    {none if launch is None else launch.describe()}")
    except _bootstrap.LaunchError as e:
        print(f"launcher    unusable: {e}")
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"GPUs        {n}")
    for i in range(n):
        print(f"  cuda:{i}    {torch.cuda.get_device_name(i)}")
    if n >= 2:
        matrix, nvml_why = _nvlink(list(range(n)))
        if matrix is None:
            print(f"NVLink      unknown ({nvml_why})")
        else:
            for (a, b), v in sorted(matrix.items()):
                if a < b:
                    print(f"  {a}-{b}       {'NVLink' if v else 'no NVLink'}")
    from . import _C

    if n == 0 or not _C.has_transport("nvlink"):
        why = "no CUDA device" if n == 0 else "this build has no CUDA layer"
        print(f"transport   CPU tensors: the collective path over gloo ({why})")
    elif n == 1:
        print("transport   auto -> nvlink for CUDA tensors (ranks sharing GPU 0 of one host)")
    else:  # n >= 2: matrix is NVML's answer above
        joined = matrix is not None and all(v for (a, b), v in matrix.items() if a != b)
        lacks = "NVML cannot answer" if matrix is None else "a GPU pair lacks NVLink"
        print(
            "transport   auto -> nvlink for CUDA tensors (one host, every GPU pair NVLink-joined)"
            if joined
            else f"transport   auto -> collective for CUDA tensors ({lacks})"
        )
    return 0


# -- launching ranks ------------------------------------------------------------------------------
# NOTE [cli ranks]: every subcommand that needs ranks runs one function per rank. Started by a
# launcher (torchrun, srun, mpirun, or RANK/WORLD_SIZE with MASTER_ADDR: NOTE [launchers] in
# fastcomms/_bootstrap.py), this process is one rank: the store is the one new_comm would use
# (torchrun's agent store, or rank 0 serves one), and rank 0 collects every rank's result through
# it. Otherwise --nproc processes are spawned with torch.multiprocessing over a FileStore; the
# first rank that dies ends the run at once, its error printed, instead of leaving the others
# waiting.


def _launch():
    """The launcher this process runs under, or None where the command starts its own ranks:
    RANK/WORLD_SIZE alone (no MASTER_ADDR) and a SLURM allocation's shell outside an ``srun`` step
    (SLURM_PROCID is set there too) do not count."""
    from . import _bootstrap

    launch = _bootstrap.detect()
    if launch is None:
        return None
    if launch.launcher == "env" and "MASTER_ADDR" not in os.environ:
        return None
    if launch.launcher == "slurm" and "SLURM_STEP_ID" not in os.environ:
        return None
    return launch


def _launcher_store(launch):
    import torch.distributed as dist

    from . import _bootstrap

    store = _bootstrap.default_store(launch, datetime.timedelta(seconds=300))
    return dist.PrefixStore("fastcomms-cli", store)


def _child(fn, rank, size, path, q, args):
    import traceback

    import torch.distributed as dist

    try:
        q.put((rank, fn(rank, size, dist.FileStore(path, size), args), None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which ends the run
        q.put((rank, None, traceback.format_exc()))
        raise


_MPS_DIRS = {"CUDA_MPS_PIPE_DIRECTORY": "pipe", "CUDA_MPS_LOG_DIRECTORY": "log"}


@contextlib.contextmanager
def _private_mps(share: bool):
    """NOTE [cli ranks on one GPU]: ranks that share a GPU as separate processes are time-sliced
    without MPS: a device-side wait for a peer on the same GPU lasts until the next context
    switch (tools/gpu/mps.sh says more). Where the command starts the ranks itself, they share
    a GPU, no MPS pipe is set and ``nvidia-cuda-mps-control`` is on PATH, a private MPS daemon
    serves them for the run (as tools/gpu/mps.sh: its pipes in a fresh temporary folder, no GPU
    setting changed; told to quit and its folder removed afterwards). Yields what was done, for
    the report ("" where the ranks do not share a GPU)."""
    if not share:
        yield ""
    elif os.environ.get("CUDA_MPS_PIPE_DIRECTORY"):
        yield "ranks share a GPU as clients of the MPS daemon at CUDA_MPS_PIPE_DIRECTORY"
    elif (control := shutil.which("nvidia-cuda-mps-control")) is None:
        yield (
            "ranks share a GPU time-sliced (nvidia-cuda-mps-control not found: every exchange "
            "waits for context switches; start them as MPS clients)"
        )
    else:
        with tempfile.TemporaryDirectory(prefix="fastcomms-mps.", ignore_cleanup_errors=True) as d:
            env = {**os.environ, **{k: os.path.join(d, f) for k, f in _MPS_DIRS.items()}}
            for k in _MPS_DIRS:
                os.makedirs(env[k])
            r = subprocess.run([control, "-d"], env=env, capture_output=True, text=True)
            if r.returncode != 0:
                yield f"ranks share a GPU time-sliced (the MPS daemon did not start: {r.stderr})"
                return
            os.environ.update({k: env[k] for k in _MPS_DIRS})
            try:
                yield "ranks share a GPU as clients of a private MPS daemon started for this run"
            finally:
                for k in _MPS_DIRS:
                    os.environ.pop(k, None)
                try:
                    subprocess.run(
                        [control],
                        input="quit\n",
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=10,
                    )
                except (OSError, subprocess.SubprocessError) as e:
                    print(f"fastcomms: the private MPS daemon did not quit: {e}", file=sys.stderr)


def _run_ranks(fn, nproc, args, timeout_s=900):
    """fn(rank, size, store, args) on every rank (NOTE [cli ranks]). Returns (results by rank, or
    None on a rank of torchrun other than 0; error text or None)."""
    import pickle
    import queue

    launch = _launch()
    if launch is not None:
        rank, size = launch.rank, launch.size
        store = _launcher_store(launch)
        res = fn(rank, size, store, args)
        store.set(f"result/{rank}", pickle.dumps(res))
        if rank != 0:
            return None, None
        return [pickle.loads(store.get(f"result/{r}")) for r in range(size)], None
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    results, error = {}, None
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "store")
        procs = [
            ctx.Process(target=_child, args=(fn, r, nproc, path, q, args)) for r in range(nproc)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while len(results) < nproc and error is None:
            try:
                r, res, tb = q.get(timeout=0.5)
                if tb is not None:
                    error = f"rank {r} failed:\n{tb}"
                results[r] = res
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    error = f"ranks died (rank, exit code): {dead}"
                elif time.monotonic() > deadline:
                    error = f"no result within {timeout_s} s"
        for p in procs:
            if error is not None:
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if error is not None:
        return None, error
    return [results[r] for r in range(nproc)], None


# -- choosing the backend --------------------------------------------------------------------------
def pick_backend(nproc: int) -> tuple[str, str]:
    """The best backend built and present for `nproc` local ranks and why: nvlink when there is a
    GPU per rank and every pair of them is NVLink-joined (NVML's answer; unknown is not yes), else
    nccl with a GPU per rank, else gloo on CPU; where fewer GPUs than ranks and no gloo were built,
    nvlink with ranks sharing the GPUs (best as MPS clients). Raises ValueError where nothing
    built fits, naming what is missing."""
    from . import _C

    built = [b for b in ("gloo", "nccl", "nvlink") if _C.is_backend_built(b)]
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    launch = _launch()
    multi = False
    if launch is not None:
        nproc = launch.local_size or int(os.environ.get("LOCAL_WORLD_SIZE", nproc))
        multi = launch.size != nproc
    has_cuda = _C.has_transport("nvlink")

    def cpu(why):
        if "gloo" in built:
            return "gloo", f"{why}: CPU ranks over gloo"
        raise ValueError(
            f"{why}, and this build has no gloo backend (built: {', '.join(built) or 'none'}): "
            "install libgloo-dev and rebuild, or run on a machine with a GPU per rank"
        )

    if ngpu == 0:
        return cpu("no CUDA device")
    if not has_cuda or not ({"nccl", "nvlink"} & set(built)):
        return cpu("this build has no CUDA layer")
    if ngpu < nproc:
        why = f"{ngpu} GPUs for {nproc} ranks (one GPU per rank needed for nccl)"
        if "gloo" in built:
            return cpu(why)
        if "nvlink" in built and not multi:
            mps = " as MPS clients" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else ""
            return "nvlink", (
                f"{why}, no gloo built: nvlink with ranks sharing the GPUs{mps} "
                "(timings are HBM copies, not link figures)"
            )
        return cpu(why)
    if multi:
        if "nccl" in built:
            return "nccl", "ranks on several hosts: nccl, the Ulysses collective path"
        return cpu("ranks on several hosts and no nccl built")
    if "nvlink" not in built:
        return "nccl", "this build has no nvlink backend: nccl"
    matrix, why = _nvlink(list(range(nproc)))
    if matrix is None:
        return "nccl", f"NVML cannot say whether the GPUs are NVLink-joined ({why}): nccl"
    if not all(v for (a, b), v in matrix.items() if a != b):
        return "nccl", "a pair of the GPUs is not NVLink-joined: nccl"
    return "nvlink", f"every pair of GPUs 0..{nproc - 1} is NVLink-joined (NVML): nvlink"


def _local_device(rank: int) -> torch.device:
    """cuda:(local rank % GPUs): ranks beyond the GPU count share them (NOTE [cli ranks])."""
    launch = _launch()
    local = rank if launch is None or launch.local_rank is None else launch.local_rank
    return torch.device("cuda", local % max(1, torch.cuda.device_count()))


def _shares_gpu(size: int) -> bool:
    launch = _launch()
    local = size if launch is None else (launch.local_size or size)
    return torch.cuda.device_count() < local


# -- bench -----------------------------------------------------------------------------------------
def _bench_rank(rank, size, store, args):
    """One rank of `fastcomms bench`: ours against permute + torch.distributed all_to_all_single
    + permute, every variant timed as a batch of back-to-back calls (device time between CUDA
    events with the host kept out of the way on GPUs, NOTE [gated device timing]; the host clock
    between barriers on CPU), rounds interleaved, median per variant; every result checked bit
    for bit against torch.distributed first. Returns (rows, transport description)."""
    import torch.distributed as dist

    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    gpu = args.backend != "gloo"
    dev = _local_device(rank) if gpu else torch.device("cpu")
    shared = gpu and _shares_gpu(size)  # NCCL refuses two ranks on one GPU: torch's gloo then
    if gpu:
        torch.cuda.set_device(dev)
    kw = {"device_id": dev} if gpu and not shared else {}
    dist.init_process_group(
        "nccl" if gpu and not shared else "gloo",
        store=dist.PrefixStore("torch", store),
        rank=rank,
        world_size=size,
        **kw,
    )
    comm = None
    if args.backend == "nvlink":
        ours = UlyssesGroup(None, device=dev, transport="nvlink")
    else:
        comm = fastcomms.new_comm(
            args.backend,
            dev,
            "bench",
            store=dist.PrefixStore("fc", store),
            timeout=datetime.timedelta(seconds=120),
        )
        ours = UlyssesGroup(comm, transport="collective")
    dtype = DTYPES[args.dtype]
    timer = None
    if gpu and not shared:  # (ranks sharing a GPU: the baseline is gloo's, host-bound: no gate)

        def agree(v):  # the largest value over the ranks
            t = torch.tensor([float(v)], dtype=torch.float64, device=dev)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return t.item()

        timer = GatedTimer(agree)
    progress = None
    if rank == 0 and args.progress:
        from rich.progress import Progress

        progress = Progress(transient=True)
        task = progress.add_task("bench", total=len(args.shapes) * args.rounds)
        progress.start()
    rows = []
    try:
        for i, shape in enumerate(args.shapes):
            g = torch.Generator().manual_seed(rank * 1000 + i)
            raw = torch.randint(
                0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g
            )
            x = raw.view(dtype).view(shape).to(dev)
            out = ours.empty_output(x)
            want = permute_all_to_all_4d(x, 0, size)  # the reference: torch.distributed's
            out.view(torch.uint8).fill_(0xA5)  # poisoned: an unwritten byte shows
            ours.all_to_all_4d(x, out=out)
            ok = torch.equal(out.view(torch.uint8), want.view(torch.uint8))
            back = ours.all_to_all_4d(want, mode=1)
            ok = ok and torch.equal(back.view(torch.uint8), x.view(torch.uint8))
            variants = {
                "ours": lambda x=x, out=out: ours.all_to_all_4d(x, out=out),
                "permute": lambda x=x: permute_all_to_all_4d(x, 0, size),
            }
            samples = {k: [] for k in variants}
            host = {k: [] for k in variants}
            gated = True
            for fn in variants.values():  # warm-up
                for _ in range(args.warmup):
                    fn()
            for rnd in range(args.rounds):
                if progress is not None:
                    progress.update(task, description=f"{tuple(shape)} round {rnd + 1}")
                for k, fn in variants.items():
                    dist.barrier()
                    if timer is not None:  # NOTE [gated device timing]
                        dev_s, host_s, held = timer.sample(fn, args.iters)
                        gated = gated and held
                    else:
                        if gpu:
                            torch.cuda.synchronize()
                        t0 = time.perf_counter()
                        for _ in range(args.iters):
                            fn()
                        if gpu:
                            torch.cuda.synchronize()
                        dev_s = host_s = (time.perf_counter() - t0) / args.iters
                    samples[k].append(dev_s)
                    host[k].append(host_s)
                if progress is not None:
                    progress.advance(task)
            rows.append(
                {
                    "shape": list(shape),
                    "bytes": x.numel() * x.element_size(),
                    "ours_s": statistics.median(samples["ours"]),
                    "permute_s": statistics.median(samples["permute"]),
                    "ours_host_s": statistics.median(host["ours"]),
                    "permute_host_s": statistics.median(host["permute"]),
                    "gated": gated,
                    "ok": bool(ok),
                }
            )
    finally:
        if progress is not None:
            progress.stop()
    what = f"{ours.transport} ({ours.transport_reason})"
    ours.destroy()
    if comm is not None:
        comm.finalize()
    dist.destroy_process_group()
    return rows, what


def _shapes(args, size):
    if args.shape:
        shapes = []
        for spec in args.shape:
            shape = [int(v) for v in spec.split(",")]
            if len(shape) != 4:
                raise ValueError(f"--shape {spec}: expected b,s,h,d")
            shapes.append(shape)
    else:  # a sweep from small to large messages (bytes per rank grow 4x per step)
        big = args.backend != "gloo"
        seqs = (64, 256, 1024, 4096, 16384) if big else (16, 64, 256, 1024)
        shapes = [[1, s, 8 * size, 128] for s in seqs]
    for shape in shapes:
        if shape[2] % size:
            raise ValueError(f"--shape {shape}: h={shape[2]} is not divisible by {size} ranks")
    return shapes


def _environment():
    env = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "host": __import__("socket").gethostname(),
    }
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


_ASKED = "asked for with --backend"


def _backend_choice(command: str, args, size: int) -> str | None:
    """Why ``args.backend`` runs (``--backend auto``: picks it), or None where none fits (said on
    stderr)."""
    if args.backend != "auto":
        return _ASKED
    try:
        args.backend, why = pick_backend(size)
    except ValueError as e:
        print(f"fastcomms {command}: no backend fits: {e}", file=sys.stderr)
        return None
    return why


def bench(args) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 140)  # logs keep whole rows
    launch = _launch()
    size = args.nproc if launch is None else launch.size
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    why = _backend_choice("bench", args, size)
    if why is None:
        return 2
    if why == _ASKED:
        local = size if launch is None else (launch.local_size or size)
        if args.backend == "nccl" and ngpu < local:
            print(
                f"fastcomms bench: --backend nccl with {local} ranks on this host needs "
                f"{local} GPUs (NCCL takes one GPU per rank); this machine has {ngpu} "
                "(--backend nvlink runs ranks that share a GPU)",
                file=sys.stderr,
            )
            return 2
        if args.backend == "nvlink" and ngpu == 0:
            print("fastcomms bench: --backend nvlink needs a GPU; there is none", file=sys.stderr)
            return 2
    try:
        args.shapes = _shapes(args, size)
    except ValueError as e:
        print(f"fastcomms bench: {e}", file=sys.stderr)
        return 2
    args.progress = sys.stderr.isatty() and not args.no_progress
    lead = launch is None or launch.rank == 0
    if lead:
        console.print(
            f"fastcomms bench: backend [bold]{args.backend}[/] ({escape(why)}), {size} ranks"
        )
    share = args.backend != "gloo" and _shares_gpu(size)
    with _private_mps(share and launch is None) as mps_why:
        if lead and mps_why:
            console.print(f"fastcomms bench: {escape(mps_why)}")
        results, error = _run_ranks(_bench_rank, size, args)
    if error is not None:
        print(f"fastcomms bench: FAILED, {error}", file=sys.stderr)
        return 1
    if results is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    transport = results[0][1]
    per_rank = [r[0] for r in results]
    rows = []
    for i, row in enumerate(per_rank[0]):
        ours = max(r[i]["ours_s"] for r in per_rank)  # the slowest rank
        base = max(r[i]["permute_s"] for r in per_rank)
        rows.append(
            {
                "shape": row["shape"],
                "bytes_per_rank": row["bytes"],
                "ours_us": ours * 1e6,
                "permute_us": base * 1e6,
                "ours_gbps": row["bytes"] / ours / 1e9,
                "permute_gbps": row["bytes"] / base / 1e9,
                "speedup": base / ours,
                "ours_host_us": max(r[i]["ours_host_s"] for r in per_rank) * 1e6,
                "permute_host_us": max(r[i]["permute_host_s"] for r in per_rank) * 1e6,
                "gated": all(r[i]["gated"] for r in per_rank),
                "ok": all(r[i]["ok"] for r in per_rank),
            }
        )
    gpu = args.backend != "gloo"
    how = (
        "host clock around synchronized batches: ranks share a GPU (HBM copies, not link "
        "figures) and the permute baseline runs on torch's gloo"
        if share
        else "device time between CUDA events, the batch queued behind a spin kernel so that the "
        "host's cost stays out of it"
        if gpu
        else "host clock, CPU ranks"
    )
    table = Table(
        title=f"Ulysses all_to_all_4d (mode 0), {args.dtype}: {transport}",
        caption=f"µs per call: {args.iters} back-to-back calls per sample ({how}), median of "
        f"{args.rounds} interleaved rounds after {args.warmup} warm-up calls, slowest rank; "
        "permute = permute + torch.distributed all_to_all_single + permute; every result "
        "checked bit for bit against torch.distributed"
        + (
            "; host µs = what issuing one call costs the host (an eager loop pays the larger "
            "of that and the device time)"
            if gpu
            else ""
        ),
    )
    cols = ["shape (b,s,h,d)", "MiB/rank", "ours µs", "GB/s", "permute µs", "speed-up"]
    if gpu:
        cols += ["ours host µs", "permute host µs"]
    for col in cols:
        table.add_column(col, justify="right")
    table.add_column("check")
    for r in rows:
        table.add_row(
            str(tuple(r["shape"])),
            f"{r['bytes_per_rank'] / 2**20:.2f}",
            f"{r['ours_us']:.1f}",
            f"{r['ours_gbps']:.2f}",
            f"{r['permute_us']:.1f}",
            f"{r['speedup']:.2f}x",
            *([f"{r['ours_host_us']:.1f}", f"{r['permute_host_us']:.1f}"] if gpu else []),
            ("OK" if r["ok"] else "[red]FAIL[/]")
            + ("" if r["gated"] else " (host-bound: the gate did not hold)"),
        )
    console.print(table)
    bad = sum(not r["ok"] for r in rows)
    console.print("all checks passed" if not bad else "[red]SOME CHECKS FAILED[/]")
    if args.json:
        import json

        doc = {
            "backend": args.backend,
            "why": why,
            "transport": transport,
            "ranks": size,
            "dtype": args.dtype,
            "iters": args.iters,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "environment": _environment(),
            "rows": rows,
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        console.print(f"results written to {args.json}")
    if args.plot:
        rc = _plot(rows, args.plot, transport)
        if rc:
            return rc
        console.print(f"plot written to {args.plot}")
    return 1 if bad else 0


def _plot(rows, path, transport) -> int:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "fastcomms bench: --plot needs matplotlib (pip install 'fastcomms[plot]' or "
            "pip install matplotlib)",
            file=sys.stderr,
        )
        return 2
    xs = [r["bytes_per_rank"] / 2**20 for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, style in (
        ("ours", f"fastcomms ({transport.split(' ')[0]})", "o-"),
        ("permute", "permute + all_to_all_single", "s--"),
    ):
        ax[0].loglog(xs, [r[f"{key}_us"] for r in rows], style, label=label)
        ax[1].semilogx(xs, [r[f"{key}_gbps"] for r in rows], style, label=label)
    ax[0].set(xlabel="MiB per rank", ylabel="µs per call", title="time")
    ax[1].set(xlabel="MiB per rank", ylabel="GB/s (bytes per rank / time)", title="throughput")
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
        a.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return 0


def _check_rank(rank, size, store, args):
    """One rank of `fastcomms check`: every op on `backend` against values each rank can compute
    for every rank, results as (name, ok, detail)."""
    import fastcomms
    from fastcomms.ulysses import UlyssesGroup

    backend = args.backend
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    dev = _local_device(rank) if backend in ("nccl", "nvlink") else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    results = []
    comm = None

    def run(name, fn):
        try:
            ok, detail = fn()
        except Exception as e:  # noqa: BLE001 - every failure is reported, none stops the run
            ok, detail = False, f"{type(e).__name__}: {e}"[:300]
        results.append((name, None if ok is None else bool(ok), detail))

    def full(n, v, dtype=torch.float32):
        return torch.full((n,), float(v), dtype=dtype, device=dev)

    try:
        comm = fastcomms.new_comm(
            backend, dev, "check", store=store, timeout=datetime.timedelta(seconds=60)
        )
        n, k, S = size, 4, fastcomms.ReduceOp.SUM

        def all_reduce():
            t = full(k, rank + 1)
            comm.all_reduce(t, S, False)
            return torch.equal(t, full(k, n * (n + 1) // 2)), ""

        def all_reduce_max():
            t = full(k, rank)
            comm.all_reduce(t, fastcomms.ReduceOp.MAX, False)
            return torch.equal(t, full(k, n - 1)), ""

        def broadcast():
            t = full(k, rank)
            comm.broadcast(t, n - 1, False)
            return torch.equal(t, full(k, n - 1)), ""

        def reduce():
            t = full(k, rank + 1)
            comm.reduce(t, 0, S, False)
            return rank != 0 or torch.equal(t, full(k, n * (n + 1) // 2)), ""

        def all_gather_single():
            out = full(n * k, -1)
            comm.all_gather_single(out, full(k, rank), False)
            want = torch.arange(n, device=dev).repeat_interleave(k).float()
            return torch.equal(out, want), ""

        def reduce_scatter_single():
            out = full(k, -1)
            comm.reduce_scatter_single(out, full(n * k, rank + 1), S, False)
            return torch.equal(out, full(k, n * (n + 1) // 2)), ""

        def all_to_all_single():
            inp = (rank * n + torch.arange(n, device=dev)).repeat_interleave(k).float()
            out = full(n * k, -1)
            comm.all_to_all_single(out, inp, False)
            want = (torch.arange(n, device=dev) * n + rank).repeat_interleave(k).float()
            return torch.equal(out, want), ""

        def barrier():
            comm.barrier(False)
            return True, ""

        def send_recv():
            if n == 1:  # a rank's send to itself is refused, as torch.distributed refuses it
                return None, "not run: one rank has no peer"
            got = full(k, -1)
            b = comm.batch_op_create()
            b.send(full(k, rank), (rank + 1) % n)
            b.recv(got, (rank - 1) % n)
            b.issue(False)
            return torch.equal(got, full(k, (rank - 1) % n)), ""

        def ulysses():
            g = UlyssesGroup(comm, device=dev)
            xs = [
                torch.randn(2, 3, 2 * n, 8, generator=torch.Generator().manual_seed(q)).to(dev)
                for q in range(n)
            ]
            y = g.all_to_all_4d(xs[rank])
            want = torch.cat([x[:, :, 2 * rank : 2 * rank + 2] for x in xs], dim=1)
            back = g.all_to_all_4d(y, mode=1)
            ok = torch.equal(y, want) and torch.equal(back, xs[rank])
            return ok, f"transport {g.transport}"

        for name, fn in [
            ("all_reduce (sum)", all_reduce),
            ("all_reduce (max)", all_reduce_max),
            ("broadcast", broadcast),
            ("reduce", reduce),
            ("all_gather_single", all_gather_single),
            ("reduce_scatter_single", reduce_scatter_single),
            ("all_to_all_single", all_to_all_single),
            ("barrier", barrier),
            ("send/recv ring", send_recv),
            ("ulysses all_to_all_4d", ulysses),
        ]:
            run(name, fn)
    except Exception as e:  # noqa: BLE001
        results.append(("new_comm", False, f"{type(e).__name__}: {e}"[:300]))
    if comm is not None:
        comm.finalize()
    return results


def check(args) -> int:
    """A short correctness run of every op on one backend, results per op and rank."""
    import json

    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    launch = _launch()
    size = args.nproc if launch is None else launch.size
    why = _backend_choice("check", args, size)
    if why is None:
        return 2
    results, error = _run_ranks(_check_rank, size, args, timeout_s=300)
    if results is None and error is None:  # a torchrun rank other than 0
        return 0
    console = Console()
    console.print(f"fastcomms check: backend [bold]{args.backend}[/] ({escape(why)}), {size} ranks")
    if error is not None:
        console.print(f"[red]FAILED[/]: {escape(str(error))}")
        return 1
    names = [name for name, _, _ in results[0]] or ["new_comm"]
    bad = 0
    rows = []
    table = Table()
    for col in ("op", "result", "detail"):
        table.add_column(col)
    for i, name in enumerate(names):
        per_rank = [res[i] if i < len(res) else (name, False, "no result") for res in results]
        skipped = all(x[1] is None for x in per_rank)
        ok = skipped or all(x[1] for x in per_rank)
        bad += not ok
        detail = next((x[2] for x in per_rank if x[1] is False), per_rank[0][2])
        rows.append({"op": name, "ok": ok, "skipped": skipped, "detail": detail})
        result = "SKIPPED" if skipped else "OK" if ok else "[red]FAIL[/]"
        # escaped: an error's "[rank r/n name op]" prefix is not rich markup
        table.add_row(name, result, escape(detail))
    console.print(table)
    console.print("all checks passed" if not bad else f"[red]{bad} checks failed[/]")
    if args.json:
        with open(args.json, "w") as f:
            doc = {"backend": args.backend, "why": why, "nproc": size, "results": rows}
            json.dump(doc, f, indent=1)
    return 0 if not bad else 1


def main(argv=None) -> int:
    import fastcomms

    ap = argparse.ArgumentParser(
        prog="fastcomms",
        description="fastcomms: check, benchmark and diagnose (NOTE [cli ranks] in cli.py).",
    )
    ap.add_argument("--version", action="version", version=f"fastcomms {fastcomms.__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ranks = argparse.ArgumentParser(add_help=False)  # what bench and check share
    ranks.add_argument(
        "--backend",
        default="auto",
        choices=["gloo", "nccl", "nvlink", "auto"],
        help="auto: nvlink when every GPU pair is NVLink-joined, else nccl with a GPU per rank, "
        "else gloo on CPU (the reason is printed)",
    )
    ranks.add_argument(
        "--nproc", type=int, default=2, help="ranks to start (ignored under torchrun)"
    )
    ranks.add_argument(
        "--json", default=None, help="also write the results (bench: and the environment) to FILE"
    )
    b = sub.add_parser(
        "bench",
        parents=[ranks],
        help="time and check the Ulysses all-to-all against the permute path",
        description="Times the Ulysses all-to-all (mode 0) against permute + torch.distributed "
        "all_to_all_single + permute on the best backend present (or --backend), checking "
        "every result bit for bit. Starts --nproc ranks itself, or runs as one rank under "
        "torchrun.",
    )
    b.add_argument(
        "--shape",
        action="append",
        default=None,
        help="b,s,h,d: mode 0's input on each rank (repeatable; default: a size sweep)",
    )
    b.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    b.add_argument("--iters", type=int, default=20, help="back-to-back calls per timed sample")
    b.add_argument("--rounds", type=int, default=5, help="interleaved samples per variant")
    b.add_argument("--warmup", type=int, default=3, help="untimed calls per variant first")
    b.add_argument("--plot", default=None, help="write time and GB/s against size to FILE.png")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    d = sub.add_parser("doctor", help="versions, GPUs, NVLink matrix, backends")
    d.add_argument(
        "--preflight",
        action="store_true",
        help="check this machine against what the installed build needs before a job; exit 1 "
        "when something must be fixed",
    )
    sub.add_parser(
        "check", parents=[ranks], help="a short correctness run of every op on one backend"
    )
    args = ap.parse_args(argv)
    return {"bench": bench, "check": check, "doctor": doctor}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
