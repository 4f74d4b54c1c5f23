# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The communicator's own methods under torch.compile (``comm.all_reduce(t, op, async_op)``
inside ``torch.compile(fullgraph=True)``).

NOTE [compiled communicator methods]: a TorchComm is an opaque reference type whose collective
methods (written from the operation table, NOTE [operation table] in ``_ops``) are registered as
inlined members, so Dynamo traces each method's Python body, whose first lines send a compiled
call here instead of to the C++ communicator. Every call becomes one node of a custom op that
takes the communicator (an opaque graph input), the method's name, the tensors it writes
(``mutated``) and reads (``inputs``), its integer and float arguments, hints and timeout, and
runs the eager method at run time (hooks, the flight recorder and errors as in eager mode):

- NOTE [compiled calls in place]: every call that writes tensors is a node of ``comm_call_``,
  which declares that it writes ``mutated``; functionalization turns it into a functional node
  and inductor re-inplaces it, so the eager method writes the caller's tensors themselves: no
  clone, no copy back. Where a tensor of the call needs a gradient, the traced node is
  ``comm_call_grad_`` (NOTE [differentiable in-place calls]), which the compiler traces down to
  ``comm_call_`` in the forward graph and the adjoint in the backward graph.
- ``fastcomms::comm_call``: a functional op that clones the written tensors, runs the method on
  the clones and returns them (with a gradient formula of its own), for the rest: synchronous
  calls that write nothing (barrier, send; an empty written list broke auto_functionalized), a
  send whose tensor needs a gradient, the backward's collectives, and the eager calls of NOTE
  [eager autograd] that write a non-contiguous tensor, or several tensors with a view among them.

NOTE [compiled async calls]: ``async_op=True`` (with a gradient or without) issues the call
through ``comm_call_`` with the eager method's ``async_op=True`` and registers its work with
torch's work registry on each tensor it writes (on a ``done`` tensor it returns where it writes
none); the traced work's ``wait()`` puts torch's ``_c10d_functional.wait_tensor`` on those
tensors where the program calls it, and every later read of them follows that wait. So what the
program does between the call and its ``wait()`` runs while the call is in flight (on CUDA the
wait orders the caller's stream after the call, the host does not block). Inductor places these
waits as it places those of torch's functional collectives (each is a ``wait_tensor`` on a
tensor written in place; its ``reorder_for_compute_comm_overlap`` passes that sink waits move
ours too, while the call's node is not a collective kernel to the passes that raise those). Why
in place: with clones (a draft of this did so), inductor's peak-memory reordering pulled each
wait up to free its clone sooner, before the compute it was meant to hide. Not kept: a call
whose written tensor is a large buffer made inside the compiled function; peak-memory
reordering moves that allocation, and the call with it, after compute that does not depend on
them (nothing between a call and its wait does), so nothing is hidden unless the compile sets
``options={"reorder_for_peak_memory": False}`` (one H200: 68–70% of a 512 MiB call hidden with
it, 11–15% without; docs/benchmarks.md). A call never waited inside the compiled function still
writes its tensors when it completes, as an eager call never waited; its registry entry stays
until a ``wait_tensor`` on them.

Order: a rank must issue its communicator calls in program order (a send and a receive swapped
on one rank hang against the peer), and torch 2.11's inductor reorders nodes for peak memory
without regard to registered op effects (seen: barrier, send, recv, all_reduce for barrier,
all_reduce, send, recv). So every call takes an order token (an empty tensor) and returns the
next one, a data dependency no scheduler may break. The token of each device lives in
``_tokens``, made when a communicator is made (so the first compile sees it and the second call
does not recompile); the compiled graph reads it and stores the next.

Kept: the op is registered as side-effectful (``torch.fx.node.has_side_effect``), so no pass
drops a call whose results this rank does not read. Its integer and float lists always end with
one pad element: torch's autograd for custom ops takes an empty list of numbers for a list of
tensors, which left the backward of calls without numbers untraced (their gradient silently 0).

Gradients: a call (of ``comm_call_grad_`` or ``comm_call``) whose tensors' adjoint is a
collective (all_reduce and the reduce_scatters with SUM, AVG or PREMUL_SUM; broadcast; the
all_gathers; the all_to_alls) has that collective on the gradients as its backward, a node of
``comm_call`` (``_adjoint``); any other call's backward raises when it runs (not while the
compiler traces it). Eagerly the methods do not take part in autograd (they write the tensors'
data), as in torchcomms without its compile patch, except under NOTE [eager autograd].

