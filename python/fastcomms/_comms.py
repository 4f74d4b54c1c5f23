# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What torch.distributed imports from torchcomms' native module when its torchcomms switch is on
(``torch.distributed.config.use_torchcomms = True`` or ``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1``):
``new_comm`` and ``_BackendWrapper``. With a module named ``torchcomms`` that aliases fastcomms
(``torchcomms._comms`` resolving to this module; README shows one), ``init_process_group`` and
``new_group`` then make fastcomms communicators and run every collective on them.

NOTE [torch's torchcomms switch]: torch imports this module while ``import torch`` is still under
way (torch.distributed's import), so nothing here touches torch.distributed at import time. torch
calls ``new_comm(backend, device, name=group_name, store=prefix_store)`` from its process-group
helper, then ``_BackendWrapper(comm)``, and installs what that returns; a ``ProcessGroup``
is installed as the group itself, which is what fastcomms returns (the process group of
fastcomms.device_mesh over the communicator, which torch then names). torch passes no rank or
size: for the default group they are the environment's (as torchcomms reads them), and for a
``new_group`` of some of the ranks they are this rank's place in the member list that torch's
helper holds (``global_ranks_in_group``), read from its frame, without which the members would
wait for every rank of the job until the timeout.
"""

from __future__ import annotations

import sys

from . import _rank_size_override
from . import new_comm as _new_comm

__all__ = ["new_comm", "_BackendWrapper"]


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


def _BackendWrapper(comm):  # noqa: N802 (torchcomms' name)
    """The torch.distributed process group over ``comm`` for torch's torchcomms switch."""
    from .device_mesh import _CommOps, _process_group

    return _process_group(_CommOps(comm))  # torch names and registers it
