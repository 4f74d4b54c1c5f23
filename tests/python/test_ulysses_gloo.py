# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms.ulysses on CPU over gloo: bit-exact against permute + torch.distributed
.all_to_all_single + permute on random geometries (uneven included), autograd (gradcheck and
gradgradcheck in float64), out=, and validation messages. Worlds of 2 and 3 processes."""

import copy
import random

import pytest
import torch
import torch.distributed as dist
from fastcomms.ulysses import UlyssesGroup
from torch.distributed._functional_collectives import AsyncCollectiveTensor


def _geometries(size, count, seed):
    rng = random.Random(seed)
    for _ in range(count):
        mode = rng.randint(0, 1)
        uneven = rng.random() < 0.6
        seq = [rng.randint(0, 5) if uneven else 3 for _ in range(size)]
        heads = [rng.randint(0, 3) if uneven else 2 for _ in range(size)]
        seq[rng.randrange(size)] += 1
        heads[rng.randrange(size)] += 1
        if not uneven:
            seq, heads = [seq[0]] * size, [heads[0]] * size
        b, d = rng.randint(1, 3), rng.randint(1, 9)
        dtype = rng.choice(
            [
                torch.float32,
                torch.bfloat16,
                torch.float16,
                torch.int32,
                torch.uint8,
                torch.int8,
                torch.float64,
                torch.float8_e4m3fn,
                torch.float8_e5m2,
            ]
        )
        yield mode, uneven, seq, heads, b, d, dtype


def bit_exact(comm, rank, size):
    ours = UlyssesGroup(comm)
    ref = UlyssesGroup(None)  # permute + torch.distributed.all_to_all_single + permute
    checked = 0
    for i, (mode, uneven, seq, heads, b, d, dtype) in enumerate(_geometries(size, 25, 7)):
        shape = (b, seq[rank], sum(heads), d) if mode == 0 else (b, sum(seq), heads[rank], d)
        g = torch.Generator().manual_seed(1000 * i + rank)
        x = torch.randint(0, 120, shape, generator=g).to(dtype)
        kw = {"seq_splits": seq, "head_splits": heads} if uneven else {}
        got = ours.all_to_all_4d(x, mode=mode, **kw)
        if dtype.itemsize == 1 and dtype.is_floating_point:  # gloo has no float8: move the bytes
            want = ref.all_to_all_4d(x.view(torch.uint8), mode=mode, **kw).view(dtype)
        else:
            want = ref.all_to_all_4d(x, mode=mode, **kw)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (i, mode, seq, heads)
        back = ours.all_to_all_4d(got, mode=1 - mode, **kw)
        assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))
        out = ours.empty_output(x, mode=mode, **kw)
        out.view(torch.uint8).fill_(0xA5)  # poison
        ours.all_to_all_4d(x, mode=mode, out=out, **kw)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
        checked += 1
    assert checked == 25


def autograd(comm, rank, size):
    g = UlyssesGroup(comm)
    # gradcheck perturbs one element at a time on each rank independently, which is meaningless
    # for an exchange across ranks, so it runs on a world of one (every rank its own group);
    # across ranks the backward is checked by the adjoint (dot-product) test below.
    solo = UlyssesGroup(comm.split([rank], f"solo{rank}"))
    x = torch.randn(2, 3, 4, 3, dtype=torch.float64, requires_grad=True)
    for mode in (0, 1):
        assert torch.autograd.gradcheck(lambda t, m=mode: solo.all_to_all_4d(t, mode=m), (x,))
        assert torch.autograd.gradgradcheck(lambda t, m=mode: solo.all_to_all_4d(t, mode=m), (x,))
    # adjoint test across ranks: sum_r <A(x)_r, g_r> == sum_r <x_r, A^T(g)_r>
    seq, heads = [2, 3, 1][:size], [1, 2, 2][:size]
    for mode in (0, 1):
        shape = (2, seq[rank], sum(heads), 3) if mode == 0 else (2, sum(seq), heads[rank], 3)
        x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        y = g.all_to_all_4d(x, mode=mode, seq_splits=seq, head_splits=heads)
        gy = torch.randn_like(y)
        (gx,) = torch.autograd.grad(y, x, gy)
        dots = torch.stack([(y.detach() * gy).sum(), (x.detach() * gx).sum()])
        dist.all_reduce(dots)
        assert torch.allclose(dots[0], dots[1], rtol=1e-12, atol=1e-12), dots
    # uneven: the gradient of mode 0 is mode 1 of the incoming gradient, same splits
    seq, heads = [2, 3, 1][:size], [1, 2, 2][:size]
    x = torch.randn(2, seq[rank], sum(heads), 3, dtype=torch.float64, requires_grad=True)
    y = g.all_to_all_4d(x, mode=0, seq_splits=seq, head_splits=heads)
    gy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, gy)
    want = g.all_to_all_4d(gy, mode=1, seq_splits=seq, head_splits=heads)
    assert torch.equal(gx, want)
    # forward-mode AD carries the tangent through the same exchange
    import torch.autograd.forward_ad as fwAD

    with fwAD.dual_level():
        t = torch.randn_like(x)
        dual = fwAD.make_dual(x.detach(), t)
        out = g.all_to_all_4d(dual, mode=0, seq_splits=seq, head_splits=heads)
        tangent = fwAD.unpack_dual(out).tangent
    assert torch.equal(tangent, g.all_to_all_4d(t, mode=0, seq_splits=seq, head_splits=heads))
    with pytest.raises(RuntimeError, match="out= is not differentiable"):
        g.all_to_all_4d(x, mode=0, seq_splits=seq, head_splits=heads, out=torch.empty_like(y))
    # the op's .out overload, through the dispatcher as torch.ops reaches it (NOTE [ulysses op in
    # c++]); refused under grad mode there too
    op, z = torch.ops.fastcomms.ulysses_all_to_all_4d, torch.empty_like(y)
    op.out(x.detach(), g._id, 0, seq, heads, 1, out=z)
    assert torch.equal(z, y.detach())
    with pytest.raises(RuntimeError, match="out= is not differentiable"):
        op.out(x, g._id, 0, seq, heads, 1, out=z)


def validation(comm, rank, size):
    g = UlyssesGroup(comm)
    x = torch.zeros(1, 4, 3 * size + 1, 8)
    with pytest.raises(ValueError, match=r"\[rank \d/\d t\] all_to_all_4d: mode 0 scatters heads"):
        g.all_to_all_4d(x)
    with pytest.raises(ValueError, match="seq_splits and head_splits must be given together"):
        g.all_to_all_4d(x, seq_splits=[4] * size)
    with pytest.raises(ValueError, match=r"head_splits sums to \d+, x.size\(2\) is \d+"):
        g.all_to_all_4d(x, seq_splits=[4] * size, head_splits=[1] * size)
    # ranks that disagree on the call raise on every rank
    heads = [2] * size if rank else [3] + [2] * (size - 2) + [1]
    y = torch.zeros(1, 4, 2 * size, 8)
    with pytest.raises(ValueError, match="ranks disagree on the call"):
        g.all_to_all_4d(y, seq_splits=[4] * size, head_splits=heads)
    dist.barrier()


@pytest.mark.parametrize("size", [2, 3])
def test_bit_exact_against_torch_distributed(world, size):
    world(bit_exact, size)


@pytest.mark.parametrize("size", [2, 3])
def test_autograd(world, size):
    world(autograd, size)


def test_validation(world):
    world(validation, 3)


def functional_and_compile(comm, rank, size):
    from fastcomms import ulysses
    from torch._subclasses.fake_tensor import FakeTensorMode

    seq, heads = [3, 1, 2][:size], [2, 1, 3][:size]
    x = torch.randn(2, seq[rank], sum(heads), 4)

    # torch.compile(fullgraph=True) first, before any eager call on this communicator: no warm-up,
    # no graph break, the same result, gradients flow; inductor, then the same function again
    def f(t):
        y = ulysses.all_to_all_4d(t * 2, comm, mode=0, seq_splits=seq, head_splits=heads)
        return ulysses.all_to_all_4d(y + 1, comm, mode=1, seq_splits=seq, head_splits=heads)

    import torch._dynamo.utils as dynamo_utils

    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    frames = None
    for _ in range(10):  # cold compile on the first call, then no recompilation
        xr = x.clone().requires_grad_(True)
        out = compiled(xr)
        assert torch.equal(out, x * 2 + 1)
        out.sum().backward()
        assert torch.equal(xr.grad, torch.full_like(x, 2.0))
        if frames is None:
            frames = dynamo_utils.counters["frames"]["ok"]
    assert dynamo_utils.counters["frames"]["ok"] == frames, dynamo_utils.counters["frames"]

    g = UlyssesGroup(comm)
    want = g.all_to_all_4d(x, mode=0, seq_splits=seq, head_splits=heads)
    got = ulysses.all_to_all_4d(x, comm, mode=0, seq_splits=seq, head_splits=heads)
    assert torch.equal(got, want)
    # the group's own method compiles too (as the same custom op)
    gm = torch.compile(
        lambda t: g.all_to_all_4d(t, mode=0, seq_splits=seq, head_splits=heads),
        fullgraph=True,
        backend="aot_eager",
    )
    assert torch.equal(gm(x), want)
    # NOTE [eager-only members]: in a compiled function (no fullgraph) the members that cannot be
    # traced run eagerly with the real group, in the same order on every rank: the async form,
    # out= (an empty_output buffer), memory_stats, the transport read as a constant
    sp = {"mode": 0, "seq_splits": seq, "head_splits": heads}

    def members(t):
        a = g.all_to_all_4d_async(t, **sp).wait()
        buf = g.empty_output(t, **sp)
        b = g.all_to_all_4d(t, out=buf, **sp)
        stats = g.memory_stats()
        return a + b + (1 if g.transport == "collective" else 0), b is buf, stats

    y, same, stats = torch.compile(members, backend="aot_eager")(x)
    assert torch.equal(y, want * 2 + 1) and same and stats == g.memory_stats(), stats
    # under fullgraph=True no graph may break: an eager-only member is refused, named
    out = g.empty_output(x, **sp)
    for member in (lambda t: g.memory_stats(), lambda t: g.all_to_all_4d(t, out=out, **sp)):
        with pytest.raises(torch._dynamo.exc.Unsupported, match="_eager_only_member"):
            torch.compile(member, fullgraph=True, backend="eager")(x)
    # FakeTensor: shapes without communication
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(x)
        fy = ulysses.all_to_all_4d(fx, comm, mode=0, seq_splits=seq, head_splits=heads)
        assert tuple(fy.shape) == (2, sum(seq), heads[rank], 4)
    with pytest.raises(RuntimeError, match="torch.vmap"):  # the functional op refuses it too
        torch.vmap(lambda t: ulysses.all_to_all_4d(t, comm, seq_splits=seq, head_splits=heads))(
            x[None]
        )
    # NOTE [host cost per call]: plain eager runs the method directly (same result, same
    # gradient), while a dispatch-mode tracer (make_fx) still records the custom op
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = make_fx(
        lambda t: ulysses.all_to_all_4d(t, comm, mode=0, seq_splits=seq, head_splits=heads),
        tracing_mode="fake",
    )(x)
    assert "fastcomms.ulysses_all_to_all_4d" in traced.code, traced.code
    xr = x.clone().requires_grad_(True)
    y = ulysses.all_to_all_4d(xr * 3, comm, mode=0, seq_splits=seq, head_splits=heads)
    assert torch.equal(y, want * 3)
    y.sum().backward()
    assert torch.equal(xr.grad, torch.full_like(x, 3.0))


def test_functional_fake_and_compile(world):
    world(functional_and_compile, 3)


def async_and_transport(comm, rank, size):
    seq, heads = [3, 1, 2][:size], [2, 1, 3][:size]
    g = UlyssesGroup(comm)  # CPU tensors: the collective path, chosen without a handshake
    assert g.transport == "collective" and "not a CUDA device" in g.transport_reason
    pg = UlyssesGroup(None)  # torch.distributed's gloo group
    for mode in (0, 1):
        shape = (2, seq[rank], sum(heads), 5) if mode == 0 else (2, sum(seq), heads[rank], 5)
        x = torch.randn(shape)
        want = pg.all_to_all_4d(x, mode=mode, seq_splits=seq, head_splits=heads)
        w = g.all_to_all_4d_async(x, mode=mode, seq_splits=seq, head_splits=heads)
        assert isinstance(w, AsyncCollectiveTensor)
        assert torch.equal(w.wait(), want)
        w = g.all_to_all_4d_async(x, mode=mode, seq_splits=seq, head_splits=heads)
        assert torch.equal(w + 0, want)  # the first use by an aten op waits
        out = g.empty_output(x, mode=mode, seq_splits=seq, head_splits=heads)
        out.fill_(float("nan"))
        w = g.all_to_all_4d_async(x, mode=mode, seq_splits=seq, head_splits=heads, out=out)
        assert w.wait() is out and torch.equal(out, want)
        w = pg.all_to_all_4d_async(x, mode=mode, seq_splits=seq, head_splits=heads)
        assert torch.equal(w.wait(), want)
    x = torch.randn(2, seq[rank], sum(heads), 5)
    with pytest.raises(ValueError, match="lend=True needs the NVLink transport"):
        g.all_to_all_4d_async(x, seq_splits=seq, head_splits=heads, lend=True)
    # NOTE [async ulysses checks]: the async form's refusals, one place (C++)
    with pytest.raises(ValueError, match="lend=True returns a buffer of the group's ring"):
        g.all_to_all_4d_async(x, seq_splits=seq, head_splits=heads, lend=True, out=x)
    with pytest.raises(ValueError, match=r"\] all_to_all_4d_async: x is a meta tensor"):
        g.all_to_all_4d_async(x.to("meta"), seq_splits=seq, head_splits=heads)
    with pytest.raises(ValueError, match=r"\] all_to_all_4d_async: x must be a 4-D tensor"):
        g.all_to_all_4d_async(x[0], seq_splits=seq, head_splits=heads)
    # vmap (and batched gradients) would issue one collective per row: refused, never hung
    with pytest.raises(RuntimeError, match="torch.vmap"):
        torch.vmap(lambda t: g.all_to_all_4d(t, seq_splits=seq, head_splits=heads))(x[None])
    with pytest.raises(RuntimeError, match="all_to_all_4d_async: torch.vmap"):
        torch.vmap(lambda t: g.all_to_all_4d_async(t, seq_splits=seq, head_splits=heads).wait())(
            x[None]
        )
    xg = x.clone().requires_grad_()
    y = g.all_to_all_4d(xg, seq_splits=seq, head_splits=heads)
    with pytest.raises(RuntimeError, match="torch.vmap"):
        torch.autograd.grad(y, xg, torch.ones((2, *y.shape)), is_grads_batched=True)
    with pytest.raises(RuntimeError, match="async form is not differentiable"):
        g.all_to_all_4d_async(x.requires_grad_(), seq_splits=seq, head_splits=heads)
    with pytest.raises(RuntimeError, match="NVLink transport is not available: the group's device"):
        UlyssesGroup(comm, transport="nvlink")
    with pytest.raises(RuntimeError, match="NVLink transport is not available"):
        UlyssesGroup(comm, require_nvlink=True)
    with pytest.raises(ValueError, match="contradicts"):
        UlyssesGroup(comm, require_nvlink=True, transport="collective")
    with pytest.raises(
        ValueError, match="transport must be auto, nvlink, hierarchical or collective"
    ):
        UlyssesGroup(comm, transport="p2p")
    stats = g.memory_stats()
    assert stats["device_bytes"] == 0 and stats["lend_ring_bytes"] == 0, stats
    # NOTE [async ulysses in c++]: the ring's size and the side stream are the C++ object's (no
    # side stream for CPU calls)
    assert g.LEND_RING == 4 and g._astream is None
    g.destroy()
    with pytest.raises(ValueError, match="the group was destroyed"):
        g.all_to_all_4d_async(x, seq_splits=seq, head_splits=heads)


def test_async_and_transport_selection(world):
    world(async_and_transport, 3)


def dropped_async_results(comm, rank, size):
    """NOTE [dropped async results]: torch's work registry keeps what it is given until a wait on
    the result, so an async result dropped unwaited used to keep its output, input and staging
    alive for the rest of the process (50 dropped calls: 50 outputs alive). Now a finished
    exchange is completed by the next call and lets go of them; a result that is kept still reads
    right, waited before or after that."""
    import gc
    import weakref

    g = UlyssesGroup(comm)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(1, 64, 4 * size, 32, generator=gen)
    want = g.all_to_all_4d(x)
    alive = []
    for i in range(50):
        r = g.all_to_all_4d_async(x.clone())
        alive.append(weakref.ref(r.elem if isinstance(r, AsyncCollectiveTensor) else r.wait()))
        if i == 25:
            kept = r  # one result kept across later calls, waited at the end
        del r
    late = g.all_to_all_4d_async(x)
    assert torch.equal(late.wait(), want)
    g.all_to_all_4d(x)  # a later call completes what finished
    gc.collect()
    n = sum(w() is not None for w in alive)
    assert n <= 2, f"rank {rank}: {n} of 50 dropped async results are still alive"
    assert torch.equal(kept.wait(), want)
    assert torch.equal(kept + 0, want)
    # a group is a handle: a copy, or a deep copy of a model holding it, is the same group (a
    # deep copy used to fail: the transport cannot be pickled), and the copy runs the exchange
    model = torch.nn.Module()
    model.sp = g
    assert copy.copy(g) is g and copy.deepcopy(model).sp is g
    assert torch.equal(copy.deepcopy(model).sp.all_to_all_4d(x), want)
    with g:  # leaving a with block destroys the group
        pass
    assert g.transport == "destroyed"


def test_dropped_async_results_are_released(world):
    world(dropped_async_results, 2)