NOTE [eager autograd]: with torchcomms' ``TORCHCOMMS_PATCH_FOR_COMPILE=1``, an eager call one of
whose tensors needs a gradient (grad mode on) runs as a compiled call with a gradient does
(NOTE [differentiable in-place calls]): ``_InPlaceCall`` runs ``comm_call_`` (its C++ kernel
where it can) and marks the written tensors dirty, so their history becomes the call and its
backward the adjoint collective (161-174 us per call on the 2-core CPU machine, 354-408 through
``comm_call``; docs/benchmarks.md). A call that writes one tensor (a view too) runs as
``_EagerInPlaceCall``, which takes that tensor first; one that writes several, none a view, as
``_InPlaceCall``. Where a written tensor is not contiguous, or several are written and one is a
view (an autograd.Function that writes a view in place may return one tensor only), the call
runs as ``comm_call`` on clones, copied back into the caller's tensors with autograd recording
the copy. In place, ``comm_call_``'s C++ kernel runs the call where it needs nothing of Python
(its counter counts these calls too); else its Python kernel (hints, a timeout, a Python backend).
Either way it is synchronous and returns the tensor it wrote as a ``_Result``, which is also its
work (a list of them where the method writes a list, of one at world 1 too); as torchcomms does
under that patch, sync or async alike. A written tensor that is a leaf needing a gradient (a
parameter being broadcast) cannot be written in place under autograd, so that call, and every
call without such a tensor or without the variable, is the plain eager call, which writes the
data outside autograd.

The graph cache: pickling a TorchComm gives bytes naming it and ``code_key()`` (the version and
a digest of this file), so a graph cached by other code is not reused; unpickling raises."""

from __future__ import annotations

import datetime
import functools
import hashlib

import torch
from torch._C._distributed_c10d import _register_work

from . import _C, _ops, _torch_compat, _waits
from ._C import RedOpType
from ._comm import TorchComm
from ._options import _op, _ValueError
from ._work import _DoneWork, _RegisteredWork

_tokens: dict[str, torch.Tensor] = {}  # device -> the order token of the calls on it


@functools.cache
def code_key() -> str:
    """The version and a digest of this module and of ``_waits`` (NOTE [torchcomms wait ops]):
    what a compiled call runs (its op, its gradients, the waits its graph holds), for the graph
    cache's key (TorchComm.__reduce__). Seen without ``_waits``: a graph compiled while its
    in-place wait was another was served from inductor's cache after the change."""
    h = hashlib.sha256()
    for path in (__file__, _waits.__file__):
        with open(path, "rb") as f:
            h.update(f.read())
    return f"{_C.__version__}:{h.hexdigest()[:16]}"


def ensure_token(device: torch.device) -> None:
    """Eager: the order token of ``device``, made once."""
    key = str(device)
    if key not in _tokens:
        _tokens[key] = torch.empty(0, device=device)


# the methods that write a list of tensors (NOTE [eager autograd] returns them as a list)
_LIST_WRITTEN = frozenset(("all_gather", "all_gather_v", "all_to_all", "gather"))


def _run_batch(comm, outs, ins, n, async_op, kw):
    """ints: one flag per op (1 send, 0 receive) then one peer per op, in the batch's order."""
    half = len(n) // 2
    batch, si, ri = comm.batch_op_create(), iter(ins), iter(outs)
    for is_send, peer in zip(n[:half], n[half:], strict=True):
        if is_send:
            batch.send(next(si), peer)
        else:
            batch.recv(next(ri), peer)
    return batch.issue(async_op, **kw)


