# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The communicator's own methods inside torch.compile(fullgraph=True, backend="inductor")
(NOTE [compiled communicator methods]): every collective and point-to-point method, sync and
async, gives bit for bit what the same call gives eagerly, on random data, with no graph break,
no eager call first and no recompilation across calls; a rank's calls keep their program order
where ranks run different code (a send and a receive in opposite orders); hooks see each call;
errors are the eager call's. gloo, 2 and 3 processes."""

import os
import pickle
import time

import fastcomms
import pytest
import torch
import torch._dynamo
from fastcomms import ReduceOp
from torch._dynamo.utils import counters

TIMEOUT = fastcomms.Timeout(seconds=120)
HINTS = {"purpose": "test", "x": "y"}


def _same(a, b):
    """Bit for bit, where NaN (the poison of an output nothing should write) matches NaN."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    return torch.equal(a, b)


def _cases(comm, rank, size):
    """name -> (fn(comm, async_op, *tensors), tensor factory): fn calls one method (and waits
    when async) on the tensors, which the call writes in place."""
    n = 4 * size
    dev = comm.get_device()
    seed = int.from_bytes(os.urandom(4), "little")  # fresh data every run, printed for a replay
    print(f"[rank {rank}] compiled methods: seed {seed}", flush=True)
    g = torch.Generator().manual_seed(seed + 31 * rank)
    nan = float("nan")

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    def ints(*shape):
        return torch.randint(-50, 50, shape, generator=g, dtype=torch.int32).to(dev)

    def poison(*shape):
        return torch.full(shape, nan, device=dev)

    def waited(w, async_op):
        if async_op:
            w.wait()

    root = size - 1
    return {
        "all_reduce": (
            lambda c, a, t: waited(c.all_reduce(t, ReduceOp.SUM, a), a),
            lambda: [rnd(n)],
        ),
        "all_reduce_max_int": (
            lambda c, a, t: waited(c.all_reduce(t, ReduceOp.MAX, a), a),
            lambda: [ints(n)],
        ),
        "all_reduce_premul_sum": (
            lambda c, a, t: waited(c.all_reduce(t, ReduceOp.PREMUL_SUM(0.5), a), a),
            lambda: [rnd(n)],
        ),
        "all_reduce_hints_timeout": (
            lambda c, a, t: waited(
                c.all_reduce(t, ReduceOp.SUM, a, hints=HINTS, timeout=TIMEOUT), a
            ),
            lambda: [rnd(n)],
        ),
        # a view of a larger tensor: the copy back lands in the base, nothing outside the view
        "all_reduce_of_a_view": (
            lambda c, a, t: waited(c.all_reduce(t[2:-3], ReduceOp.SUM, a), a),
            lambda: [rnd(n + 5)],
        ),
        # a read of the tensor before the call, used after it: the call, written in place, must
        # not overwrite the tensor before that read
        "read_before_all_reduce": (
            lambda c, a, t: (lambda y: (waited(c.all_reduce(t, ReduceOp.SUM, a), a), t.add_(y)))(
                t * 3
            ),
            lambda: [rnd(n)],
        ),
        "reduce": (
            lambda c, a, t: waited(c.reduce(t, root, ReduceOp.SUM, a), a),
            lambda: [rnd(n)],
        ),
        "broadcast": (lambda c, a, t: waited(c.broadcast(t, root, a), a), lambda: [rnd(n)]),
        "all_gather": (
            lambda c, a, x, *outs: waited(c.all_gather(list(outs), x, a), a),
            lambda: [rnd(3), *(poison(3) for _ in range(size))],
        ),
        "all_gather_single": (
            lambda c, a, o, x: waited(c.all_gather_single(o, x, a), a),
            lambda: [poison(3 * size), rnd(3)],
        ),
        "reduce_scatter": (
            lambda c, a, o, *ins: waited(c.reduce_scatter(o, list(ins), ReduceOp.SUM, a), a),
            lambda: [poison(3), *(rnd(3) for _ in range(size))],
        ),
        "reduce_scatter_single": (
            lambda c, a, o, x: waited(c.reduce_scatter_single(o, x, ReduceOp.MIN, a), a),
            lambda: [poison(3), rnd(3 * size)],
        ),
        "all_to_all_single": (
            lambda c, a, o, x: waited(c.all_to_all_single(o, x, a), a),
            lambda: [poison(2 * size), rnd(2 * size)],
        ),
        # rank r sends q + 1 elements to rank q, so receives r + 1 from everyone
        "all_to_all_v_single": (
            lambda c, a, o, x: waited(
                c.all_to_all_v_single(o, x, [rank + 1] * size, [q + 1 for q in range(size)], a),
                a,
            ),
            lambda: [
                poison(size * (rank + 1)),
                rnd(sum(q + 1 for q in range(size))),
            ],
        ),
        # even output splits given as [] beside explicit input splits (the lists differ in length)
        "all_to_all_v_single_one_list_empty": (
            lambda c, a, o, x: waited(c.all_to_all_v_single(o, x, [], [2] * size, a), a),
            lambda: [poison(2 * size), rnd(2 * size)],
        ),
        "all_to_all": (
            lambda c, a, *ts: waited(c.all_to_all(list(ts[:size]), list(ts[size:]), a), a),
            lambda: [
                *(poison(2) for _ in range(size)),
                *(rnd(2) for _ in range(size)),
            ],
        ),
        "scatter": (
            lambda c, a, o, *ins: waited(c.scatter(o, list(ins) if rank == 0 else [], 0, a), a),
            lambda: [poison(3), *(rnd(3) for _ in range(size))],
        ),
        "gather": (
            lambda c, a, x, *outs: waited(c.gather(list(outs) if rank == 0 else [], x, 0, a), a),
            lambda: [rnd(3), *(poison(3) for _ in range(size))],
        ),
        "barrier_then_add": (
            lambda c, a, t: (waited(c.barrier(a, hints=HINTS, timeout=TIMEOUT), a), t.add_(1)),
            lambda: [rnd(n)],
        ),
    }


def compiled_methods(comm, rank, size, backend="inductor", only=None):
    for name, (fn, make) in _cases(comm, rank, size).items():
        if only is not None and name not in only:
            continue
        for async_op in (False, True):
            torch._dynamo.reset()
            counters.clear()

            def step(*ts, fn=fn, async_op=async_op):
                fn(comm, async_op, *ts)
                return ts[0] * 2  # a use of the first written tensor inside the graph

            compiled = torch.compile(step, fullgraph=True, backend=backend)
            for call in range(3):  # fresh data each call: no recompilation
                ts = make()
                ref = [t.clone() for t in ts]
                got = [t.clone() for t in ts]
                r_out = step(*ref)
                c_out = compiled(*got)
                where = f"{name} async={async_op} call {call}"
                assert _same(r_out, c_out), where
                for i, (a, b) in enumerate(zip(ref, got, strict=True)):
                    assert _same(a, b), f"{where} tensor {i}"
            assert counters["stats"]["unique_graphs"] == 1, (name, dict(counters["stats"]))
            assert not counters["graph_break"], (name, dict(counters["graph_break"]))


def other_backends(comm, rank, size):
    """The same cases under Dynamo's "eager" backend (the in-place op runs as traced) and
    "aot_eager" (functionalized, not re-inplaced: the op runs on clones that are copied back)."""
    only = (
        "all_reduce",
        "all_reduce_of_a_view",
        "read_before_all_reduce",
        "all_gather",
        "broadcast",
        "barrier_then_add",
    )
    for backend in ("eager", "aot_eager"):
        compiled_methods(comm, rank, size, backend, only)


def test_other_backends(world):
    world(other_backends, 2)


def program_order(comm, rank, size):
    """Even ranks send then receive, odd ranks receive then send, then a barrier and an
    all_reduce whose result nothing in the graph reads: each rank's calls must run in the order
    written (a reordered send/receive pair hangs until the timeout)."""
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    send_t = torch.arange(5.0) + 100 * rank
    torch._dynamo.reset()
    counters.clear()

    def step(s, r, t, async_op):
        if rank % 2 == 0:
            a = comm.send(s, nxt, async_op)
            b = comm.recv(r, prv, async_op)
        else:
            b = comm.recv(r, prv, async_op)
            a = comm.send(s, nxt, async_op)
        if async_op:
            a.wait()
            b.wait()
        comm.barrier(False)
        comm.all_reduce(t, ReduceOp.SUM, False)
        return r + 1

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    for i in range(10):
        r, t = torch.zeros(5), torch.full((3,), float(rank + i))
        out = compiled(send_t + i, r, t, i % 2 == 1)
        assert torch.equal(r, torch.arange(5.0) + 100 * prv + i), (i, r)
        assert torch.equal(out, r + 1)
        assert torch.equal(t, torch.full((3,), float(sum(q + i for q in range(size)))))
    # async_op is a constant of the trace: one graph for each value, none per call
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])


def batch_and_hooks(comm, rank, size):
    """A batch filled and issued inside the graph; pre-hooks and post-hooks see every call of
    every run of the compiled function (the eager call runs inside the op)."""
    torch._dynamo.reset()
    seen = []
    pre = comm.register_pre_hook(lambda name, op_id, args: seen.append(("pre", str(name))))
    post = comm.register_post_hook(lambda op_id, args: seen.append(("post", op_id)))
    peers = [q for q in range(size) if q != rank]

    def step(sends, recvs, async_op):
        batch = comm.batch_op_create()
        for t, q in zip(sends, peers, strict=True):
            batch.send(t, q)
        for t, q in zip(recvs, peers, strict=True):
            batch.recv(t, q)
        w = batch.issue(async_op)
        if async_op:
            w.wait()
        return [t * 1 for t in recvs]

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    for i in range(3):
        sends = [torch.full((4,), float(100 * rank + q + i)) for q in peers]
        recvs = [torch.zeros(4) for _ in peers]
        seen.clear()
        compiled(sends, recvs, False)
        for t, q in zip(recvs, peers, strict=True):
            assert torch.equal(t, torch.full((4,), float(100 * q + rank + i))), (i, q, t)
        assert [k for k, _ in seen] == ["pre", "post"], seen
        assert "batch" in seen[0][1], seen
    pre.remove()
    post.remove()


def compiled_errors(comm, rank, size):
    """A bad argument inside a compiled function raises what the eager call raises (the rank,
    the op, the argument), at run time, on every rank; the communicator stays usable."""
    torch._dynamo.reset()
    t = torch.ones(3)
    with pytest.raises(ValueError) as eager:
        comm.broadcast(t, size + 5, False)

    def step(t):
        comm.broadcast(t, size + 5, False)
        return t

    with pytest.raises(ValueError) as compiled:
        torch.compile(step, fullgraph=True, backend="inductor")(t)
    assert f"rank {rank}" in str(compiled.value) and str(size + 5) in str(compiled.value)
    assert type(compiled.value) is type(eager.value)
    # a communicator pickles to bytes naming it (the graph cache's key: its rank among them)
    # and refuses to unpickle
    blob = pickle.dumps(comm)
    with pytest.raises(TypeError, match=f"rank {rank} of {size}.*cannot be unpickled"):
        pickle.loads(blob)
    comm.barrier(False)
    x = torch.full((2,), float(rank))
    comm.all_reduce(x, ReduceOp.SUM, False)
    assert torch.equal(x, torch.full((2,), float(sum(range(size)))))


def test_compiled_errors(world):
    world(compiled_errors, 2)


def test_eager_autograd_switch_reads_as_torchcomms(monkeypatch):
    """NOTE [eager autograd]: TORCHCOMMS_PATCH_FOR_COMPILE turns it on as torchcomms reads the
    variable ("1" or "true", any case), read at each call; anything else leaves it off."""
    from fastcomms._comm import _eager_grad

    for value, on in (("1", True), ("true", True), ("TRUE", True), ("True", True), ("0", False)):
        monkeypatch.setenv("TORCHCOMMS_PATCH_FOR_COMPILE", value)
        assert _eager_grad() is on, value
    for value in ("", "yes", "false"):
        monkeypatch.setenv("TORCHCOMMS_PATCH_FOR_COMPILE", value)
        assert not _eager_grad(), value
    monkeypatch.delenv("TORCHCOMMS_PATCH_FOR_COMPILE")
    assert not _eager_grad()


def test_is_torch_compile_supported():
    """True on this torch (the methods compile, NOTE [compiled communicator methods]); the
    version rule as torchcomms states it."""
    from fastcomms.functional import (
        is_torch_compile_supported,
        is_torch_compile_supported_and_enabled,
    )

    assert is_torch_compile_supported() and is_torch_compile_supported_and_enabled()
    assert not is_torch_compile_supported(_current_version="2.10.0")
    assert is_torch_compile_supported("2.11.0.dev0", _current_version="2.11.0+cu130")
    assert not is_torch_compile_supported("2.12.0.dev0", _current_version="2.11.0")
    # torchcomms' override of the version rule
    os.environ["TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT"] = "1"
    try:
        assert is_torch_compile_supported("2.12.0.dev0", _current_version="2.11.0")
    finally:
        del os.environ["TORCHCOMMS_COMPILE_IGNORE_PYTORCH_VERSION_REQUIREMENT"]


def _backward_cases(comm, rank, size, what):
    """name -> (input size, ours(x) -> output(s), reference(x) -> output(s)), and the helpers:
    the differentiable calls against torch.distributed.nn.functional on torch's gloo group."""
    import torch.distributed.nn.functional as tdnn

    seed = int.from_bytes(os.urandom(4), "little")
    print(f"[rank {rank}] {what}: seed {seed}", flush=True)
    g = torch.Generator().manual_seed(seed + 31 * rank)

    def ints_like(n):
        return torch.randint(-8, 8, (n,), generator=g).float()

    m = 2 * size
    ins, outs = [q + 1 for q in range(size)], [rank + 1] * size  # uneven all_to_all_v splits
    root = size - 1

    def ours_ar(op):
        return lambda x: (lambda b: (comm.all_reduce(b, op, False), b)[1])(x * 1.0)

    cases = {  # name -> (input size, ours(x) -> output(s), reference(x) -> output(s))
        "all_reduce_sum": (m, ours_ar(ReduceOp.SUM), lambda x: tdnn.all_reduce(x * 1.0)),
        "all_reduce_avg": (m, ours_ar(ReduceOp.AVG), lambda x: tdnn.all_reduce(x * 1.0) / size),
        "all_reduce_premul": (
            m,
            ours_ar(ReduceOp.PREMUL_SUM(0.5)),
            lambda x: tdnn.all_reduce(x * 0.5),
        ),
        "broadcast": (
            m,
            lambda x: (lambda b: (comm.broadcast(b, root, False), b)[1])(x * 1.0),
            lambda x: tdnn.broadcast(x * 1.0, src=root),
        ),
        "all_gather": (
            m,
            lambda x: (lambda o: (comm.all_gather(o, x * 1.0, False), o)[1])(
                [torch.zeros(m) for _ in range(size)]
            ),
            lambda x: list(tdnn.all_gather(x * 1.0)),
        ),
        "all_gather_single": (
            m,
            lambda x: (lambda o: (comm.all_gather_single(o, x * 1.0, False), o)[1])(
                torch.zeros(m * size)
            ),
            lambda x: torch.cat(tdnn.all_gather(x * 1.0)),
        ),
        "reduce_scatter": (
            m * size,
            lambda x: (
                lambda o: (
                    comm.reduce_scatter(o, list((x * 1.0).chunk(size)), ReduceOp.SUM, False),
                    o,
                )[1]
            )(torch.zeros(m)),
            lambda x: tdnn.reduce_scatter(torch.zeros(m), list((x * 1.0).chunk(size))),
        ),
        "reduce_scatter_single_avg": (
            m * size,
            lambda x: (
                lambda o: (comm.reduce_scatter_single(o, x * 1.0, ReduceOp.AVG, False), o)[1]
            )(torch.zeros(m)),
            lambda x: tdnn.reduce_scatter(torch.zeros(m), list((x * 1.0).chunk(size))) / size,
        ),
        "all_to_all_single": (
            m,
            lambda x: (lambda o: (comm.all_to_all_single(o, x * 1.0, False), o)[1])(torch.zeros(m)),
            lambda x: tdnn.all_to_all_single(torch.zeros(m), x * 1.0),
        ),
        "all_to_all_v_single": (
            sum(ins),
            lambda x: (lambda o: (comm.all_to_all_v_single(o, x * 1.0, outs, ins, False), o)[1])(
                torch.zeros(sum(outs))
            ),
            lambda x: tdnn.all_to_all_single(torch.zeros(sum(outs)), x * 1.0, outs, ins),
        ),
        "all_to_all": (
            m,
            lambda x: (lambda o: (comm.all_to_all(o, list((x * 1.0).chunk(size)), False), o)[1])(
                [torch.zeros(2) for _ in range(size)]
            ),
            lambda x: list(
                tdnn.all_to_all([torch.zeros(2) for _ in range(size)], list(x.chunk(size)))
            ),
        ),
    }

    def loss_of(out, w):
        outs_ = out if isinstance(out, list) else [out]
        return sum((o * wi).sum() for o, wi in zip(outs_, w, strict=True))

    return cases, ints_like, loss_of, ours_ar, m


