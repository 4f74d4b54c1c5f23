# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' per-method operators, for code that calls them by name.

NOTE [torchcomms method ops]: torchcomms (functional/collectives.py, with its compile support on)
defines one operator per registered method of ``TorchComm``, ``TorchCommWindow`` and
``BatchSendRecv``, named ``torch.ops.torchcomms.<class lowercased>_<method>``: for a method that
writes tensors an in-place op ``<name>_`` (its written tensors ``Tensor(a!)``, returned aliased)
and a functional op ``<name>`` (the same arguments without the marks; returns new tensors), for
the others one op that returns what the method makes (``map_remote_tensor``) and, where the
method takes ``async_op``, an optional tensor (``Tensor?``: an empty int tensor on the CPU that
carries the asynchronous call's work, None for a synchronous call). The arguments are the
method's, in its order, after the object (``self``); none has a default. ``SPECS`` below is
torchcomms' table as its schemas come out (argument names, order and types; the communicator,
a ReduceOp, a Timeout, the window and the batch are objects, which torch prints as PyObject).
Under torch.compile only the communicator is an opaque type (``_Object`` types the others):
the ops given a ReduceOp (the reductions), a timeout, a window or a batch run eagerly only.

fastcomms' ops run the eager method (hooks, the flight recorder and errors as for a direct
call): the in-place op on the caller's tensors, the functional op on clones of the written
tensors (left as they are), returning the clones. With ``async_op`` the call's work is
registered with torch's work registry on each written tensor (on the returned empty tensor
where there are none), as for fastcomms' compiled calls (NOTE [compiled async calls]), so
``torch.ops.torchcomms.torchcomm_wait_tensors_`` or ``_c10d_functional.wait_tensor`` on them
waits for it. Under torch.compile both forms of a writing method become one node of its
fastcomms twin (NOTE [inner ops]) on the written tensors' values (functionalization); the
in-place form's results are then copied into the caller's tensors by the graph.
Each op is side-effectful to the compiler (no pass drops a call whose results the rank does not
read). Unlike fastcomms' own methods under torch.compile (NOTE [compiled communicator methods]),
these carry no order token: inductor orders them as it orders any side-effecting op, so a
compiled function whose calls must stay in program order (a send before a receive on one rank)
is safer written with the communicator's methods. No autograd formulas (torchcomms has some).