def _unpack_hints(hints: str) -> dict[str, str] | None:
    if not hints:
        return None
    parts = hints.split("\x1f")
    return dict(zip(parts[0::2], parts[1::2], strict=True))


def _run(comm, method, mutated, inputs, ints, floats, hints, timeout_s, async_op, in_place=False):
    """The eager method on clones of ``mutated`` (on ``mutated`` itself ``in_place``): (the
    tensors it wrote, its work)."""
    if method == "refuse":  # the backward of a call without a gradient (hints: why)
        raise RuntimeError(hints)
    outs = list(mutated) if in_place else [t.clone() for t in mutated]
    kw = {"hints": _unpack_hints(hints)}
    if timeout_s >= 0:
        kw["timeout"] = datetime.timedelta(seconds=timeout_s)
    ins, ints = list(inputs), list(ints)[:-1]
    if method == "batch":
        return outs, _run_batch(comm, outs, ins, ints, async_op, kw)
    args = _ops.COMPILED_ARGS[method](outs, ins, ints, list(floats)[:-1])
    return outs, getattr(comm, method)(*args, async_op, **kw)


@torch.library.custom_op("fastcomms::comm_call", mutates_args=())
def comm_call(
    order: torch.Tensor,
    comm: TorchComm,
    method: str,
    mutated: list[torch.Tensor],
    inputs: list[torch.Tensor],
    ints: list[int],
    floats: list[float],
    hints: str,
    timeout_s: float,
) -> list[torch.Tensor]:
    """One communicator call of a compiled graph (NOTE [compiled communicator methods]):
    returns the next order token, then ``mutated`` as the call leaves them."""
    outs, _ = _run(comm, method, mutated, inputs, ints, floats, hints, timeout_s, False)
    return [order.new_empty(0), *outs]


@comm_call.register_fake
def _(order, comm, method, mutated, inputs, ints, floats, hints, timeout_s):
    return [order.new_empty(0), *(torch.empty_like(t) for t in mutated)]


# NOTE [in-place op registration]: ``comm_call_`` is defined through torch.library.Library with
# one kernel for every backend (CompositeExplicitAutograd), not through ``custom_op``: a custom
# op runs three Python kernels per call (autograd, ADInplaceOrView, backend), which on the 2-core
# CPU machine cost about 40 us more per call than one kernel (measured, docs/benchmarks.md). That
# kernel is C++ (NOTE [compiled calls in C++], bind_compiled.cpp), which hands what it does not run
# itself to ``_comm_call_``. It has no autograd kernel (a call that needs a gradient is traced as
# ``comm_call_grad_``, below, down to this op); the version bump that ADInplaceOrView would make
# is made by the kernel.
_lib = torch.library.Library("fastcomms", "FRAGMENT")
# (comm_call_grad_: NOTE [differentiable in-place calls])
for _name in ("comm_call_", "comm_call_grad_"):
    _lib.define(
        f"{_name}(Tensor order, {_torch_compat.opaque_type_name(TorchComm)} comm, str method, "
        "Tensor(a!)[] mutated, Tensor[] inputs, SymInt[] ints, float[] floats, str hints, "
        "float timeout_s, bool async_op) -> (Tensor, Tensor)"
    )
    torch.library.register_fake(
        f"fastcomms::{_name}", lambda order, *_: (order.new_empty(0), order.new_empty(0)), lib=_lib
    )


def _comm_call_(order, comm, method, mutated, inputs, ints, floats, hints, timeout_s, async_op):
    """``comm_call`` writing ``mutated`` in place (NOTE [compiled calls in place]), the Python
    kernel behind the C++ one (NOTE [compiled calls in C++]): the next order token and the
    call's done tensor. ``async_op`` (NOTE [compiled async calls]): issued,
    not waited; its work registered on each written tensor (on done where there are none)."""
    _, work = _run(comm, method, mutated, inputs, ints, floats, hints, timeout_s, async_op, True)
    torch.autograd.graph.increment_version(mutated)
    done = order.new_empty(0)
    if async_op:
        registered = _RegisteredWork(done, None, work)
        for t in mutated or [done]:
            _register_work(t, registered)
    return order.new_empty(0), done