def _check_against_reference(name, n, run, ref, ints_like, loss_of):
    """x.grad and the loss of ``run(x, w)`` (ours) equal those of the reference on fresh data:
    bit for bit, or to rounding for an average (an average of exact sums, the two dividing at
    different points)."""
    x0 = ints_like(n)
    with torch.no_grad():
        probe = ref(x0.clone())
    w = [
        ints_like(t.numel()).view(t.shape) for t in (probe if isinstance(probe, list) else [probe])
    ]
    x_ref = x0.clone().requires_grad_()
    loss_of(ref(x_ref), w).backward()
    x_ours = x0.clone().requires_grad_()
    loss = run(x_ours, w)
    loss.backward()
    ref_loss = loss_of(ref(x0.clone()), w).detach()
    if "avg" in name:
        torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(loss.detach(), ref_loss, rtol=1e-6, atol=1e-5)
    else:
        assert torch.equal(x_ours.grad, x_ref.grad), (name, x_ours.grad, x_ref.grad)
        assert torch.equal(loss.detach(), ref_loss), name


def compiled_backward(comm, rank, size):
    """The differentiable methods through a compiled function's backward: x.grad equals the
    gradient torch.distributed.nn.functional gives on torch's own gloo group, bit for bit
    (integer-valued data, so every sum is exact in any order; the averages to rounding, the two
    dividing at different points); a reduction that is not linear refuses the backward when it
    runs, saying why."""
    import torch.distributed as dist
    import torch.distributed.nn.functional as tdnn

    cases, ints_like, loss_of, ours_ar, m = _backward_cases(comm, rank, size, "compiled backward")
    # the broadcast twice: its gradient is traced per rank, and the second compile finds the
    # first in inductor's graph cache, which every rank of the host shares; a key without the
    # rank gave the root the other ranks' gradient (0) from the cache
    runs = [*cases.items(), ("broadcast", cases["broadcast"])]

    def ours_async(x):  # NOTE [differentiable in-place calls]: async calls with a gradient
        b, o = x * 1.0, torch.zeros(m * size)
        w1 = comm.all_reduce(b, ReduceOp.SUM, True)
        w2 = comm.all_gather_single(o, x * 2.0, True)
        w2.wait()
        w1.wait()
        return [b, o]

    runs.append(
        (
            "async",
            (
                m,
                ours_async,
                lambda x: [tdnn.all_reduce(x * 1.0), torch.cat(tdnn.all_gather(x * 2.0))],
            ),
        )
    )
    for name, (n, ours, ref) in runs:
        torch._dynamo.reset()
        dist.barrier()  # every rank's first compile wrote the cache before any second one reads
        _check_against_reference(
            name,
            n,
            lambda x, w, ours=ours: torch.compile(
                lambda x: loss_of(ours(x), w), fullgraph=True, backend="inductor"
            )(x),
            ref,
            ints_like,
            loss_of,
        )
    dist.barrier()

    torch._dynamo.reset()
    x = ints_like(m).requires_grad_()
    loss = torch.compile(lambda x: ours_ar(ReduceOp.MAX)(x).sum(), fullgraph=True)(x)
    with pytest.raises(RuntimeError, match="not linear"):
        loss.backward()