Defined where the torchcomms package is not installed, and never over an op that exists (the
guard of NOTE [torchcomms wait ops]): the schemas and the eager and Meta kernels at ``import
fastcomms`` (about 5 ms, module and definitions, on the 2-core CPU machine), what torch.compile
needs besides with the first communicator (``finish``; then also ``register`` where torch
imported this package before ``torch.library`` existed).
"""

from __future__ import annotations

import functools

import torch

from . import _torch_compat

# class key -> ((method, parameters), ...), torchcomms' registrations in its order. A parameter is
# "name:kind"; kinds: T (tensor), T[] (tensor list), each "!" where the method writes it; int,
# int[], bool; op (ReduceOp), hints (Dict(str, str)?), timeout (Timeout?).
_TAIL = " async_op:bool hints:hints timeout:timeout"
SPECS = {
    "torchcomm": (
        ("all_reduce", "tensor:T! op:op" + _TAIL),
        ("reduce", "tensor:T! root:int op:op" + _TAIL),
        ("broadcast", "tensor:T! root:int" + _TAIL),
        ("barrier", _TAIL.strip()),
        ("all_gather", "tensor_list:T![] tensor:T" + _TAIL),
        ("send", "tensor:T dst:int" + _TAIL),
        ("recv", "tensor:T! src:int" + _TAIL),
        ("all_gather_single", "output:T! input:T" + _TAIL),
        ("all_gather_v", "tensor_list:T![] tensor:T" + _TAIL),
        ("reduce_scatter_single", "output:T! input:T op:op" + _TAIL),
        ("reduce_scatter_v", "output:T! input_list:T[] op:op" + _TAIL),
        ("all_to_all_single", "output:T! input:T" + _TAIL),
        (
            "all_to_all_v_single",
            "output:T! input:T output_split_sizes:int[] input_split_sizes:int[]" + _TAIL,
        ),
        ("all_to_all", "output_tensor_list:T![] input_tensor_list:T[]" + _TAIL),
        ("reduce_scatter", "output:T! input_list:T[] op:op" + _TAIL),
        ("scatter", "output_tensor:T! input_tensor_list:T[] root:int" + _TAIL),
        ("gather", "output_tensor_list:T![] input_tensor:T root:int" + _TAIL),
    ),
    "torchcommwindow": (
        ("put", "tensor:T dst_rank:int target_disp:int async_op:bool"),
        ("signal", "dst_rank:int async_op:bool"),
        ("wait_signal", "peer_rank:int async_op:bool"),
        ("map_remote_tensor", "rank:int"),  # returns the peer's tensor (an output)
    ),
    "batchsendrecv": (
        ("send", "tensor:T dst:int"),
        ("recv", "tensor:T! src:int"),
    ),
}
_OUTPUT_OPS = frozenset({"torchcommwindow_map_remote_tensor"})  # return a new tensor

_lib = None


class _Op:
    """One registered method: its parameters and where its written tensors are."""

    def __init__(self, cls_key: str, method: str, params: str) -> None:
        self.cls_key = cls_key
        self.name = f"{cls_key}_{method}"
        self.method = method
        self.params = [tuple(p.split(":")) for p in params.split()]
        kinds = [k for _, k in self.params]
        # argument positions (the object is 0) of the written tensors and of async_op
        self.mutable = [i + 1 for i, k in enumerate(kinds) if "!" in k]
        self.async_pos = next((i + 1 for i, (n, _) in enumerate(self.params) if n == "async_op"), 0)

    def schema_args(self, type_names: dict[str, str], cls_type: str, in_place: bool) -> str:
        parts = [f"{cls_type} self"]
        for name, kind in self.params:
            if kind.startswith("T"):
                parts.append(f"{self._tensor_type(name, kind, in_place)} {name}")
            else:
                parts.append(f"{type_names.get(kind, kind)} {name}")
        return ", ".join(parts)

    def _tensor_type(self, name: str, kind: str, in_place: bool) -> str:
        """torchcomms' spelling: the i-th tensor parameter's alias is the i-th letter."""
        alias = chr(ord("a") + self._tensor_index(name))
        mark = f"({alias}!)" if in_place and "!" in kind else ""
        return f"Tensor{mark}{'[]' if kind.endswith('[]') else ''}"

    def returns(self, in_place: bool) -> str:
        if self.mutable:
            outs = []
            for pos in self.mutable:
                outs.append(self._tensor_type(*self.params[pos - 1], in_place))
            return outs[0] if len(outs) == 1 else f"({', '.join(outs)})"
        outs = ["Tensor"] if self.name in _OUTPUT_OPS else []
        if self.async_pos:
            outs.append("Tensor?")
        if not outs:
            return "()"
        return outs[0] if len(outs) == 1 else f"({', '.join(outs)})"

    def _tensor_index(self, name: str) -> int:
        tensors = [n for n, k in self.params if k.startswith("T")]
        return tensors.index(name)


def _pack(results: list):
    return results[0] if len(results) == 1 else tuple(results)


def _register_async(work, tensors: list[torch.Tensor]) -> None:
    """NOTE [compiled async calls]: the work on each written tensor, for torch's wait_tensor."""
    from torch._C._distributed_c10d import _register_work

    from ._work import _RegisteredWork

    registered = _RegisteredWork(tensors[0], None, work)
    for t in tensors:
        _register_work(t, registered)


def _flat(values: list) -> list[torch.Tensor]:
    out = []
    for v in values:
        out.extend(v if isinstance(v, list | tuple) else [v])
    return out