# NOTE [compiled calls in C++] (bind_compiled.cpp): the op's kernel is C++, which runs a call that
# needs nothing of Python on the C++ communicator and hands every other call to _comm_call_
_C._register_comm_call(_comm_call_)

comm_call_ = torch.ops.fastcomms.comm_call_.default

# NOTE [differentiable in-place calls]: where a tensor of a call needs a gradient, the traced call
# is a node of ``comm_call_grad_``, whose autograd kernel runs ``comm_call_`` under an
# autograd.Function that marks the written tensors dirty (their history becomes the call) and
# whose backward is the call's adjoint collective. The compiler traces through that kernel, so
# the forward graph holds plain ``comm_call_`` nodes (in place, no clone; async where asked) and
# the backward graph the adjoint's nodes; ``comm_call_grad_`` itself never runs in a compiled
# graph (nor its autograd kernel per call).
_lib.impl("comm_call_grad_", comm_call_, "CompositeExplicitAutograd")  # below autograd: the same


class _InPlaceCall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, order, comm, method, ints, floats, hints, timeout_s, async_op, n, *tensors):
        mutated, inputs = list(tensors[:n]), list(tensors[n:])
        with torch._C._AutoDispatchBelowAutograd():
            token, done = comm_call_(
                order, comm, method, mutated, inputs, ints, floats, hints, timeout_s, async_op
            )
        ctx.mark_dirty(*mutated)
        ctx.mark_non_differentiable(token, done)
        _save_call(ctx, comm, method, mutated, inputs, ints, floats, hints, timeout_s)
        return (token, done, *mutated)

    @staticmethod
    def backward(ctx, g_token, g_done, *g_mutated):
        d_mut, d_in = _adjoint(ctx, g_mutated)
        return (None,) * 9 + (*d_mut, *d_in)


class _EagerInPlaceCall(torch.autograd.Function):
    """NOTE [eager autograd]: ``_InPlaceCall`` for a call that writes one tensor, which comes
    first and is the only result. Autograd lets a Function that writes a view in place (a
    slice, or a ``_Result``, which ``as_subclass`` makes as an alias) return one tensor only, and
    its CopySlices hands the base the gradient of the Function's first input: with the order
    token first, the base's gradient outside the view was lost (seen: zeros)."""

    @staticmethod
    def forward(ctx, written, order, comm, method, ints, floats, hints, timeout_s, *inputs):
        call = (order, comm, method, ints, floats, hints, timeout_s, False, 1, written, *inputs)
        return _InPlaceCall.forward(ctx, *call)[2]

    @staticmethod
    def backward(ctx, g_written):
        d_written, *d_in = _InPlaceCall.backward(ctx, None, None, g_written)[9:]
        return (d_written, *(None,) * 7, *d_in)


def _comm_call_grad_autograd(*call):
    order, comm, method, mutated, inputs, ints, floats, hints, timeout_s, async_op = call
    if torch.is_grad_enabled() and any(t.requires_grad for t in [*mutated, *inputs]):
        args = (order, comm, method, ints, floats, hints, timeout_s, async_op, len(mutated))
        return tuple(_InPlaceCall.apply(*args, *mutated, *inputs)[:2])
    with torch._C._AutoDispatchBelowAutograd():
        return comm_call_(*call)


_lib.impl("comm_call_grad_", _comm_call_grad_autograd, "Autograd")
comm_call_grad_ = torch.ops.fastcomms.comm_call_grad_.default


