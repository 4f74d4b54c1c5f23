# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What torch.distributed imports from torchcomms' native module when its torchcomms switch is on
(``torch.distributed.config.use_torchcomms = True`` or ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``):
``new_comm`` and ``_BackendWrapper``. With a module named ``torchcomms`` that aliases fastcomms
(``torchcomms._comms`` resolving to this module; docs/torchcomms.md shows one),
``init_process_group`` and ``new_group`` then make fastcomms communicators and run every
collective on them.

NOTE [torch's torchcomms switch]: torch imports this module while ``import torch`` is still under
way (torch.distributed's import), so nothing here touches torch.distributed at import time. torch
calls ``new_comm(backend, device, name=group_name, store=prefix_store)`` from its process-group
helper, then ``_BackendWrapper(comm)``, and registers what that returns as the backend of the
process group it makes: fastcomms' c10d backend over the communicator (fastcomms._c10d), which
torch also recognizes later (``isinstance(backend, _BackendWrapper)``, ``get_comm()``) to
finalize the communicator when the group is destroyed. torch passes no rank or
size: for the default group they are the environment's (as torchcomms reads them), and for a
``new_group`` of some of the ranks they are this rank's place in the member list that torch's
helper holds (``global_ranks_in_group``), read from its frame, without which the members would
wait for every rank of the job until the timeout.
"""

from __future__ import annotations

import sys

# torchcomms' native module holds every public name (code imports OpName, ReduceOp, the hook
# argument classes, ... from it): so does this one
from . import *  # noqa: F403
from . import _rank_size_override
from . import new_comm as _new_comm
from ._hook_types import *  # noqa: F403


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
        from . import _c10d

        return isinstance(obj, _c10d.ForwardingBackend)


class _BackendWrapper(metaclass=_BackendWrapperType):  # noqa: N801 (torchcomms' name)
    """``_BackendWrapper(comm)``: the c10d backend over ``comm`` that torch's torchcomms switch
    installs on the process group it makes (NOTE [c10d backend over python]). Every backend
    fastcomms makes is an instance (torch asks, then calls ``get_comm()`` to finalize it)."""

    def __new__(cls, comm):
        from . import _c10d
        from .device_mesh import _CommOps

        return _c10d.make_backend(comm.get_rank(), comm.get_size(), _CommOps(comm))
