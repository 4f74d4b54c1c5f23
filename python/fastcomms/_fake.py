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

    def get_rank(self) -> int:
        return 0

    def get_size(self) -> int:
        return 1

    def get_backend_version(self) -> str:
        return "fake"

    def finalize(self) -> None:
        pass


for _op in ("batch_op_issue", *COLLECTIVE_METHODS):
    setattr(FakeBackend, _op, lambda self, *args: None)
register_backend("fake", FakeBackend)
