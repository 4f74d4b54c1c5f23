# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The communicator's collective and point-to-point operations as one table, the ``TorchComm``
methods written from it, and the path a call takes when hooks are registered.

NOTE [operation table]: one row per operation says everything its method does: its parameters
in torchcomms' order (``async_op``, ``hints=None``, ``timeout=None`` follow), what the compiled
path takes (the tensors it writes and reads, its integers, the reduction), the fields of its
``<Op>PreHookArgs`` and the extension call. ``methods`` writes each method's Python source from
its row and compiles it once at import, as ``dataclasses`` writes ``__init__``: a call costs
what a hand-written method costs (no ``*args``, no per-call binding), ``inspect.signature``
shows the real parameters, and tracebacks show the source (kept in ``linecache``)."""

from __future__ import annotations

import functools
import linecache
import threading
import typing

from . import _device_a2av, _hook_types
from ._C import RedOpType
from ._hook_types import POST_OF, OpName, SplitPostHookArgs
from ._options import ReduceOp, _ms, _op
from ._work import TorchWork

Method = typing.Callable[..., TorchWork]  # a method of OPS, as type checkers see it


class Op(typing.NamedTuple):
    """One row of OPS (the fields are Python source)."""

    name: str  # the method; without a leading "_", its OpName and <Op>PreHookArgs
    params: str  # the parameters before async_op, torchcomms' names and order
    written: str  # compiled path: the tensors the op writes,
    read: str  # the tensors it reads,
    ints: str  # and its integer arguments
    pre: str  # the values of the <Op>PreHookArgs fields, in order
    call: str  # the extension call, up to the arguments every call ends with
    red: bool = False  # takes ``op``: t, f are its type and factor (compiled: ints, floats lead)
    prep: str = ""  # a statement that runs first (list arguments made lists)
    compiled: str = ""  # the compiled call where it is not _compiled.call (no eager autograd)


# fmt: off
OPS = (
    Op("send", "tensor, dst", "()", "(tensor,)", "(dst,)", "tensor, dst, async_op",
       "send(tensor, dst"),
    Op("recv", "tensor, src", "(tensor,)", "()", "(src,)", "tensor, src, async_op",
       "recv(tensor, src"),
    Op("broadcast", "tensor, root", "(tensor,)", "()", "(root,)", "tensor, root, async_op",
       "broadcast(tensor, root"),
    Op("all_reduce", "tensor, op", "(tensor,)", "()", "()", "tensor, async_op, op",
       "all_reduce(tensor, t, f", red=True),
    Op("reduce", "tensor, root, op", "(tensor,)", "()", "(root,)", "tensor, root, async_op, op",
       "reduce(tensor, root, t, f", red=True),
    Op("all_gather", "tensor_list, tensor", "outs", "(tensor,)", "()", "tensor, outs, async_op",
       "all_gather(outs, tensor, False", prep="outs = list(tensor_list)"),
    Op("all_gather_v", "tensor_list, tensor", "outs", "(tensor,)", "()", "tensor, outs, async_op",
       "all_gather(outs, tensor, True", prep="outs = list(tensor_list)"),
    Op("all_gather_single", "output, input", "(output,)", "(input,)", "()",
       "input, output, async_op", "all_gather_single(output, input"),
    Op("reduce_scatter", "output, input_list, op", "(output,)", "ins", "()",
       "ins, output, async_op, op", "reduce_scatter(output, ins, t, f, False", red=True,
       prep="ins = list(input_list)"),
    Op("reduce_scatter_v", "output, input_list, op", "(output,)", "ins", "()",
       "ins, output, async_op, op", "reduce_scatter(output, ins, t, f, True", red=True,
       prep="ins = list(input_list)"),
    Op("reduce_scatter_single", "output, input, op", "(output,)", "(input,)", "()",
       "input, output, async_op, op", "reduce_scatter_single(output, input, t, f", red=True),
    Op("all_to_all_single", "output, input", "(output,)", "(input,)", "()",
       "input, output, async_op", "all_to_all_single(output, input"),
    Op("all_to_all_v_single", "output, input, output_split_sizes, input_split_sizes",
       "(output,)", "(input,)", "(len(outs), *outs, *ins)", "input, output, ins, outs, async_op",
       "all_to_all_v_single(output, input, outs, ins",
       prep="if (w := _device_route(self, output, input, output_split_sizes, input_split_sizes, "
       "async_op, timeout)) is not None: return w\n    "
       "outs, ins = _host_splits(output_split_sizes), _host_splits(input_split_sizes)"),
    Op("all_to_all", "output_tensor_list, input_tensor_list", "outs", "ins", "()",
       "ins, outs, async_op", "all_to_all(outs, ins",
       prep="outs, ins = list(output_tensor_list), list(input_tensor_list)"),
    Op("barrier", "", "()", "()", "()", "async_op", "barrier("),
    Op("scatter", "output_tensor, input_tensor_list, root", "(output_tensor,)", "ins", "(root,)",
       "output_tensor, ins, root, async_op", "scatter(output_tensor, ins, root",
       prep="ins = list(input_tensor_list or ())"),
    Op("gather", "output_tensor_list, input_tensor, root", "outs", "(input_tensor,)", "(root,)",
       "input_tensor, outs, root, async_op", "gather(outs, input_tensor, root",
       prep="outs = list(output_tensor_list or ())"),
    Op("gather_single", "output, input, root", "(output,)", "(input,)", "(root,)",
       "input, output, root, async_op", "gather_single(output, input, root"),
    # BatchSendRecv.issue: ops are (is_send, tensor, peer)
    Op("_batch_op_issue", "ops", "", "", "", "len(ops), async_op", "batch(ops",
       compiled="_compiled.batch(self, ops, hints, timeout, async_op)"),
)
# fmt: on

# The communicator's operations (its methods of those names; the "fake" backend's ops too)
COLLECTIVE_METHODS = tuple(op.name for op in OPS if not op.name.startswith("_"))


def _red(n: list[int], f: list[float]) -> ReduceOp:
    return ReduceOp(RedOpType(n[0]), f[0])


# The inverse of the rows' compiled columns: method -> the eager method's arguments before
# ``async_op`` from what a compiled call passes, fn(written, read, ints, floats) (the compiled
# calls' kernels and the hooks of a call the C++ kernel runs, NOTE [hooks on the fast path])
COMPILED_ARGS = {
    "send": lambda o, i, n, f: (i[0], n[0]),
    "recv": lambda o, i, n, f: (o[0], n[0]),
    "broadcast": lambda o, i, n, f: (o[0], n[0]),
    "all_reduce": lambda o, i, n, f: (o[0], _red(n, f)),
    "reduce": lambda o, i, n, f: (o[0], n[1], _red(n, f)),
    "all_gather": lambda o, i, n, f: (o, i[0]),
    "all_gather_v": lambda o, i, n, f: (o, i[0]),
    "all_gather_single": lambda o, i, n, f: (o[0], i[0]),
    "reduce_scatter": lambda o, i, n, f: (o[0], i, _red(n, f)),
    "reduce_scatter_v": lambda o, i, n, f: (o[0], i, _red(n, f)),
    "reduce_scatter_single": lambda o, i, n, f: (o[0], i[0], _red(n, f)),
    "all_to_all_single": lambda o, i, n, f: (o[0], i[0]),
    # ints: how many output splits, the output splits, then the input splits (either may be
    # empty: even splits)
    "all_to_all_v_single": lambda o, i, n, f: (o[0], i[0], n[1 : 1 + n[0]], n[1 + n[0] :]),
    "all_to_all": lambda o, i, n, f: (o, i),
    "barrier": lambda o, i, n, f: (),
    "scatter": lambda o, i, n, f: (o[0], i, n[0]),
    "gather": lambda o, i, n, f: (o, i[0], n[0]),
    "gather_single": lambda o, i, n, f: (o[0], i[0], n[0]),
}


def _source(op: Op) -> str:
    """The method of one row, as Python source."""
    opname = op.name.lstrip("_")
    pre_cls = "".join(w.capitalize() for w in opname.split("_")) + "PreHookArgs"
    end = "" if op.call.endswith("(") else ", "
    issue = f"TorchWork(self._c.{op.call}{end}async_op, _ms(timeout), hints))"
    compiled = ["    if _compiling():" if op.compiled else "    if _compiling() or _eager_grad():"]
    if op.red:
        compiled.append("        n, fl = _compiled.reduction(op)")
    compiled.append(  # (None: eagerly, no tensor needs a gradient: the plain call)
        f"        if (w := {op.compiled}) is not None:"
        if op.compiled
        else f"        if (w := _compiled.call(self, {op.name!r}, {op.written}, {op.read}, "
        + (f"(*n, *{op.ints}), fl, " if op.red else f"{op.ints}, (), ")
        + "hints, timeout, async_op)) is not None:"
    )
    compiled.append("            return w")
    return "\n".join(
        [
            f"def {op.name}(self, {op.params + ', ' if op.params else ''}async_op, hints=None, "
            "timeout=None):",
            *([f"    {op.prep}"] if op.prep else []),
            *compiled,  # NOTE [compiled communicator methods]
            *(["    t, f = _op(op)"] if op.red else []),
            "    if self._hooked:  # NOTE [one hook registry]",
            f"        return _hooked(self, _OpName.{opname}, lambda: _ht.{pre_cls}({op.pre}), "
            f"lambda: {issue})",
            f"    return {issue}",
            "",
        ]
    )


def methods(namespace: dict) -> dict[str, typing.Callable]:
    """The methods of OPS, with ``namespace`` (``TorchComm``'s module) as their globals."""
    namespace.update(_op=_op, _ms=_ms, TorchWork=TorchWork, _hooked=_hooked)
    namespace.update(_ht=_hook_types, _OpName=OpName)
    namespace.update(_device_route=_device_a2av.route, _host_splits=_device_a2av.host_splits)
    out = {}
    for op in OPS:
        src = _source(op)
        filename = f"<fastcomms generated TorchComm.{op.name}>"
        linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
        exec(compile(src, filename, "exec"), namespace)  # noqa: S102 (NOTE [operation table])
        fn = out[op.name] = namespace.pop(op.name)
        fn.__qualname__ = f"TorchComm.{op.name}"
        fn.__module__ = namespace["__name__"]
    return out


# NOTE [one hook registry]: a communicator's hooks live in the C++ communicator's registry (a
# backend written in Python's too: NOTE [python backend trampoline]), which numbers the ops
# (NOTE [op ids]) and calls them on the calling thread. A Python hook is registered there as a
# callback that finds the call in flight on its thread (``_calls``; set only on the hooked path,
# so a communicator without hooks pays one attribute test per call) and builds torchcomms'
# argument objects from it, once per call for all hooks. Post-hooks run as the C++ side reports
# them, deferred to the moment the method has its result (split's post args carry the
# communicator it made). An op the process group's C++ path issues (NOTE [process group fast
# path]) has no call in flight but hands its arguments to the hooks itself (NOTE [hooks on the
# fast path]), so hooks leave that path on. An op the C++ side issues for itself (a Ulysses
# transport's collective) has neither: Python hooks skip it, though it takes an op id. The
# library's own hooks (flight recorder, NaN check, clog) are C++ hooks on the communicator.
_calls = threading.local()


class _Call:
    """The hooked call in flight on a thread."""

    def __init__(self, key: int, name: OpName, pre_args) -> None:
        self.key, self.name, self._pre_args = key, name, pre_args
        self.posted: list = []  # fn(post args) of the post-hooks, once the method has its result

    @functools.cached_property
    def args(self):  # the <Op>PreHookArgs, made once for all hooks
        return self._pre_args()


def _hooked(comm, name: OpName, pre_args, issue):
    """``issue()`` with a call in flight for the hooks of ``comm`` (where it has any)."""
    if not comm._hooked:
        return issue()
    call = _Call(comm._key, name, pre_args)
    outer = getattr(_calls, "call", None)
    _calls.call = call
    try:
        result = issue()
    finally:
        _calls.call = outer
    if call.posted:
        args = SplitPostHookArgs(result) if name is OpName.split else POST_OF[name]()
        for fn in call.posted:
            fn(args)
    return result


def callbacks(key: int, kind: str, fn) -> list[tuple[str, typing.Callable]]:
    """The (kind, callback) pairs the C++ registry of communicator ``key`` holds for hook ``fn``."""
    if kind == "abort":
        return [("abort", fn)]

    if kind == "pre":

        def pre(name, op_id, async_op, fast=None):
            if fast is not None:  # NOTE [hooks on the fast path]
                fn(_OPNAMES[name], op_id, fast_pre_args(name, async_op, fast))
                return
            call = getattr(_calls, "call", None)
            if call is not None and call.key == key:
                fn(call.name, op_id, call.args)

        return [("pre", pre)]
    if kind == "post":

        def post(name, op_id, async_op, fast=False):
            if fast:  # NOTE [hooks on the fast path]: issued; no Python method waits for it
                fn(op_id, POST_OF[_OPNAMES[name]]())
                return
            call = getattr(_calls, "call", None)
            if call is not None and call.key == key:
                call.posted.append(functools.partial(fn, op_id))

        return [("post", post)]
    raise ValueError(f"unknown hook kind {kind!r}")


_OPNAMES = {n.value: n for n in OpName}
_PRE_ARGS = {n: getattr(_hook_types, f"{_hook_types._camel(n)}PreHookArgs") for n in _OPNAMES}


def _pre_of_call() -> dict[str, typing.Callable]:
    """method -> fn(the method's arguments, async_op): its ``<Op>PreHookArgs``, written from the
    rows as the methods are (NOTE [operation table])."""
    namespace = {"_ht": _hook_types, "_host_splits": _device_a2av.host_splits}
    out = {}
    for op in OPS:
        if op.name.startswith("_"):
            continue
        prep = op.prep.split("\n    ")[-1]  # (the device route is the call's, not its arguments')
        src = "\n".join(
            [
                f"def {op.name}({op.params + ', ' if op.params else ''}async_op):",
                *([f"    {prep}"] if prep else []),
                f"    return _ht.{_PRE_ARGS[op.name].__name__}({op.pre})",
            ]
        )
        exec(compile(src, f"<fastcomms pre-hook args of {op.name}>", "exec"), namespace)  # noqa: S102
        out[op.name] = namespace.pop(op.name)
    return out


_PRE_OF_CALL = _pre_of_call()


def fast_pre_args(name: str, async_op: bool, fast: tuple):
    """NOTE [hooks on the fast path]: the ``<Op>PreHookArgs`` of an op a C++ path issued: the
    process group's, from its (tensor or output, input or None, (RedOpType, factor) or None); a
    compiled call's (NOTE [compiled calls in C++]), from its (written, read, ints, floats)."""
    if len(fast) == 4:
        return _PRE_OF_CALL[name](*COMPILED_ARGS[name](*fast), async_op)
    a, b, red = fast
    op = () if red is None else (ReduceOp(*red),)
    cls = _PRE_ARGS[name]
    return cls(a, async_op, *op) if b is None else cls(b, a, async_op, *op)
