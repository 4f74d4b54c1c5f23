# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The torch a fastcomms build compiles against, and the torch its wheel then requires.

A scikit-build-core dynamic-metadata provider (pyproject.toml, ``[[tool.dynamic-metadata]]``),
NOTE [one torch per build]:

- ``get_requires_for_dynamic_metadata`` adds torch to the build requirements. Under pip's build
  isolation that decides which torch the extension is compiled against, so it asks for the torch
  already installed in the environment being installed into (found through ``sysconfig``, which
  still names that environment's site-packages while pip hides them from ``sys.path``; then
  ``$VIRTUAL_ENV`` and ``$CONDA_PREFIX``). With none there, the newest torch >= 2.11.
- ``dynamic_metadata`` writes the wheel's torch requirement as ``torch==X.Y.*`` for the X.Y the
  build saw. A source install built against the installed torch therefore requires exactly it and
  never replaces it; a wheel pins the minor it was built for (the C++ ABI changes between minors).

Refused rather than silently wrong: an installed torch older than 2.11 raises here, at build time,
instead of compiling against a torch the package does not support or quietly upgrading the user's.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys
import sysconfig
from pathlib import Path

OLDEST = (2, 11)  # the oldest torch fastcomms builds against (docs/development.md)
OTHERS = ["rich>=13"]


def _minor(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)


def _target_site_dirs() -> list[str]:
    """Site-packages of the environment the package is being installed into."""
    dirs = [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
    py = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for var in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        prefix = os.environ.get(var)
        if prefix:
            dirs.append(str(Path(prefix) / "lib" / py / "site-packages"))
    seen: list[str] = []
    for d in dirs:
        if d not in seen and Path(d).is_dir():
            seen.append(d)
    return seen


def installed_torch() -> str | None:
    """The version of the torch installed where fastcomms is going, or None."""
    for dist in md.distributions(path=_target_site_dirs()):
        if (dist.metadata["Name"] or "").lower() == "torch":
            return dist.version
    return None


def _check_supported(version: str, where: str) -> None:
    if _minor(version) < OLDEST:
        raise RuntimeError(
            f"fastcomms builds against torch {OLDEST[0]}.{OLDEST[1]} or newer; {where} has torch "
            f"{version}. Upgrade torch first (pip install 'torch>={OLDEST[0]}.{OLDEST[1]}')."
        )


def get_requires_for_dynamic_metadata(settings=None) -> list[str]:
    version = os.environ.get("FASTCOMMS_BUILD_TORCH") or installed_torch()
    if not version:
        return [f"torch>={OLDEST[0]}.{OLDEST[1]}"]
    _check_supported(version, "the environment being installed into")
    # The public part only: a local label (+cu130) is not on PyPI, and == without one matches it.
    return [f"torch=={version.split('+')[0]}"]


def dynamic_metadata(settings=None, project=None) -> dict:
    try:
        version = md.version("torch")
    except md.PackageNotFoundError as e:
        raise RuntimeError("fastcomms' build needs torch in the build environment") from e
    _check_supported(version, "the build environment")
    major, minor = _minor(version)
    return {"dependencies": [f"torch=={major}.{minor}.*", *OTHERS]}