# Never dead code: a call whose results this rank does not read (the gradient of a broadcast on
# the other ranks, a send) must still run, or its peers wait for it. (Not the effects system:
# with registered effects inductor threads its own tokens, and its peak-memory reordering
# ignored them.)
for _kept in (torch.ops.fastcomms.comm_call.default, comm_call_, comm_call_grad_):
    torch.fx.node.has_side_effect(_kept)


# -- traced side: what the methods run while Dynamo traces them --------------------------------
def _pack_hints(hints) -> str:
    # a str (the op's schema has no list of strings); "\x1f" cannot occur in a sane hint
    return "\x1f".join([s for k, v in (hints or {}).items() for s in (str(k), str(v))])


def _seconds(timeout) -> float:
    if timeout is None:
        return -1.0
    if isinstance(timeout, datetime.timedelta):  # total_seconds() is not traceable
        return timeout.days * 86400.0 + timeout.seconds + timeout.microseconds * 1e-6
    return float(timeout)


def _issue(
    order, comm, method, mutated, inputs, ints, floats, hints, timeout_s, async_op=None, grad=False
):
    """One node of ``comm_call``, or of ``comm_call_`` (``comm_call_grad_`` with ``grad``) where
    ``async_op`` is given; each number list ends with a pad, so none is empty (NOTE above)."""
    args = (order, comm, method, list(mutated), list(inputs), [*ints, 0], [*floats, 0.0], hints)
    if async_op is None:
        return comm_call(*args, timeout_s)
    return (comm_call_grad_ if grad else comm_call_)(*args, timeout_s, async_op)


def call(
    comm, method, mutated, inputs, ints=(), floats=(), hints=None, timeout=None, async_op=False
):
    """Traced: the node of one call. Synchronous: its results in the caller's tensors, a finished
    work; ``async_op`` (where no tensor needs a gradient): the work whose ``wait()`` waits for
    them (NOTE [compiled async calls])."""
    mutated = list(mutated)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in [*mutated, *inputs])
    eager = not torch.compiler.is_compiling()  # NOTE [eager autograd]: None, the eager call, if not
    if eager and (not grad or not mutated or any(t.is_leaf and t.requires_grad for t in mutated)):
        return None
    args = (mutated, inputs, ints, floats, _pack_hints(hints), _seconds(timeout))
    if eager:
        order = torch.empty(0, device=comm.get_device())
        ints, floats = [*ints, 0], [*floats, 0.0]  # (the pads of _issue)
        head = (order, comm, method, ints, floats, *args[4:])
        if any(not t.is_contiguous() for t in mutated) or (
            len(mutated) > 1 and any(t._is_view() for t in mutated)
        ):  # on clones, then copied back (as before 2026-12-04; the clones are contiguous)
            res = _issue(order, comm, method, *args)
            for dst, src in zip(mutated, res[1:], strict=True):
                dst.copy_(src)  # differentiable: the caller's tensor takes the call's history
        elif len(mutated) == 1:  # in place, synchronous: what comm_call_grad_'s kernel does
            _EagerInPlaceCall.apply(mutated[0], *head, *inputs)
        else:
            _InPlaceCall.apply(*head, False, len(mutated), *mutated, *inputs)
        out = [t.as_subclass(_Result) for t in mutated]
        return out if method in _LIST_WRITTEN else out[0]  # a list of one at world 1 too
    key = str(comm.get_device())
    async_op = async_op and _register_work is not None
    if mutated or (async_op and not grad):  # NOTE [compiled calls in place]
        token, done = _issue(_tokens[key], comm, method, *args, async_op=async_op, grad=grad)
        _tokens[key] = token
        return _TracedWork(mutated, done) if async_op else _DoneWork()
    res = _issue(_tokens[key], comm, method, *args)
    _tokens[key] = res[0]
    for dst, src in zip(mutated, res[1:], strict=True):
        dst.copy_(src)
    return _DoneWork()


