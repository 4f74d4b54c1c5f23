# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The communicator's own methods under torch.compile (``comm.all_reduce(t, op, async_op)``
inside ``torch.compile(fullgraph=True)``).

NOTE [compiled communicator methods]: a TorchComm is an opaque reference type whose collective
methods are registered as inlined members, so Dynamo traces each method's Python body; under
compilation that body comes here instead of to the C++ communicator. Every call becomes one node
of a single custom op, ``fastcomms::comm_call``: a functional op that takes the communicator (an
opaque graph input), the method's name, the tensors it writes (``mutated``) and reads
(``inputs``), its integer and float arguments, hints and timeout, and returns fresh tensors that
the method then copies back into the caller's tensors (``t.copy_(...)``, which the compiler turns
into an in-place update of the graph input). At run time the op clones the written tensors, runs
the eager method on the clones with ``async_op=False`` (hooks, the flight recorder and errors as
in eager mode) and returns them.

Order: a rank must issue its communicator calls in program order (a send and a receive that the
compiler swapped on one rank hang against the peer), and torch 2.11's inductor reorders nodes
for peak memory without regard to registered op effects (seen: barrier, send, recv, all_reduce
for barrier, all_reduce, send, recv). So every call takes an order token (an empty tensor) and
returns the next one, a data dependency no scheduler may break. The token of each device lives
in ``_tokens``, made when a communicator is made (so the first compile sees it and the second
call does not recompile); the compiled graph reads it and stores the next.

``async_op=True`` gives a finished work (``wait()`` does nothing): the call is complete in
stream order where it stands in the graph, so compute between the call and its ``wait()`` does
not overlap it. For overlap under compile, use fastcomms.functional (torch's functional
collectives, which inductor schedules) or the Ulysses op.
"""

from __future__ import annotations

import datetime

import torch

from . import RedOpType, ReduceOp, TorchComm, _DoneWork, _op

_tokens: dict[str, torch.Tensor] = {}  # device -> the order token of the calls on it


def ensure_token(device: torch.device) -> None:
    """Eager: the order token of ``device``, made once."""
    key = str(device)
    if key not in _tokens:
        _tokens[key] = torch.empty(0, device=device)


def _red(n: list[int], f: list[float]) -> ReduceOp:
    return ReduceOp(RedOpType(n[0]), f[0])


# method -> the eager call on the clones: fn(comm, outs, ins, ints, floats, kw)
_RUN = {
    "send": lambda c, o, i, n, f, kw: c.send(i[0], n[0], False, **kw),
    "recv": lambda c, o, i, n, f, kw: c.recv(o[0], n[0], False, **kw),
    "broadcast": lambda c, o, i, n, f, kw: c.broadcast(o[0], n[0], False, **kw),
    "all_reduce": lambda c, o, i, n, f, kw: c.all_reduce(o[0], _red(n, f), False, **kw),
    "reduce": lambda c, o, i, n, f, kw: c.reduce(o[0], n[1], _red(n, f), False, **kw),
    "all_gather": lambda c, o, i, n, f, kw: c.all_gather(o, i[0], False, **kw),
    "all_gather_v": lambda c, o, i, n, f, kw: c.all_gather_v(o, i[0], False, **kw),
    "all_gather_single": lambda c, o, i, n, f, kw: c.all_gather_single(o[0], i[0], False, **kw),
    "reduce_scatter": lambda c, o, i, n, f, kw: c.reduce_scatter(o[0], i, _red(n, f), False, **kw),
    "reduce_scatter_v": lambda c, o, i, n, f, kw: c.reduce_scatter_v(
        o[0], i, _red(n, f), False, **kw
    ),
    "reduce_scatter_single": lambda c, o, i, n, f, kw: c.reduce_scatter_single(
        o[0], i[0], _red(n, f), False, **kw
    ),
    "all_to_all_single": lambda c, o, i, n, f, kw: c.all_to_all_single(o[0], i[0], False, **kw),
    # ints: the output splits then the input splits, each half of the list
    "all_to_all_v_single": lambda c, o, i, n, f, kw: c.all_to_all_v_single(
        o[0], i[0], n[: len(n) // 2], n[len(n) // 2 :], False, **kw
    ),
    "all_to_all": lambda c, o, i, n, f, kw: c.all_to_all(o, i, False, **kw),
    "barrier": lambda c, o, i, n, f, kw: c.barrier(False, **kw),
    "scatter": lambda c, o, i, n, f, kw: c.scatter(o[0], i, n[0], False, **kw),
    "gather": lambda c, o, i, n, f, kw: c.gather(o, i[0], n[0], False, **kw),
    "gather_single": lambda c, o, i, n, f, kw: c.gather_single(o[0], i[0], n[0], False, **kw),
    "batch": lambda c, o, i, n, f, kw: _run_batch(c, o, i, n, kw),
}


def _run_batch(comm, outs, ins, n, kw):
    """ints: one flag per op (1 send, 0 receive) then one peer per op, in the batch's order."""
    half = len(n) // 2
    batch, si, ri = comm.batch_op_create(), iter(ins), iter(outs)
    for is_send, peer in zip(n[:half], n[half:], strict=True):
        if is_send:
            batch.send(next(si), peer)
        else:
            batch.recv(next(ri), peer)
    return batch.issue(False, **kw)


def _unpack_hints(hints: str) -> dict[str, str] | None:
    if not hints:
        return None
    parts = hints.split("\x1f")
    return dict(zip(parts[0::2], parts[1::2], strict=True))


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
    outs = [t.clone() for t in mutated]
    kw = {"hints": _unpack_hints(hints)}
    if timeout_s >= 0:
        kw["timeout"] = datetime.timedelta(seconds=timeout_s)
    _RUN[method](comm, outs, list(inputs), list(ints), list(floats), kw)
    return [order.new_empty(0), *outs]


@comm_call.register_fake
def _(order, comm, method, mutated, inputs, ints, floats, hints, timeout_s):
    return [order.new_empty(0), *(torch.empty_like(t) for t in mutated)]


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


def call(comm, method, mutated, inputs, ints=(), floats=(), hints=None, timeout=None):
    """Traced: the node of one call, its results copied back; a finished work."""
    mutated = list(mutated)
    key = str(comm.get_device())
    res = comm_call(
        _tokens[key],
        comm,
        method,
        mutated,
        list(inputs),
        list(ints),
        list(floats),
        _pack_hints(hints),
        _seconds(timeout),
    )
    _tokens[key] = res[0]
    for dst, src in zip(mutated, res[1:], strict=True):
        dst.copy_(src)
    return _DoneWork()


def reduction(op) -> tuple[list[int], list[float]]:
    """Traced: a ReduceOp (or RedOpType) as the op's ints and floats."""
    t, f = _op(op)
    return [t.value], [f]


def batch(comm, ops, hints=None, timeout=None):
    """Traced: a batch's (is_send, tensor, peer) list as one call."""
    flags = [1 if s else 0 for s, _, _ in ops]
    peers = [p for _, _, p in ops]
    sends = [t for s, t, _ in ops if s]
    recvs = [t for s, t, _ in ops if not s]
    return call(comm, "batch", recvs, sends, flags + peers, (), hints, timeout)
