# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Persistent all-gather (torchcomms' ``all_gather_p_init`` / ``_exec`` / ``_free``).

NOTE [persistent all-gather]: ``all_gather_p_init(output)`` keeps ``output`` in an
``AllGatherPHandle`` and registers its memory once with a backend that registers memory (nccl's
``ncclCommRegister``; nvlink through its inner nccl communicator), so ``all_gather_p_exec`` does
no per-call registration; gloo gathers into the buffer as it is. Each exec is an all-gather of
``input`` into the handle's output, checked every call (the output's numel is size times the
input's, same dtype and device). ``all_gather_p_free`` deregisters and drops the buffer; a second
free (or ``free(None)``, as torchcomms') does nothing, an exec after the free raises. Hooks and
the flight recorder see the exec as ``OpName.all_gather_p_exec`` (torchcomms' name for it in its
traces; torchcomms' own hooks are not called for it); init and free call no hooks."""

from __future__ import annotations

import torch

from . import _hook_types as _ht
from ._ops import _hooked
from ._options import _ms, _TypeError
from ._work import TorchWork


class AllGatherPHandle:
    """The handle ``all_gather_p_init`` returns: opaque, as torchcomms' (``output`` is the buffer
    it gathers into, until freed)."""

    __slots__ = ("_p", "_where", "__weakref__")

    def __init__(self, p, where: str) -> None:
        self._p, self._where = p, where  # the C++ handle keeps the state (freed or not)

    @property
    def output(self) -> torch.Tensor | None:
        """The output tensor given to ``all_gather_p_init`` (None once freed)."""
        return None if self._p.freed() else self._p.output()

    def is_freed(self) -> bool:
        return self._p.freed()

    def __repr__(self) -> str:
        state = "freed" if self.is_freed() else f"output {tuple(self._p.output().shape)}"
        return f"AllGatherPHandle({self._where}, {state})"


def _where(comm, op: str) -> str:
    return f"[rank {comm.get_rank()}/{comm.get_size()} {comm.get_name()} {op}]"


def _check_handle(comm, handle, op: str) -> AllGatherPHandle:
    if not isinstance(handle, AllGatherPHandle):
        raise _TypeError(
            f"{_where(comm, op)} handle must be the AllGatherPHandle all_gather_p_init returned, "
            f"got {type(handle).__name__}"
        )
    return handle  # (one of another communicator: the C++ communicator refuses it)


def all_gather_p_init(self, output, hints=None, timeout=None) -> AllGatherPHandle:
    """Keeps ``output`` (size * the input's elements) for later ``all_gather_p_exec`` calls and
    registers it with the backend where it registers memory. Local."""
    where = _where(self, "all_gather_p_init")
    if not isinstance(output, torch.Tensor):
        raise _TypeError(f"{where} output must be a tensor, got {type(output).__name__}")
    # (a Python backend's gathers as its all_gather_single)
    p = self._c.all_gather_p_init(output, _ms(timeout), None if hints is None else dict(hints))
    return AllGatherPHandle(p, where[1 : -len(" all_gather_p_init]")])


def all_gather_p_exec(self, handle, input, async_op, hints=None, timeout=None) -> TorchWork:
    """Gathers every rank's ``input`` into the handle's output (collective)."""
    h = _check_handle(self, handle, "all_gather_p_exec")  # (a freed one: C++ refuses it)
    if not isinstance(input, torch.Tensor):
        raise _TypeError(
            f"{_where(self, 'all_gather_p_exec')} input must be a tensor, got "
            f"{type(input).__name__}"
        )
    c, p = self._c, h._p
    hints = None if hints is None else dict(hints)

    def issue():
        return TorchWork(c.all_gather_p_exec(p, input, bool(async_op), _ms(timeout), hints))

    if self._hooked:  # NOTE [one hook registry]
        pre = lambda: _ht.AllGatherPExecPreHookArgs(input, p.output(), async_op)  # noqa: E731
        return _hooked(self, _ht.OpName.all_gather_p_exec, pre, issue)
    return issue()


def all_gather_p_free(self, handle) -> None:
    """Releases the handle: deregisters its buffer and drops it (None, a freed one: no-op)."""
    if handle is None:
        return
    self._c.all_gather_p_free(_check_handle(self, handle, "all_gather_p_free")._p)
