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


def load() -> None:
    if lib := core_library():
        ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_DEEPBIND)
