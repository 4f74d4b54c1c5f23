# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Batched point-to-point ops (torchcomms'): ``P2POp``, ``BatchSendRecv``."""

from __future__ import annotations

import datetime
import enum
import typing

import torch

from ._options import _ValueError

if typing.TYPE_CHECKING:
    from ._comm import TorchComm
    from ._work import TorchWork


class P2POpType(enum.Enum):
    """The kind of a point-to-point op in a batch (torchcomms')."""

    SEND = 1
    RECV = 2


class P2POp:
    """One point-to-point op of a batch: ``P2POp(P2POpType.SEND, tensor, peer)`` as torchcomms;
    "send"/"recv" or the bound ``send``/``recv`` methods are accepted for the type too."""

    def __init__(self, type, tensor: torch.Tensor, peer: int) -> None:  # noqa: A002
        if not isinstance(type, P2POpType):
            name = type if isinstance(type, str) else getattr(type, "__name__", "")
            if name not in ("send", "recv", "isend", "irecv"):
                raise _ValueError(f"P2POp: type must be P2POpType.SEND or RECV, got {type!r}")
            type = P2POpType.SEND if name in ("send", "isend") else P2POpType.RECV  # noqa: A001
        self.type, self.tensor, self.peer = type, tensor, int(peer)

    @property
    def is_send(self) -> bool:
        return self.type is P2POpType.SEND


class BatchP2POptions:
    """Options of ``BatchSendRecv.issue`` (torchcomms'): ``timeout`` and ``hints``."""

    def __init__(self) -> None:
        self.timeout: datetime.timedelta | None = None
        self.hints: dict[str, str] = {}


class BatchSendRecv:
    """``comm.batch_op_create()``: collect sends and receives, then ``issue(async_op)``."""

    def __init__(self, comm: TorchComm) -> None:
        self._comm = comm
        self.ops: list[P2POp] = []

    def send(self, tensor: torch.Tensor, dst: int) -> BatchSendRecv:
        self.ops.append(P2POp(P2POpType.SEND, tensor, dst))
        return self

    def recv(self, tensor: torch.Tensor, src: int) -> BatchSendRecv:
        self.ops.append(P2POp(P2POpType.RECV, tensor, src))
        return self

    def issue(self, async_op: bool, options=None, hints=None, timeout=None) -> TorchWork:
        """Issues the batch; ``options`` (a BatchP2POptions) may carry ``hints`` and ``timeout``."""
        if options is not None:
            hints = getattr(options, "hints", None) or hints
            timeout = getattr(options, "timeout", None) or timeout
        ops = [(op.is_send, op.tensor, op.peer) for op in self.ops]
        return self._comm._batch_op_issue(ops, async_op, hints, timeout)