def _clone(v):
    return [t.clone() for t in v] if isinstance(v, list | tuple) else v.clone()


def _kernels(op: _Op):
    """(in-place kernel, functional kernel, in-place Meta, functional Meta) of a writing op, or
    (kernel, fake) of one that writes nothing."""
    method, mutable, async_pos = op.method, op.mutable, op.async_pos

    def call(args):
        return getattr(args[0], method)(*args[1:])

    if mutable:

        def in_place(*args):
            work = call(args)
            written = [args[i] for i in mutable]
            if async_pos and args[async_pos]:
                _register_async(work, _flat(written))
            return _pack(written)

        def functional(*args):
            args = list(args)
            for i in mutable:
                args[i] = _clone(args[i])
            return in_place(*args)

        def in_place_meta(*args):
            return _pack([args[i] for i in mutable])

        def functional_meta(*args):
            return _pack(
                [
                    [torch.empty_like(t) for t in args[i]]
                    if isinstance(args[i], list | tuple)
                    else torch.empty_like(args[i])
                    for i in mutable
                ]
            )

        return in_place, functional, in_place_meta, functional_meta

    output = op.name in _OUTPUT_OPS

    def kernel(*args):
        res = call(args)
        out = [res] if output else []
        if async_pos:
            if args[async_pos]:
                dummy = torch.empty(0, dtype=torch.int, device="cpu")
                _register_async(res, [dummy])
                out.append(dummy)
            else:
                out.append(None)
        return _pack(out) if out else None

    def fake(*args):
        out = []
        if output:  # the window's tensor
            w = getattr(args[0], "real_obj", args[0])
            out.append(torch.empty(w.shape, dtype=w.dtype, device=w.device))
        if async_pos:
            out.append(torch.empty(0, dtype=torch.int, device="cpu") if args[async_pos] else None)
        return _pack(out) if out else None

    return kernel, fake


def _functionalized(op: _Op, inner):
    """A writing method's ops under functionalization (torch.compile): both become ``inner``,
    fastcomms' twin of the functional op (NOTE [inner ops]) on the written tensors' values; the
    in-place op's written tensors then take its results (as ``torchcomm_wait_tensors_``'s do,
    NOTE [torchcomms wait ops])."""

    def in_place(ctx, *args):
        raw = ctx.unwrap_tensors(list(args))
        with ctx.redispatch_to_next():
            res = inner(*raw)
        res = [res] if len(op.mutable) == 1 else list(res)
        written = [args[i] for i in op.mutable]
        for orig, new in zip(_flat(written), _flat(res), strict=True):
            ctx.replace(orig, new)
            ctx.commit_update(orig)
            ctx.sync(orig)
        return _pack(written)

    def functional(ctx, *args):
        raw = ctx.unwrap_tensors(list(args))
        with ctx.redispatch_to_next():
            return ctx.wrap_tensors(inner(*raw))

    return in_place, functional


class _Object(_torch_compat.OpaqueBase):
    """NOTE [torchcomms method ops]: the schema type of the arguments that are objects other
    than the communicator (a ReduceOp, a Timeout, a window, a batch): any Python object passes
    eagerly. They are not opaque types of torch.compile (the communicator's compiled methods
    make ReduceOps and read timeouts inside compiled code, which an opaque type forbids), so an
    op taking one runs eagerly only."""


def _register_types() -> dict[str, str] | None:
    """The schemas' type names (the communicator is registered by ``_comm``)."""
    from ._comm import TorchComm, _register_opaque

    if _torch_compat.member_type() is None:
        return None
    _register_opaque()
    _torch_compat.register_symbolic_class(_Object, {})
    obj = _torch_compat.opaque_type_name(_Object)
    comm = _torch_compat.opaque_type_name(TorchComm)
    return {
        "torchcomm": comm,
        "torchcommwindow": obj,
        "batchsendrecv": obj,
        "op": obj,
        "timeout": f"{obj}?",
        "hints": "Dict(str, str)?",
    }


