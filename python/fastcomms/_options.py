# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Options as torchcomms spells them: ``ReduceOp``, ``CommOptions``, ``Timeout``, and the one
rule for timeouts (``_ms``)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import typing

import torch

from ._C import RedOpType

# Argument and type errors raised here are the extension's: ValueError / TypeError and RuntimeError
# at once (NOTE [error mapping] in python/src/errors.cpp), as torchcomms raises RuntimeError.
from ._C import TypeError as _TypeError
from ._C import ValueError as _ValueError

_DEFAULT_TIMEOUT = datetime.timedelta(seconds=600)


@dataclasses.dataclass(repr=False, unsafe_hash=True)
class ReduceOp:
    """A reduction: ``ReduceOp.SUM`` ... and ``ReduceOp.PREMUL_SUM(factor)``; ``.type`` gives
    the RedOpType."""

    # one per RedOpType but PREMUL_SUM, set below the class (typed here for type checkers)
    SUM = PRODUCT = MIN = MAX = BAND = BOR = BXOR = AVG = typing.cast("ReduceOp", None)
    type: RedOpType
    # PREMUL_SUM's: a number, or a one-element tensor read where the op runs (NOTE [device
    # factor] in include/fastcomms/core/reduce_op.hpp: on a CUDA op, no host sync)
    factor: float | torch.Tensor = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.factor, torch.Tensor):
            self.factor = float(self.factor)

    def __repr__(self) -> str:
        if self.type == RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({self.factor})"
        return f"ReduceOp.{self.type.name}"

    @staticmethod
    def PREMUL_SUM(factor: float | torch.Tensor) -> ReduceOp:  # noqa: N802 (torchcomms' spelling)
        """Sum of ``factor * input``: ``factor`` a number or a one-element floating-point tensor
        on the op's device (cast to the reduced tensor's dtype on the caller's stream)."""
        return ReduceOp(RedOpType.PREMUL_SUM, factor)


for _t in RedOpType.__members__.values():
    if _t != RedOpType.PREMUL_SUM:
        setattr(ReduceOp, _t.name, ReduceOp(_t))


class Timeout(datetime.timedelta):
    """torchcomms' Timeout: a ``datetime.timedelta`` (fastcomms takes any timedelta where a
    timeout goes)."""


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if not v:
        return default
    if (k := v.strip().lower()) in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return k in ("1", "true", "yes", "on")
    raise _ValueError(f"{name} must be true or false (1/0, yes/no, on/off), got {v!r}")


def _env_timeout() -> datetime.timedelta:
    if not (v := os.environ.get("TORCHCOMM_TIMEOUT_SECONDS")):
        return _DEFAULT_TIMEOUT
    try:
        seconds = float(v)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise _ValueError(f"TORCHCOMM_TIMEOUT_SECONDS must be a positive number, got {v!r}")
    return datetime.timedelta(seconds=seconds)


@dataclasses.dataclass(eq=False)
class CommOptions:
    """Communicator options as torchcomms spells them. Unset fields take their defaults from
    ``TORCHCOMM_TIMEOUT_SECONDS`` (else 600 s) and ``TORCHCOMM_ABORT_ON_ERROR``. Unlike
    torchcomms, whose abort default is true, fastcomms aborts the process only when asked
    (the argument or the variable): a timeout or an error is an exception by default."""

    abort_process_on_timeout_or_error: bool | None = None
    timeout: datetime.timedelta | None = None
    store: typing.Any = None
    hints: dict[str, str] | None = None
    name: str = ""
    enable_reconfigure: bool = False

    def __post_init__(self) -> None:
        abort = self.abort_process_on_timeout_or_error
        if abort is None:
            abort = _env_bool("TORCHCOMM_ABORT_ON_ERROR", False)
        self.abort_process_on_timeout_or_error = bool(abort)
        self.timeout = _env_timeout() if self.timeout is None else _ms(self.timeout)
        self.hints = dict(self.hints or {})
        self.enable_reconfigure = bool(self.enable_reconfigure)


def _ms(td, where: str = "") -> datetime.timedelta | None:
    """A timeout as the C++ side takes it. One rule everywhere (new_comm, set_timeout, per op,
    windows, monitored_barrier): None means the default, anything else must be positive; under a
    millisecond rounds up to one (the C++ side counts milliseconds, where 0 would read as "the
    default"). ``where`` prefixes the error (rank, communicator, op)."""
    if td is None:
        return None
    if not isinstance(td, datetime.timedelta):
        td = datetime.timedelta(seconds=float(td))
    if td <= datetime.timedelta(0):
        raise _ValueError(f"{where + ' ' if where else ''}timeout must be positive, got {td!r}")
    return max(td, datetime.timedelta(milliseconds=1))


def _op(op) -> tuple[RedOpType, float | torch.Tensor]:
    if isinstance(op, ReduceOp):
        return op.type, op.factor
    if isinstance(op, RedOpType):
        return op, 1.0
    raise _TypeError(f"op must be a ReduceOp, got {type(op).__name__}")
