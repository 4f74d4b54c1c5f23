# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Ulysses all-to-all (API.md §2).

mode 0 (scatter heads, gather sequence): (b, s_local, n_global, d) -> (b, s_global, n_local, d);
mode 1 is the inverse. Differentiable: the backward of one mode is the other mode with the same
splits. Grouped-query and multi-query attention: ``kv_replicas`` (``UlyssesGroup.all_to_all_4d``).

The exchange is one C++ op (NOTE [ulysses op in c++] in python/src/ulysses_op.cpp): it checks the
call, runs it on the group's transport (NVLink, hierarchical, or the collective path of a
TorchComm or a torch.distributed ProcessGroup) and carries its autograd. This module forwards to
it (the plain call, ``out=`` and FP8 on the wire are overloads of that op; the async form, its
side stream and lend ring are C++'s too: NOTE [async ulysses in c++]) and holds what stays in
Python: the choice of transport.

This module is the face: it re-exports the group (``fastcomms._ulysses``), the ring exchange
(``fastcomms.ring``) and the 2-D group (``fastcomms.sequence_parallel``), as API.md names them.

NOTE [no import circles]: no module of the package imports another that imports it back, directly
or through others, neither when it is imported nor later inside a function
(tests/python/test_import_graph.py reads every import statement; tests/python/test_imports.py
imports every public module first in a fresh process). Shared pieces sit below their users: the
work types in ``_work``, a communicator's attachments on the communicator (NOTE [communicator
attachments] in ``_comm``), the group in ``_ulysses`` below both this face and
``sequence_parallel``. An import inside a function that closes no circle may put a module's
import cost off to its first use (the 2-D group here, ``device_mesh`` in ``_ulysses`` and
``ring``); one that would close a circle is allowed only where it must be (torch still
initializing) and says why on its line (``# deferred: ...``).
"""

from __future__ import annotations

import typing

from ._ulysses import UlyssesGroup, all_to_all_4d, nvlink_decision
from ._work import RingWork
from .ring import RingGroup, zigzag_indices, zigzag_shard, zigzag_unshard

if typing.TYPE_CHECKING:
    from .sequence_parallel import SequenceParallelGroup

__all__ = [
    "RingGroup",
    "RingWork",
    "SequenceParallelGroup",
    "UlyssesGroup",
    "all_to_all_4d",
    "nvlink_decision",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]


def __getattr__(name: str):
    """The 2-D group on first read (PEP 562): importing ``sequence_parallel`` and the process-group
    layer it builds on costs a Ulysses-only process about 6 ms of import (sequence_parallel imports
    ``_ulysses``, not this module, so the deferral closes no circle)."""
    if name == "SequenceParallelGroup":
        from .sequence_parallel import SequenceParallelGroup

        globals()[name] = SequenceParallelGroup
        return SequenceParallelGroup
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
