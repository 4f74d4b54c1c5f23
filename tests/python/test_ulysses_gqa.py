# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Grouped-query / multi-query Ulysses (kv_replicas) on CPU over gloo, worlds of 2, 3 and 4
processes: mode 0 bit-exact against ``repeat_interleave`` + the ordinary call (ours and torch's
permute path), mode 1 bit-exact against the ordinary call + the replica sum, the gradient
bit-exact against autograd through ``repeat_interleave``, gradcheck, out= with poisoned
buffers, async, compile, and the errors. Random geometries and data every run (the seed is
printed on failure)."""

import os
import random

import pytest
import torch
import torch.distributed as dist
from fastcomms import ulysses
from fastcomms.ulysses import UlyssesGroup

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.uint8]


def _seed():
    """One seed for every rank of a run (rank 0's, broadcast)."""
    s = torch.tensor([int.from_bytes(os.urandom(4), "little")], dtype=torch.int64)
    dist.broadcast(s, 0)
    return int(s.item())


def _geometries(size, count, seed):
    """(mode, kv, seq, heads, b, d, dtype, pass_splits): heads are virtual; half the cases are
    GQA/MQA proper (h KV heads with h | size, one virtual head per rank), half any kv with
    uneven virtual splits whose ranks get distinct source heads."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        mode = rng.randint(0, 1)
        b, d = rng.randint(1, 3), rng.randint(1, 6)
        dtype = rng.choice(DTYPES)
        if rng.random() < 0.5:
            h = rng.choice([h for h in range(1, size + 1) if size % h == 0])
            kv, heads = size // h, [1] * size
            even = rng.random() < 0.5
            seq = [rng.randint(1, 4)] * size if even else [rng.randint(0, 4) for _ in range(size)]
            seq[rng.randrange(size)] += 0 if even else 1
            out.append((mode, kv, seq, heads, b, d, dtype, not even))
            continue
        kv = rng.randint(2, 4)
        heads = [rng.randint(0, 2) for _ in range(size)]
        heads[-1] += (kv - sum(heads) % kv) % kv or (kv if sum(heads) == 0 else 0)
        off, ok = 0, True
        for v in heads:
            ok &= v == 0 or (off + v - 1) // kv - off // kv == v - 1
            off += v
        if not ok:
            continue
        seq = [rng.randint(0, 4) for _ in range(size)]
        seq[rng.randrange(size)] += 1
        out.append((mode, kv, seq, heads, b, d, dtype, True))
    return out


def _data(shape, dtype, gen):
    return torch.randint(0, 100, shape, generator=gen).to(dtype)


def bit_exact(comm, rank, size):
    seed = _seed()
    ours, ref = UlyssesGroup(comm), UlyssesGroup(None)  # ref: torch's gloo, permute path
    checked = 0
    for i, (mode, kv, seq, heads, b, d, dtype, splits) in enumerate(_geometries(size, 24, seed)):
        kw = {"seq_splits": seq, "head_splits": heads} if splits else {}
        where = (seed, i, mode, kv, seq, heads, b, d, dtype)
        gen = torch.Generator().manual_seed(seed * 31 + 7 * i + rank)
        if mode == 0:
            x = _data((b, seq[rank], sum(heads) // kv, d), dtype, gen)
            rep = x.repeat_interleave(kv, dim=2)
            want = ours.all_to_all_4d(rep, mode=0, **kw)
            assert torch.equal(want, ref.all_to_all_4d(rep, mode=0, **kw)), where
        else:  # this rank's virtual heads' gradients
            x = _data((b, sum(seq), heads[rank], d), dtype, gen)
            full = ours.all_to_all_4d(x, mode=1, **kw)
            want = full.unflatten(2, (full.shape[2] // kv, kv)).sum(3, dtype=dtype)
        got = ours.all_to_all_4d(x, mode=mode, kv_replicas=kv, **kw)
        assert got.dtype == want.dtype and torch.equal(got, want), where
        # torch's process group path (gather then permute) gives the same bytes
        assert torch.equal(ref.all_to_all_4d(x, mode=mode, kv_replicas=kv, **kw), want), where
        out = ours.empty_output(x, mode=mode, kv_replicas=kv, **kw)
        assert tuple(out.shape) == tuple(want.shape)
        out.view(torch.uint8).fill_(0xA5)  # poison: an unwritten byte shows
        ours.all_to_all_4d(x, mode=mode, kv_replicas=kv, out=out, **kw)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), where
        w = ours.all_to_all_4d_async(x, mode=mode, kv_replicas=kv, **kw)
        assert torch.equal(w.wait(), want), where
        checked += 1
    assert checked == 24


def gradients(comm, rank, size):
    """The gradient through kv_replicas equals autograd through repeat_interleave + the ordinary
    call, bit for bit (float32 and float64), for the GQA split with one virtual head per rank."""
    g = UlyssesGroup(comm)
    seed = _seed()
    gen = torch.Generator().manual_seed(seed + rank)
    for h in [h for h in range(1, size + 1) if size % h == 0]:
        kv = size // h
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(2, 3, h, 4, dtype=dtype, generator=gen, requires_grad=True)
            y = g.all_to_all_4d(x, mode=0, kv_replicas=kv)
            gy = torch.randn(y.shape, dtype=dtype, generator=gen)
            (gx,) = torch.autograd.grad(y, x, gy)
            xr = x.detach().clone().requires_grad_()
            yr = g.all_to_all_4d(xr.repeat_interleave(kv, dim=2), mode=0)
            (gxr,) = torch.autograd.grad(yr, xr, gy)
            assert torch.equal(y, yr) and torch.equal(gx, gxr), (seed, h, dtype)
            # and mode 1's backward is mode 0 with the same replicas
            z = torch.randn(2, 3 * size, 1, 4, dtype=dtype, generator=gen, requires_grad=True)
            u = g.all_to_all_4d(z, mode=1, kv_replicas=kv)
            assert tuple(u.shape) == (2, 3, h, 4)
            gu = torch.randn(u.shape, dtype=dtype, generator=gen)
            (gz,) = torch.autograd.grad(u, z, gu)
            assert torch.equal(gz, g.all_to_all_4d(gu, mode=0, kv_replicas=kv)), (seed, h)


def gradcheck(comm, rank, size):
    """torch.autograd.gradcheck in float64 with one rank's input varying at a time: the others
    run the same calls on a constant input whose output they zero, so the active rank's
    numerical and analytical Jacobians both see only its own block (every rank takes a turn)."""
    g = UlyssesGroup(comm)
    h = 1  # multi-query: one KV head for every rank
    kv = size
    for active in range(size):
        for mode in (0, 1):
            shape = (1, 2, h, 2) if mode == 0 else (1, 2 * size, 1, 2)
            x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
            const = torch.randn(shape, dtype=torch.float64)

            def f(t, m=mode, active=active, const=const):
                if rank == active:
                    return g.all_to_all_4d(t, mode=m, kv_replicas=kv)
                return g.all_to_all_4d(const + 0 * t, mode=m, kv_replicas=kv) * 0

            assert torch.autograd.gradcheck(f, (x,), check_undefined_grad=False)


def errors_and_compile(comm, rank, size):
    g = UlyssesGroup(comm)
    x = torch.randn(1, 2, 1, 4)
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=r"\[rank \d/\d\] all_to_all_4d: kv_replicas must be"):
            g.all_to_all_4d(x, kv_replicas=bad)
    # two copies of one head on a rank: refused, with the replica count that fits
    with pytest.raises(ValueError, match=r"repeat source head 0.*kv_replicas = 3 / 1"):
        g.all_to_all_4d(x, kv_replicas=2 * size)
    y = torch.randn(1, 2 * size, 1, 4)
    with pytest.raises(ValueError, match="out is"):  # mode 1's result has h heads, not h * kv
        g.all_to_all_4d(y, mode=1, kv_replicas=size, out=torch.empty(1, 2, size, 4))
    with pytest.raises(ValueError, match="lend=True with mode 1 and kv_replicas"):
        g.all_to_all_4d_async(y, mode=1, kv_replicas=size, lend=True)
    # meta tensors and FakeTensor: shapes only
    m = g.all_to_all_4d(torch.empty(1, 2, 1, 4, device="meta"), kv_replicas=size)
    assert m.device.type == "meta" and tuple(m.shape) == (1, 2 * size, 1, 4)
    m = g.all_to_all_4d(torch.empty(1, 2 * size, 1, 4, device="meta"), mode=1, kv_replicas=size)
    assert tuple(m.shape) == (1, 2, 1, 4)

    # torch.compile(fullgraph=True), forward and backward, through the functional op and the
    # group's method
    def attn_kv(k):
        kk = ulysses.all_to_all_4d(k * 2, comm, mode=0, kv_replicas=size)
        return ulysses.all_to_all_4d(kk, comm, mode=1, kv_replicas=size)

    k = torch.randn(2, 3, 1, 4)
    compiled = torch.compile(attn_kv, fullgraph=True, backend="inductor")
    for _ in range(3):
        kr = k.clone().requires_grad_()
        out = compiled(kr)
        assert torch.equal(out, k * 2 * size)  # every replica comes back and is summed
        out.sum().backward()
        assert torch.equal(kr.grad, torch.full_like(k, 2.0 * size))
    gm = torch.compile(lambda t: g.all_to_all_4d(t, kv_replicas=size), fullgraph=True)
    assert torch.equal(gm(k), g.all_to_all_4d(k.repeat_interleave(size, dim=2)))
    dist.barrier()


@pytest.mark.parametrize("size", [2, 3, 4])
def test_gqa_bit_exact(world, size):
    world(bit_exact, size)


@pytest.mark.parametrize("size", [2, 4])
def test_gqa_gradients_match_repeat_interleave(world, size):
    world(gradients, size)


@pytest.mark.parametrize("size", [2, 3])
def test_gqa_gradcheck(world, size):
    world(gradcheck, size)


def test_gqa_errors_meta_and_compile(world):
    world(errors_and_compile, 3)
