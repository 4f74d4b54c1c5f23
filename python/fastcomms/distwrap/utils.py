# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Helpers torchcomms' distwrap has beside its functions: the group a call resolves to and the
communicator behind it."""

from __future__ import annotations

import torch.distributed as _td

from fastcomms import distwrap
from fastcomms.device_mesh import comm_of

__all__ = ["get_group", "get_torchcomms_instance"]


def get_group(group=None):
    """``group``, or the default group for None."""
    if group is None:
        group = distwrap._default if distwrap._default is not None else _td.group.WORLD
    return group


def get_torchcomms_instance(pg, device_type=None):
    """The fastcomms communicator behind ``pg`` (None for a group of torch's own). fastcomms
    makes one communicator per group, for the device the group was made for; ``device_type``
    is checked against it."""
    comm = comm_of(pg)
    if comm is not None and device_type is not None and comm.get_device().type != str(device_type):
        raise ValueError(
            f"get_torchcomms_instance: the group's communicator serves "
            f"{comm.get_device().type}, not {device_type}"
        )
    return comm
