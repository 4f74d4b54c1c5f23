# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""``TorchWork``: the handle on an issued op."""

from __future__ import annotations

import time

from . import _C
from ._C import WorkStatus


def _same(self, memo=None):
    """``__copy__``/``__deepcopy__`` of a handle on shared state (a communicator, a window, a
    group): a copy, or a deep copy of an object that holds one (a model), is the same object."""
    if memo is not None:
        memo[id(self)] = self
    return self


class _Scoped:
    """A group's handle behaviour: ``with group:`` destroys the group when the block ends, also on
    error; a copy is the same group (its windows, streams and peers cannot be duplicated)."""

    __copy__ = __deepcopy__ = _same

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()
        return False


class TorchWork:
    """A handle on an issued op: ``wait()``, ``is_completed()``, ``status()``. Keeps the op's
    tensors alive until it completes."""

    def __init__(self, work: _C.Work) -> None:
        self._work = work
        self._observers: list | None = None  # fn(event, payload): NOTE [one hook registry]

    def wait(self) -> None:
        if self._observers is None:
            return self._work.wait()
        try:
            self._work.wait()
        except TimeoutError as e:
            for fn in self._observers:
                fn("timeout", e)
            raise
        for fn in self._observers:
            fn("waited", self)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def status(self) -> WorkStatus:
        return self._work.status()

    def _set_status(self, status: WorkStatus) -> None:
        """Sets the status of a work a Python backend returned (torchcomms': for backends whose
        works finish out of band); other works raise RuntimeError."""
        from ._pybackend import _Work

        if not isinstance(self._work, _Work):
            raise RuntimeError("_set_status is only supported on Python-created work objects")
        if not isinstance(status, WorkStatus):
            raise TypeError(f"_set_status: status must be a WorkStatus, got {status!r}")
        self._work._set = status

    def wait_blocking(self) -> None:
        """Blocks this thread until the op has finished (``wait()`` on a CUDA backend only
        orders the caller's stream); raises the op's error like ``wait()``."""
        self.wait()
        delay = 1e-5
        while not self._work.is_completed():
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        if self._work.status() != WorkStatus.COMPLETED:
            self.wait()  # rethrows the error that ended it


class _DoneWork:
    """The TorchWork of a stream-ordered op: already ordered on the caller's current stream."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True

    def status(self) -> WorkStatus:
        return WorkStatus.COMPLETED
