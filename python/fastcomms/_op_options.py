# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' per-operation option classes (``SendOptions`` ... ``AllGatherPExecOptions``):
each made with no arguments, holding ``timeout`` and ``hints``. torchcomms' Python methods take
``hints`` and ``timeout`` themselves, so these only carry values for code that builds them
(``BatchP2POptions`` and ``ReconfigureOptions`` live with their operations)."""

from __future__ import annotations

import datetime

InitHandle = str  # torchcomms' alias: what get_init_handle() returns


class _OpOptions:
    """``timeout`` (None: the communicator's) and ``hints``."""

    __slots__ = ("timeout", "hints")

    def __init__(self) -> None:
        self.timeout: datetime.timedelta | None = None
        self.hints: dict[str, str] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}(timeout={self.timeout}, hints={self.hints})"


NAMES = (
    "SendOptions",
    "RecvOptions",
    "BroadcastOptions",
    "AllReduceOptions",
    "ReduceOptions",
    "AllGatherOptions",
    "AllGatherSingleOptions",
    "ReduceScatterOptions",
    "ReduceScatterSingleOptions",
    "AllToAllOptions",
    "AllToAllSingleOptions",
    "AllToAllvSingleOptions",
    "BarrierOptions",
    "ScatterOptions",
    "GatherOptions",
    "AllGatherPInitOptions",
    "AllGatherPExecOptions",
)
for _name in NAMES:
    globals()[_name] = type(_name, (_OpOptions,), {"__slots__": (), "__module__": __name__})
__all__ = ["InitHandle", *NAMES]