_stamps: list[float] = []


@torch.library.custom_op("fastcomms_test::stamp", mutates_args=())
def _stamp(after: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Records when it runs; ``after`` orders it after a node (the order token of a call)."""
    _stamps.append(time.monotonic())
    return x.clone()


@_stamp.register_fake
def _(after, x):
    return torch.empty_like(x)


torch.fx.node.has_side_effect(torch.ops.fastcomms_test.stamp.default)


def async_overlap(comm, rank, size):
    """NOTE [compiled async calls]: an ``async_op=True`` call inside a compiled function does not
    hold the function up until its ``wait()``. The last rank joins the all_reduce DELAY seconds
    late; on the other ranks a node between the call and its wait() (ordered after the call
    through the call's order token) runs at once, and the wait() returns only after the last
    rank joined, with the sum. The control: the same function with async_op=False must run that
    node only after the delay (it fails the "at once" check every run)."""
    from fastcomms import _compiled

    delay, key = 1.0, str(comm.get_device())

    def step(t, x, async_op):
        w = comm.all_reduce(t, ReduceOp.SUM, async_op)
        y = _stamp(_compiled._tokens[key], x)
        w.wait()
        return y + t[0]

    def step_grad(t0, x, async_op):  # NOTE [differentiable in-place calls]: t needs a gradient
        t = t0 * 1.0
        w = comm.all_reduce(t, ReduceOp.SUM, async_op)
        y = _stamp(_compiled._tokens[key].detach(), x)  # (the stamp has no gradient formula)
        w.wait()
        return y + t[0], t

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    compiled_grad = torch.compile(step_grad, fullgraph=True, backend="inductor")
    # the second is the control; the third an async call with a gradient (its control, the
    # same with async_op=False, failed as the second does before such calls were async)
    for async_op, grad in ((True, False), (False, False), (True, True)):
        torch._dynamo.reset()
        fn = compiled_grad if grad else compiled
        fn(torch.ones(8, requires_grad=grad), torch.ones(2), async_op)  # compiled here
        for i in range(2):
            t = torch.full((8,), float(rank + i), requires_grad=grad)
            comm.barrier(False)
            if rank == size - 1:
                time.sleep(delay)
            _stamps.clear()
            t0 = time.monotonic()
            out = fn(t, torch.ones(2), async_op)
            t1 = time.monotonic()
            total = float(sum(q + i for q in range(size)))
            if grad:
                out, t_out = out
                t_out.sum().backward()  # the adjoint all_reduce of ones on every rank
                assert torch.equal(t.grad, torch.full((8,), float(size))), (i, t.grad)
                t = t_out.detach()
            assert torch.equal(t, torch.full((8,), total)), (async_op, i, t)
            assert torch.equal(out.detach(), torch.full((2,), total + 1.0)), (async_op, i, out)
            if rank == size - 1:
                continue
            at = _stamps[0] - t0
            print(
                f"[rank {rank}] async={async_op} grad={grad}: node at {at:.3f} s, "
                f"done at {t1 - t0:.3f} s"
            )
            assert t1 - t0 > 0.5 * delay, (async_op, t1 - t0)  # the wait waited for the late rank
            if async_op:
                assert at < 0.25 * delay, f"the node waited for the call ({at:.3f} s)"
            else:  # the control: a synchronous call holds the node back
                assert at > 0.5 * delay, f"control: the node ran before the call ({at:.3f} s)"


def eager_autograd(comm, rank, size):
    """NOTE [eager autograd]: with TORCHCOMMS_PATCH_FOR_COMPILE=1, the eager methods are
    differentiable where a tensor of the call needs a gradient: x.grad as
    torch.distributed.nn.functional gives it (the cases of compiled_backward, bit for bit); an
    async call returns the tensor it wrote, which is also its work (torchcomms' pattern
    ``b = comm.all_reduce(b, op, async_op=True); b.sum().backward()``), in place through
    comm_call_'s C++ kernel (its counter; it stays put on the clones' route, which failed this
    check), a view written in place with the gradient of the rest of its base kept (with the
    order token as the Function's first input that part read zeros), a returned tensor written
    again, and a list of tensors; a parameter (a leaf) is still broadcast in place. The
    control: the same all_reduce without the variable writes the data outside autograd, and its
    gradient differs (that check fails every run with size > 1)."""
    import torch.distributed as dist
    from fastcomms import _C

    cases, ints_like, loss_of, ours_ar, m = _backward_cases(comm, rank, size, "eager autograd")
    os.environ["TORCHCOMMS_PATCH_FOR_COMPILE"] = "1"
    try:
        for name, (n, ours, ref) in cases.items():
            run = (lambda ours: lambda x, w: loss_of(ours(x), w))(ours)
            _check_against_reference(name, n, run, ref, ints_like, loss_of)

        x = ints_like(m).requires_grad_()
        fast = _C._compiled_fast_calls()
        b = comm.all_reduce(x * 1.0, ReduceOp.SUM, True)  # the returned tensor is the work
        assert b.wait() is b and b.is_completed()
        assert _C._compiled_fast_calls() == fast + 1  # in place, through comm_call_'s C++ kernel
        b.sum().backward()
        assert torch.equal(x.grad, torch.full((m,), float(size))), x.grad
        x.grad = None  # a view written (half of b), in place: the other half keeps its gradient
        b, fast = x * 1.0, _C._compiled_fast_calls()
        comm.all_reduce(b[: m // 2], ReduceOp.SUM, False)
        assert _C._compiled_fast_calls() == fast + 1
        b.sum().backward()
        want = torch.cat([torch.full((m // 2,), float(size)), torch.ones(m - m // 2)])
        assert torch.equal(x.grad, want), x.grad
        x.grad = None  # a returned tensor (an alias) written again, in place both times
        fast = _C._compiled_fast_calls()
        b = comm.all_reduce(comm.all_reduce(x * 1.0, ReduceOp.SUM, True), ReduceOp.SUM, True)
        assert _C._compiled_fast_calls() == fast + 2
        b.sum().backward()
        assert torch.equal(x.grad, torch.full((m,), float(size * size))), x.grad
        fast = _C._compiled_fast_calls()  # several written tensors, in place
        outs = comm.all_gather([torch.zeros(m) for _ in range(size)], x * 2.0, True)
        assert isinstance(outs, list) and len(outs) == size
        assert _C._compiled_fast_calls() == fast + 1
        x.grad = None
        sum(o.sum() for o in outs).backward()
        assert torch.equal(x.grad, torch.full((m,), 2.0 * size)), x.grad

        p = torch.nn.Parameter(torch.full((3,), float(rank)))  # a leaf: written outside autograd
        assert isinstance(comm.broadcast(p, 0, False), fastcomms.TorchWork)
        assert torch.equal(p.detach(), torch.zeros(3)) and p.grad_fn is None
        with torch.no_grad():  # no gradient wanted: the plain eager call
            assert isinstance(comm.all_reduce(x * 1.0, ReduceOp.SUM, False), fastcomms.TorchWork)
    finally:
        del os.environ["TORCHCOMMS_PATCH_FOR_COMPILE"]

    x = ints_like(m).requires_grad_()  # the control: no variable, no gradient through the call
    b = x * 1.0
    comm.all_reduce(b, ReduceOp.SUM, False)
    b.sum().backward()
    assert not torch.equal(x.grad, torch.full((m,), float(size))) or size == 1, x.grad
    dist.barrier()


def call_paths(comm, rank, size):
    """NOTE [compiled calls in C++]: a synchronous compiled call on a built-in backend's
    communicator runs in comm_call_'s C++ kernel (its counter counts it), Python hooks
    registered or not (they see the call with the eager call's arguments, NOTE [hooks on the
    fast path]); async or with per-call hints, the Python kernel runs it and the counter stays;
    the results are the same either way."""
    from fastcomms import _C

    torch._dynamo.reset()

    def step(t, async_op, hints):
        w = comm.all_reduce(t, ReduceOp.SUM, async_op, hints=hints)
        if async_op:
            w.wait()
        return t + 1

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    want = torch.full((4,), float(size * (size + 1) // 2))

    def run(async_op=False, hints=None):  # -> the calls the C++ kernel ran itself
        t = torch.full((4,), float(rank + 1))
        before = _C._compiled_fast_calls()
        out = compiled(t, async_op, hints)
        ran = _C._compiled_fast_calls() - before
        assert torch.equal(t, want) and torch.equal(out, want + 1), (async_op, hints, t, out)
        return ran

    assert run() == 1
    assert run(async_op=True) == 0
    assert run(hints=HINTS) == 0
    seen, posts = [], []
    hook = comm.register_pre_hook(lambda name, op_id, args: seen.append((str(name), op_id, args)))
    post = comm.register_post_hook(lambda op_id, args: posts.append(op_id))
    try:
        assert run() == 1 and len(seen) == 1 and "all_reduce" in seen[0][0], seen
        args = seen[0][2]
        assert type(args).__name__ == "AllReducePreHookArgs" and args.op == ReduceOp.SUM
        assert args.async_op is False and tuple(args.tensor.shape) == (4,)
        assert posts == [seen[0][1]]
        # an error in the Python kernel reaches the caller through the C++ one unchanged
        with pytest.raises(ValueError) as eager:
            comm.broadcast(torch.ones(3), size + 5, False)

        def bad(t):
            comm.broadcast(t, size + 5, False)
            return t

        with pytest.raises(ValueError) as got:
            torch.compile(bad, fullgraph=True, backend="inductor")(torch.ones(3))
        assert type(got.value) is type(eager.value), (got.value, eager.value)
        assert f"rank {rank}" in str(got.value) and str(size + 5) in str(got.value)
    finally:
        hook.remove()
        post.remove()
    assert run() == 1


# One spawned world per size runs every body in turn: each process pays torch.compile's start-up
# (inductor's imports and caches, the first compile) once instead of once per body, which was
# most of this file's time in CI. Every body resets dynamo and removes its hooks itself.
SUITE = (
    compiled_methods,
    program_order,
    batch_and_hooks,
    compiled_backward,
    async_overlap,
    eager_autograd,
    call_paths,
)


def compiled_suite(comm, rank, size):
    for body in SUITE:
        body(comm, rank, size)


@pytest.mark.parametrize("size", [2, 3])
def test_compiled_bodies(world, size):
    """compiled_methods, program_order, batch_and_hooks, compiled_backward, async_overlap,
    eager_autograd and call_paths at 2 and 3 processes."""
    world(compiled_suite, size)
