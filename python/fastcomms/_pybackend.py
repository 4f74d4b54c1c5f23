# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Backends written in Python, registered with ``register_backend(name, cls)`` (torchcomms'
protocol): ``cls()`` makes the backend, ``backend.init(device, name, options)`` sets it up, and
the communicator ``new_comm`` returns is an ordinary ``TorchComm`` whose ops call the backend's
methods of the same names (``all_reduce(tensor, op, async_op)``, ...). A method returns None when
the op is done, or an object with ``wait()`` (and optionally ``is_completed()``). An op the
backend does not define raises ``UnsupportedError`` naming it. The Shim keeps the
communicator's hooks as the C++ communicator does (NOTE [one hook registry]), numbering ops from
the process's one sequence (NOTE [op ids])."""

from __future__ import annotations

import copy
import datetime
import functools

from ._C import Comm, RedOpType, UnsupportedError
from ._work import _Work


class _Standin:
    """What stands where the C++ communicator stands under a ``TorchComm`` in Python: its name,
    backend, timeout and hints."""

    def __init__(self, backend, name, timeout, hints) -> None:
        self._backend, self._name, self._timeout = backend, name, timeout
        self._hints = dict(hints)
        self._aborted = False

    def name(self):
        return self._name

    def backend(self):
        return self._backend

    def timeout(self):
        return self._timeout

    def hints(self):
        return dict(self._hints)


class Shim(_Standin):
    """Stands where the C++ communicator stands under a ``TorchComm``, and calls the backend."""

    def __init__(self, backend, backend_name, comm_name, options, reduce_op):
        super().__init__(backend_name, comm_name, options.timeout, options.hints)
        self._b, self._options = backend, options
        self._hooks: dict[str, dict[int, object]] = {"pre": {}, "post": {}, "abort": {}}
        self._next_hook = 0
        self._reduce_op = reduce_op  # fastcomms.ReduceOp (the package imports this module)

    def _call(self, method, *args):
        """The backend's ``method(*args)`` (torchcomms' order: async_op last) as a Work."""
        fn = getattr(self._b, method, None)
        if fn is None:
            raise UnsupportedError(
                f"[{self._name}] backend '{self._backend}' does not implement {method}"
            )
        return self._hooked(method, args[-1], lambda: _Work(fn(*args)))

    def _hooked(self, method, async_op, issue):
        """``issue()`` between the pre- and post-hooks, as Communicator::run."""
        op_id = 0 if method == "finalize" else Comm.next_op_id()
        for fn in list(self._hooks["pre"].values()):
            fn(method, op_id, async_op)
        result = issue()
        for fn in list(self._hooks["post"].values()):
            fn(method, op_id, async_op)
        return result

    def _op(self, t, f):
        return self._reduce_op(t, f) if t == RedOpType.PREMUL_SUM else self._reduce_op(t)

    # identity and options
    def rank(self):
        return int(self._b.get_rank())

    def size(self):
        return int(self._b.get_size())

    def backend_version(self):
        get = getattr(self._b, "get_backend_version", None)
        return str(get()) if get is not None else "python"

    def set_timeout(self, t: datetime.timedelta):
        self._timeout = t
        if hasattr(self._b, "set_timeout"):  # torchcomms' protocol passes it on
            self._b.set_timeout(t)

    def set_hints(self, h):
        self._hints.update(h)

    def abort(self):
        if self._aborted:
            return
        self._aborted = True
        for fn in list(self._hooks["abort"].values()):
            fn()
        if hasattr(self._b, "abort"):
            self._b.abort()

    def finalize(self):
        self._hooked("finalize", False, getattr(self._b, "finalize", lambda: None))

    def _register(self, kind, fn):
        key = self._next_hook
        self._next_hook += 1
        self._hooks[kind][key] = fn
        return lambda: self._hooks[kind].pop(key, None)

    register_pre_hook = functools.partialmethod(_register, "pre")
    register_post_hook = functools.partialmethod(_register, "post")
    register_abort_hook = functools.partialmethod(_register, "abort")

    # ops: the C++ communicator's argument order in, the backend's (torchcomms') order out; the
    # ops whose arguments pass as they are (less the timeout and hints) are made below the class
    def all_gather(self, outs, t, v, a, to, h):
        return self._call("all_gather_v" if v else "all_gather", outs, t, a)

    def reduce_scatter(self, out, ins, op, f, v, a, to, h):
        name = "reduce_scatter_v" if v else "reduce_scatter"
        return self._call(name, out, ins, self._op(op, f), a)

    def batch(self, ops, a, to, h):
        if hasattr(self._b, "batch_op_issue"):
            return self._call("batch_op_issue", ops, a)
        raise UnsupportedError(f"[{self._name}] backend '{self._backend}' takes no batched p2p")

    def split(self, ranks, name, to, h):
        """torchcomms' protocol: ``backend.split(ranks, name, options)`` returns the new group's
        backend, already set up (None where this rank joins none)."""
        if not hasattr(self._b, "split"):
            raise UnsupportedError(
                f"[{self._name}] backend '{self._backend}' does not implement split"
            )
        options = copy.copy(self._options)
        options.name = name
        if to is not None:
            options.timeout = to
        options.hints = {**dict(self._options.hints), **dict(h or {})}
        sub = self._hooked("split", False, lambda: self._b.split(list(ranks), name, options))
        if sub is None:
            return None
        return Shim(sub, self._backend, name, options, self._reduce_op)

    def new_window(self):
        raise UnsupportedError(f"[{self._name}] backend '{self._backend}' has no windows")

    def select_transport(self, transport, require_nvlink):
        raise UnsupportedError(
            f"[{self._name}] the Ulysses layer needs a built-in backend's communicator; "
            "pass a torch.distributed ProcessGroup instead"
        )


def _passthrough(method, red=None):
    """The Shim's ``method(*args, async_op, timeout, hints)``: the backend's
    ``method(*args, async_op)``, the reduction's (type, factor) at ``red`` as one ReduceOp."""

    def op(self, *args):
        args = args[:-2]
        if red is not None:
            args = (*args[:red], self._op(*args[red : red + 2]), *args[red + 2 :])
        return self._call(method, *args)

    op.__name__ = op.__qualname__ = method
    return op


# the ops whose arguments are in the same order in the C++ communicator and in the backend (a
# reduction's type and factor at the index given)
for _method, _red in {
    **dict.fromkeys(
        "send recv broadcast all_gather_single all_to_all_single all_to_all_v_single all_to_all "
        "barrier scatter gather gather_single".split()
    ),
    "all_reduce": 1,
    "reduce": 2,
    "reduce_scatter_single": 2,
}.items():
    setattr(Shim, _method, _passthrough(_method, _red))