class _Result(torch.Tensor):
    """What an eager differentiable call returns (NOTE [eager autograd]): the tensor it wrote,
    with the call's history, which is also its work (the call is complete: ``wait()`` returns
    the tensor). Operations on it give plain tensors."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    def wait(self) -> torch.Tensor:
        return self

    def is_completed(self) -> bool:
        return True


class _TracedWork:
    """The work of an ``async_op=True`` call while Dynamo traces it: ``wait()`` puts torch's
    ``wait_tensor`` (a collective's wait to inductor) on each tensor the call writes (on its
    done tensor where there are none) at the point of the program where it is called, and
    the caller's later reads of those tensors after it."""

    def __init__(self, mutated, done):
        self._pending = (mutated, done)

    def wait(self) -> None:
        if self._pending is None:
            return
        mutated, done = self._pending
        self._pending = None
        if not mutated:
            torch.ops._c10d_functional.wait_tensor(done)
        for t in mutated:
            t.copy_(torch.ops._c10d_functional.wait_tensor(t))

    def is_completed(self) -> bool:
        return self._pending is None


def batch(comm, ops, hints=None, timeout=None, async_op=False):
    """Traced: a batch's (is_send, tensor, peer) list as one call."""
    flags = [1 if s else 0 for s, _, _ in ops]
    peers = [p for _, _, p in ops]
    sends = [t for s, t, _ in ops if s]
    recvs = [t for s, t, _ in ops if not s]
    return call(comm, "batch", recvs, sends, flags + peers, (), hints, timeout, async_op)


def reduction(op) -> tuple[list[int], list[float]]:
    """Traced: a ReduceOp (or RedOpType) as the op's ints and floats."""
    t, f = _op(op)
    if isinstance(f, torch.Tensor):  # the traced call carries numbers only
        raise _ValueError(
            "PREMUL_SUM with a tensor factor runs on the plain eager path only (not under "
            "torch.compile, nor with tensors that require grad); pass a float factor there"
        )
    return [t.value], [f]


# -- autograd: the adjoint collective of each call ---------------------------------------------
# A method's call is differentiable where its tensors' adjoint is a collective on the same
# communicator (the linear ones: sums, averages and pre-scaled sums; movement): the backward is
# that collective on the gradients, one more node of the same op in the backward graph. Written
# tensors that the call overwrites get no gradient; the tensor an all_reduce or a broadcast
# updates in place passes its gradient through the adjoint.
_LINEAR = (RedOpType.SUM.value, RedOpType.AVG.value, RedOpType.PREMUL_SUM.value)
_SUM = ([RedOpType.SUM.value], [1.0])  # the ints and floats of a plain sum
_GATHERS = ("all_gather", "all_gather_v", "all_gather_single")
_SCATTERS = ("reduce_scatter", "reduce_scatter_v", "reduce_scatter_single")
_ADJOINT = dict(zip(_GATHERS + _SCATTERS, _SCATTERS + _GATHERS, strict=True))


def _grad_call(comm, method, mutated, inputs, ints=(), floats=(), hints="", timeout_s=-1.0):
    """A backward's collective: its results (its token starts no chain; the op is kept anyway)."""
    order = (list(mutated) + list(inputs))[0].new_empty(0)
    res = _issue(order, comm, method, mutated, inputs, ints, floats, hints, timeout_s)
    return res[1:]


def _scale(ints, floats, size) -> float:
    """The factor a linear reduction applies to each rank's term."""
    if ints[0] == RedOpType.AVG.value:
        return 1.0 / size
    return floats[0] if ints[0] == RedOpType.PREMUL_SUM.value else 1.0


def _save_call(ctx, comm, method, mutated, ins, ints, floats, hints, timeout_s):
    """What a call's backward needs (its number lists carry the pad)."""
    ctx.call = (comm, method, list(ints)[:-1], list(floats)[:-1], hints, timeout_s)
    ctx.n_mutated, ctx.n_inputs = len(mutated), len(ins)
    ctx.out_meta = [(tuple(t.shape), t.dtype, t.device) for t in mutated]
    ctx.in_shapes = [tuple(t.shape) for t in ins]
    ctx.device = comm.get_device()


