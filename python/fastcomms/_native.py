# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Loading the native library before the extension (NOTE [gloo symbols])."""

from __future__ import annotations

import ctypes
import os
import sys


# NOTE [gloo symbols]: torch exports its own, newer Gloo build; our gloo backend links Debian's.
# libfastcomms.so is therefore loaded first, by itself, with RTLD_DEEPBIND: it and the libraries
# it brings (libgloo) resolve their own symbols before anything global, so the two Gloo builds
# never mix (mixing them crashed as soon as two ranks connected). The extension then reuses it.
def core_library() -> str | None:
    """The path of libfastcomms.so beside the package (None where the extension links it some
    other way)."""
    libs = (os.path.join(d, "libfastcomms.so") for d in sys.modules[__package__].__path__)
    return next(filter(os.path.exists, libs), None)


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


# NOTE [one torch per build]: the extension is C++ against one torch's headers; torch's C++ ABI
# changes between minor versions (2.15 dropped symbols 2.11 exports and added virtuals), so an
# extension built for one minor fails in another with an undefined symbol, or worse. The build
# writes the torch it compiled against (_built.py, python/CMakeLists.txt); import compares minors
# first and names both. tools/build/torch_requirement.py makes a source install build against the
# torch already installed and pins that minor in the wheel.
def check_torch() -> None:
    import torch

    try:
        from . import _built
    except ImportError:  # a layout without the generated file (nothing to compare against)
        return
    built, running = _built.TORCH_VERSION, torch.__version__
    if _minor(built) != _minor(running):
        raise ImportError(
            f"fastcomms was built against torch {built}, but torch {running} is installed; "
            f"reinstall fastcomms against this torch (pip install --no-build-isolation "
            f"--force-reinstall <fastcomms source>, or a fastcomms wheel made for torch "
            f"{'.'.join(map(str, _minor(running)))}), or install torch=="
            f"{'.'.join(map(str, _minor(built)))}.*"
        )


def load() -> None:
    check_torch()
    if lib := core_library():
        ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_DEEPBIND)