def register() -> bool:
    """Defines the operators and their eager and Meta kernels once (True where they are
    fastcomms'); False where the torchcomms package is installed, another library defined them,
    or torch cannot yet. What torch.compile needs besides (``_finish``) comes with the first
    communicator: every call has one, and looking the ops up costs about 25 ms at import."""
    global _lib
    if _lib is not None:
        return True
    from . import _waits

    if not hasattr(torch, "library") or not hasattr(torch, "Tag"):
        return False
    if _waits._torchcomms_installed() or hasattr(torch.ops.torchcomms, "torchcomm_all_reduce"):
        return False
    global _types
    _types = types = _register_types()
    if types is None:
        return False
    lib = torch.library.Library("torchcomms", "FRAGMENT")
    tags = (torch.Tag.pt2_compliant_tag,)
    for cls_key, methods in SPECS.items():
        for method, params in methods:
            op = _Op(cls_key, method, params)
            _OPS.append(op)
            args = functools.partial(op.schema_args, types, types[cls_key])
            if op.mutable:
                ip_name = op.name + "_"
                lib.define(f"{ip_name}({args(True)}) -> {op.returns(True)}", tags=tags)
                lib.define(f"{op.name}({args(False)}) -> {op.returns(False)}", tags=tags)
                in_place, functional, in_place_meta, functional_meta = _kernels(op)
                lib.impl(ip_name, in_place, "CompositeExplicitAutograd")
                lib.impl(ip_name, in_place_meta, "Meta")
                lib.impl(op.name, functional, "CompositeExplicitAutograd")
                lib.impl(op.name, functional_meta, "Meta")
            else:
                lib.define(f"{op.name}({args(False)}) -> {op.returns(False)}", tags=tags)
                lib.impl(op.name, _kernels(op)[0], "CompositeExplicitAutograd")
    _lib = lib
    return True


_OPS: list[_Op] = []
_types: dict[str, str] | None = None  # the schemas' type names


# NOTE [inner ops]: torchcomms' schemas name the object ``self`` and some tensors ``input``,
# which inductor cannot generate code for (it calls ``self`` ``input`` too: "duplicate parameter
# name"; torchcomms lowers its ops itself). So a compiled graph holds, for each writing method,
# ``fastcomms::torchcomms_<op>``: the functional op's schema with the object named ``obj``, the
# same kernels. Defined with the first communicator, as the rest of ``finish``.
_inner_lib = None


def finish() -> None:
    """With the first communicator: what torch.compile needs of the ops (their functionalization,
    the fake kernels of those without written tensors, side effects)."""
    global _inner_lib
    if _inner_lib is not None or _lib is None:
        return
    inner_lib = torch.library.Library("fastcomms", "FRAGMENT")
    ops = torch.ops.torchcomms
    for op in _OPS:
        fn = getattr(ops, op.name).default
        torch.fx.node.has_side_effect(fn)
        if op.mutable:
            inner_name = f"torchcomms_{op.name}"
            args = op.schema_args(_types, _types[op.cls_key], False).replace(" self", " obj", 1)
            inner_lib.define(f"{inner_name}({args}) -> {op.returns(False)}")
            _, functional, _, functional_meta = _kernels(op)
            inner_lib.impl(inner_name, functional, "CompositeExplicitAutograd")
            inner_lib.impl(inner_name, functional_meta, "Meta")
            inner = getattr(torch.ops.fastcomms, inner_name).default
            torch.fx.node.has_side_effect(inner)
            ip = getattr(ops, op.name + "_").default
            in_place, functional_fz = _functionalized(op, inner)
            ip.py_functionalize_impl(in_place)
            fn.py_functionalize_impl(functional_fz)
            torch.fx.node.has_side_effect(ip)
        else:  # (a fake kernel: some take no tensor, from which a Meta kernel's device comes)
            torch.library.register_fake(f"torchcomms::{op.name}", _kernels(op)[1], lib=_lib)
    _inner_lib = inner_lib