def _setup_context(ctx, inputs, output):
    _save_call(ctx, *inputs[1:])  # (inputs[0]: the order token)


def _not_differentiable(comm, method, why):
    return RuntimeError(
        f"[rank {comm.get_rank()}/{comm.get_size()}] {method} inside torch.compile: {why}; "
        f"the differentiable calls are all_reduce and reduce_scatter with SUM, AVG or "
        f"PREMUL_SUM, broadcast, the all_gathers and the all_to_alls"
    )


def _backward(ctx, grads):
    """``comm_call``'s backward (grads[0] is the token's)."""
    d_mut, d_in = _adjoint(ctx, grads[1:])
    return None, None, None, d_mut, d_in, None, None, None, None


def _adjoint(ctx, grads):
    """The gradients of a call's written tensors and of its inputs, given those of its written
    tensors: the adjoint collective's results, or a node that refuses when it runs."""
    comm, method, ints, floats, hints, timeout_s = ctx.call
    g = [
        torch.zeros(s, dtype=d, device=v) if t is None else t.contiguous()
        for t, (s, d, v) in zip(grads, ctx.out_meta, strict=True)
    ]
    n, rank = comm.get_size(), comm.get_rank()
    d_mut: list = [None] * ctx.n_mutated
    d_in: list = [None] * ctx.n_inputs
    kw = {"hints": hints, "timeout_s": timeout_s}
    if method in _SCATTERS + ("all_reduce",) and ints[0] not in _LINEAR:
        why = f"its reduction ({RedOpType(ints[0])}) is not linear"
        return _refusal(ctx, comm, method, why, g)
    if method == "all_reduce":
        d_mut = _grad_call(comm, "all_reduce", [g[0]], [], ints, floats, **kw)
    elif method == "broadcast":
        (s,) = _grad_call(comm, "all_reduce", [g[0]], [], *_SUM, **kw)
        d_mut = [s if rank == ints[0] else torch.zeros_like(s)]
    elif method in _GATHERS:  # the gradients reduce-scattered into the input
        like_input = [g[0].new_empty(ctx.in_shapes[0])]
        d_in = _grad_call(comm, _ADJOINT[method], like_input, g, *_SUM, **kw)
    elif method in _SCATTERS:  # the gradient all-gathered, scaled as the reduction scaled
        outs = [g[0].new_empty(s) for s in ctx.in_shapes]
        f = _scale(ints, floats, n)
        d_in = _grad_call(comm, _ADJOINT[method], outs, [g[0]], **kw)
        d_in = [t * f if f != 1.0 else t for t in d_in]
    elif method in ("all_to_all_single", "all_to_all_v_single"):
        like_input = [g[0].new_empty(ctx.in_shapes[0])]
        if ints:  # the splits swap: what came from a rank goes back to it
            outs, ins = ints[1 : 1 + ints[0]], ints[1 + ints[0] :]
            ints = [len(ins), *ins, *outs]
        d_in = _grad_call(comm, method, like_input, [g[0]], ints, **kw)
    elif method == "all_to_all":
        outs = [t.new_empty(s) for t, s in zip(g, ctx.in_shapes, strict=True)]
        d_in = _grad_call(comm, "all_to_all", outs, g, **kw)
    else:
        return _refusal(ctx, comm, method, "it has no gradient formula", g)
    return list(d_mut), list(d_in)


def _refusal(ctx, comm, method, why, g):
    """The backward of a call without a gradient: a node that raises when the backward runs
    (on every rank alike), not while the compiler traces it, so a compiled forward whose
    backward never runs compiles."""
    msg = str(_not_differentiable(comm, method, why))
    res = _issue(torch.empty(0, device=ctx.device), comm, "refuse", g, [], (), (), msg, -1.0)
    return list(res[1:]), [None] * ctx.n_inputs


comm_call.register_autograd(_backward, setup_context=_setup_context)
