# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What torch.distributed imports from torchcomms' native module when its torchcomms switch is on
(docs/torchcomms.md): ``new_comm`` and ``_BackendWrapper``, with every public name besides.

NOTE [torch's torchcomms switch]: torch imports this module while ``import torch`` is still under
way, so nothing here touches torch.distributed at import time. torch calls ``new_comm(backend,
device, name=group_name, store=prefix_store)``, then ``_BackendWrapper(comm)``, and registers the
result (fastcomms' c10d backend, fastcomms._C.ForwardingBackend) as the process group's backend;
it recognizes it later (``isinstance``, ``get_comm()``) to finalize the communicator. torch passes
no rank or size: for the default group they are the environment's; for a ``new_group`` they are this
rank's place in the member list of torch's helper (``global_ranks_in_group``, read from its
frame), without which the members would wait for every rank of the job until the timeout.
"""

from __future__ import annotations

import sys

# every public name, as torchcomms' native module (code imports OpName, ReduceOp, ... from it)
from . import *  # noqa: F403
from . import _rank_size_override
from . import new_comm as _new_comm
from ._hook_types import *  # noqa: F403
from ._registry import _is_backend_registered  # noqa: F401  (torch's switch imports it)


def new_comm(backend, device, name=None, *args, **kwargs):
    """fastcomms.new_comm, with the rank and size of the group torch is making."""
    caller = sys._getframe(1).f_locals
    members = caller.get("global_ranks_in_group")
    token = None
    if members:
        import torch.distributed as dist

        me = dist.get_rank() if dist.is_initialized() else None
        if me is not None and me in members:
            token = _rank_size_override.set((list(members).index(me), len(members)))
    try:
        return _new_comm(backend, device, name, *args, **kwargs)
    finally:
        if token is not None:
            _rank_size_override.reset(token)


class _BackendWrapperType(type):
    def __instancecheck__(cls, obj) -> bool:
        from . import _C

        return isinstance(obj, _C.ForwardingBackend)


class _BackendWrapper(metaclass=_BackendWrapperType):  # noqa: N801 (torchcomms' name)
    """``_BackendWrapper(comm)``: the c10d backend over ``comm`` (NOTE [c10d backend over
    python]); every backend fastcomms makes is an instance (torch asks before ``get_comm()``)."""

    def __new__(cls, comm):
        from . import _C
        from .device_mesh import _CommOps

        return _C.make_backend(comm.get_rank(), comm.get_size(), _CommOps(comm))
