# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The "fake" backend, as torchcomms has it: one rank (rank 0 of 1), no store and no peers;
every operation completes at once and leaves its tensors as they are. For tests of code around
communicators (hooks, flight recorder, process groups, tracing) in a single process:
``fastcomms.new_comm("fake", "cpu", "name")``."""

from __future__ import annotations

from ._ops import COLLECTIVE_METHODS
from ._registry import TorchCommBackend, register_backend


class FakeBackend(TorchCommBackend):
    """Rank 0 of 1; every op is done when called and moves nothing (None: done)."""

    def init(self, device, name, options) -> None:
        self.device, self.name, self.options = device, name, options


_ANSWERS = {"get_rank": 0, "get_size": 1, "get_backend_version": "fake", "finalize": None}
for _op, _answer in {**_ANSWERS, **dict.fromkeys(("batch_op_issue", *COLLECTIVE_METHODS))}.items():
    setattr(FakeBackend, _op, lambda self, *args, _answer=_answer: _answer)
register_backend("fake", FakeBackend)
