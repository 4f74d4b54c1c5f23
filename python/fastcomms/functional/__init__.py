# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Functional collectives on fastcomms communicators, traceable by torch.compile.

Each function takes a tensor and a ``TorchComm`` (or a process group from fastcomms.device_mesh)
and forwards to torch's own functional collective on the communicator's process group, so
``torch.compile(fullgraph=True)`` traces and schedules it like torch's; eagerly the result is an
``AsyncCollectiveTensor`` whose first use waits. The ``*_autograd`` forms are differentiable.

NOTE [functional over a communicator]: a communicator reaches its process group's registered name
through its ``_process_group_name`` member, which torch.compile evaluates on the real (opaque)
object, so the graph holds a constant group name. The group is made on first use
(fastcomms.device_mesh); its "global" ranks are the communicator's, so ``src`` is a comm rank.
"""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed._functional_collectives as _funcol
from torch.torch_version import TorchVersion

from .. import _comm
from .._comm import TorchComm
from .._options import ReduceOp
from ..device_mesh import _create_torchcomm_process_group, comm_of

__all__ = [
    "all_reduce",
    "broadcast",
    "all_gather_tensor",
    "all_gather_tensor_autograd",
    "reduce_scatter_tensor",
    "reduce_scatter_tensor_autograd",
    "all_to_all_single",
    "all_to_all_single_autograd",
    "is_torch_compile_supported",
    "is_torch_compile_supported_and_enabled",
]

_serial = itertools.count()


def _process_group_name_of(comm) -> str:
    """A communicator's process group (NOTE [communicator attachments]): registered with torch
    on first use, its name held by the communicator."""
    name = f"fastcomms/functional/{next(_serial)}/{comm.get_name()}"
    _create_torchcomm_process_group(comm, name)
    return name


_comm.ATTACHMENTS["process_group_name"] = _process_group_name_of


def _group(comm):
    if isinstance(comm, TorchComm):
        return comm._process_group_name
    if comm_of(comm) is not None:
        return comm.group_name
    raise TypeError(
        f"fastcomms.functional: expected a TorchComm or a fastcomms process group, got "
        f"{type(comm).__name__}"
    )


def _op(op) -> str:
    if isinstance(op, str):
        return op
    if isinstance(op, ReduceOp):
        return op.type.name.lower()
    return str(getattr(op, "name", op)).split(".")[-1].lower()


def all_reduce(tensor: torch.Tensor, op, comm) -> torch.Tensor:
    """The reduction of ``tensor`` over the communicator (``op``: a ReduceOp or "sum", "avg",
    "product", "min", "max", ...)."""
    return _funcol.all_reduce(tensor, _op(op), _group(comm))


def broadcast(tensor: torch.Tensor, src: int, comm) -> torch.Tensor:
    """``tensor`` of rank ``src`` (a rank of the communicator) on every rank."""
    return _funcol.broadcast(tensor, src, _group(comm))


def all_gather_tensor(tensor: torch.Tensor, gather_dim: int, comm) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated along ``gather_dim`` in rank order."""
    return _funcol.all_gather_tensor(tensor, gather_dim, _group(comm))


def all_gather_tensor_autograd(tensor: torch.Tensor, gather_dim: int, comm) -> torch.Tensor:
    """all_gather_tensor with a backward (a reduce-scatter of the gradient)."""
    return _funcol.all_gather_tensor_autograd(tensor, gather_dim, _group(comm))


def reduce_scatter_tensor(tensor: torch.Tensor, op, scatter_dim: int, comm) -> torch.Tensor:
    """The reduction over ranks, split along ``scatter_dim``; rank r keeps part r."""
    return _funcol.reduce_scatter_tensor(tensor, _op(op), scatter_dim, _group(comm))


def reduce_scatter_tensor_autograd(tensor, op, scatter_dim: int, comm) -> torch.Tensor:
    """reduce_scatter_tensor with a backward (an all-gather of the gradient)."""
    return _funcol.reduce_scatter_tensor_autograd(tensor, _op(op), scatter_dim, _group(comm))


def all_to_all_single(tensor, output_split_sizes, input_split_sizes, comm) -> torch.Tensor:
    """The all-to-all of dimension 0 (splits None: even)."""
    return _funcol.all_to_all_single(tensor, output_split_sizes, input_split_sizes, _group(comm))


def all_to_all_single_autograd(tensor, output_split_sizes, input_split_sizes, comm):
    """all_to_all_single with a backward (the all-to-all with the splits swapped)."""
    return _funcol.all_to_all_single_autograd(
        tensor, output_split_sizes, input_split_sizes, _group(comm)
    )


# NOTE [compiled communicator methods] needs opaque objects whose methods Dynamo inlines: torch 2.11
MIN_PYTORCH_VERSION_FOR_COMPILE = "2.11.0.dev0"


def is_torch_compile_supported(
    min_version: str = MIN_PYTORCH_VERSION_FOR_COMPILE, _current_version: str | None = None
) -> bool:
    """torchcomms' check: whether this torch (or ``_current_version``) is at least
    ``min_version``, the first torch whose compiler traces the communicator's own methods
    (``comm.all_reduce(t, op, async_op)`` inside ``torch.compile(fullgraph=True)``).
    ``TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT=1`` makes it True, as in torchcomms."""
    if os.environ.get("TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT") == "1":
        return True
    current = torch.__version__ if _current_version is None else _current_version
    return TorchVersion(current) >= (min_version or MIN_PYTORCH_VERSION_FOR_COMPILE)


# torchcomms' switch for the communicator's methods under torch.compile; torchcomms also asks for
# TORCHCOMMS_PATCH_FOR_COMPILE=1, but fastcomms needs no patching.
is_torch_compile_supported_and_enabled = is_torch_compile_supported
