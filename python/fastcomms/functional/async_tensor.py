# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' async tensor: a tensor whose asynchronous work is waited for on first use.

``TorchCommsAsyncTensor(elem, work)`` stands for ``elem`` while ``work`` (a ``TorchWork``, any
object with ``wait()``, or None) may still be writing it. The first operation on it waits for
the work once and runs on ``elem``; what comes back is a plain tensor. To autograd it is
``elem`` itself: ``grad_fn``, ``is_leaf`` and ``grad`` (read and set) are ``elem``'s, and
operations run on ``elem``, so gradients reach whatever ``elem`` came from. Eager use; the
functional collectives of ``fastcomms.functional`` return torch's ``AsyncCollectiveTensor``
(the same idea, torch's own type), which torch.compile traces.
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

__all__ = ["TorchCommsAsyncTensor"]


class TorchCommsAsyncTensor(torch.Tensor):
    elem: torch.Tensor
    work: object
    completed: bool

    @staticmethod
    def __new__(cls, elem: torch.Tensor, work=None):
        if not isinstance(elem, torch.Tensor):
            raise TypeError(
                f"TorchCommsAsyncTensor: elem must be a torch.Tensor, got {type(elem).__name__}"
            )
        if work is not None and not callable(getattr(work, "wait", None)):
            raise TypeError(
                f"TorchCommsAsyncTensor: work must have a wait() method or be None, got "
                f"{type(work).__name__}"
            )
        out = torch.Tensor._make_wrapper_subclass(
            cls,
            elem.size(),
            strides=elem.stride(),
            storage_offset=elem.storage_offset(),
            dtype=elem.dtype,
            layout=elem.layout,
            device=elem.device,
            requires_grad=elem.requires_grad,
        )
        out.elem, out.work, out.completed = elem, work, False
        return out

    def trigger_wait(self) -> torch.Tensor:
        """Waits for the work until a wait returns (later calls return at once; a wait that
        raised is tried again by the next use); returns ``elem``."""
        if not self.completed:
            if self.work is not None:
                self.work.wait()
            self.work, self.completed = None, True
        return self.elem

    wait = trigger_wait

    @property
    def grad_fn(self):
        return self.elem.grad_fn

    @property
    def is_leaf(self) -> bool:
        return self.elem.is_leaf

    @property
    def grad(self):
        return self.elem.grad

    @grad.setter
    def grad(self, value) -> None:
        self.elem.grad = value

    def __repr__(self) -> str:
        return f"TorchCommsAsyncTensor({self.trigger_wait()!r})"

    @staticmethod
    def _unwrap(args, kwargs):
        return pytree.tree_map_only(
            TorchCommsAsyncTensor, lambda t: t.trigger_wait(), (args, kwargs or {})
        )

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # above autograd: the operation runs on elem, so its history is elem's
        args, kwargs = cls._unwrap(args, kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        args, kwargs = cls._unwrap(args, kwargs)
        return func(*args, **kwargs)
