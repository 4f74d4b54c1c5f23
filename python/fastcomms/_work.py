# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The handles on issued ops, all of them: ``TorchWork`` (a communicator's), a Python backend's,
a stream-ordered op's (an event's), the Ulysses async call's (and what torch's work registry holds
for its result), the ring exchange's, fastcomms.moe's, and the torch Work a fastcomms process
group returns."""

from __future__ import annotations

import time

import torch
from torch._C._distributed_c10d import Work as _C10dWork  # torch.distributed.Work

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

    def wait(self) -> None:
        return self._work.wait()

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def status(self) -> WorkStatus:
        return self._work.status()

    def _set_status(self, status: WorkStatus) -> None:
        """Sets the status of a work a Python backend returned (torchcomms': for backends whose
        works finish out of band); other works raise RuntimeError."""
        if not isinstance(status, WorkStatus):
            raise TypeError(f"_set_status: status must be a WorkStatus, got {status!r}")
        set_status = getattr(self._work, "_set_status", None)
        if set_status is None or not set_status(status):
            raise RuntimeError("_set_status is only supported on Python-created work objects")

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


class _RegisteredWork(_C10dWork):
    """What torch's work registry holds for the AsyncCollectiveTensor of a CPU call: its
    wait() waits for the exchange (CUDA calls register a C++ work, NOTE [async result
    waits])."""

    def is_completed(self) -> bool:
        if self._event is not None:
            return self._event.query()
        return self._work.is_completed() if self._work is not None else True

    def __init__(self, out, event, work):
        super().__init__()
        # Not `out` itself: the registry holds this object until the first wait, and a lent
        # window counts its live results by references (NOTE [async ulysses in c++]).
        self._device, self._event, self._work = out.device, event, work
        self._error = None

    def _finish(self):
        """Waits for the call once (its unpack into the output included) and lets go of it;
        a later wait raises what this one raised."""
        w, self._work = self._work, None
        if w is not None:
            try:
                w.wait()
            except Exception as e:  # the exchange's error, for the result's wait
                self._error = e

    def wait(self, timeout=None):
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        self._finish()
        if self._error is not None:
            raise self._error
        return True


class RingWork:
    """The handle of one ``RingGroup.exchange``: ``wait()`` returns the received tensors (the
    structure that was sent), the group's buffers until the exchange two steps later reuses them.
    On CUDA it orders the caller's current stream without blocking the host; on CPU it blocks."""

    def __init__(self, out, wait_fn, done_fn, pack):
        self._out, self._wait_fn, self._done_fn, self._pack = out, wait_fn, done_fn, pack
        self._waited = False

    def wait(self):
        if not self._waited:
            self._wait_fn()
            self._waited, self._wait_fn = True, None
        return self._pack(self._out)

    def is_completed(self) -> bool:
        return self._waited or self._done_fn()


class _CommWork(_C10dWork):
    """A torch Work over fastcomms works: ``wait()`` waits for them (on CUDA the caller's stream
    waits), ``get_future()`` waits, then returns a completed future (DDP's reducer chains on it)."""

    def __init__(self, works, result, host_sync_device=None):
        super().__init__()
        self._works, self._result = [w for w in works if w is not None], result
        self._sync = host_sync_device

    def wait(self, timeout=None):
        for w in self._works:
            w.wait()
        self._works = []
        if self._sync is not None:  # a barrier: the host waits for the stream's earlier work too
            torch.cuda.current_stream(self._sync).synchronize()
            self._sync = None
        return True

    def is_completed(self):
        return all(w.is_completed() for w in self._works)

    is_success = is_completed

    def get_future(self):
        self.wait()
        fut = torch.futures.Future()
        fut.set_result(self._result)
        return fut


class _EventWork:
    """An async call's work: ``is_completed`` asks the event recorded after the call's kernels
    (no block); ``wait`` makes the caller's current stream wait for it (no host block)."""

    __slots__ = ("_event",)

    def __init__(self, event: torch.cuda.Event) -> None:
        self._event = event

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)

    def is_completed(self) -> bool:
        return self._event.query()

    def status(self) -> _C.WorkStatus:
        return _C.WorkStatus.COMPLETED if self._event.query() else _C.WorkStatus.INPROGRESS


class MoEWork:
    """The handle of a call made with ``async_op=True``: ``wait()`` returns what the synchronous
    call returns; ``is_completed()`` says whether the transfer has finished. Keeps the call's
    tensors alive until then. On CPU ``wait()`` blocks until the data has arrived."""

    def __init__(self, pending, finish):
        self._pending, self._finish, self._result = pending, finish, None

    def wait(self):
        if self._finish is not None:
            self._result = self._finish(self._pending.wait())
            self._finish = self._pending = None
        return self._result

    def is_completed(self) -> bool:
        return self._finish is None or self._pending.is_completed()
