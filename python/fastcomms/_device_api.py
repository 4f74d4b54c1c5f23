# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Where the device API's C++ headers are (fastcomms/device/window.hpp), for nvcc -I."""

from __future__ import annotations

import pathlib


def get_include() -> str:
    """The folder to pass to ``nvcc -I`` for ``#include "fastcomms/device/window.hpp"``: the
    wheel's copy (``fastcomms/include``), else the source tree's ``include/``."""
    here = pathlib.Path(__file__).resolve().parent
    for cand in (here / "include", here.parents[1] / "include"):
        if (cand / "fastcomms" / "device" / "window.hpp").exists():
            return str(cand)
    raise FileNotFoundError(
        f"fastcomms' device headers are neither in {here / 'include'} (a wheel) nor in "
        f"{here.parents[1] / 'include'} (a source checkout)"
    )
