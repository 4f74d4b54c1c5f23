# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""FP8 on the wire (NOTE [fp8 wire exchange]) on CPU over gloo, worlds of 2 and 3 processes: the
result bit-exact against the torch reference of the same quantization applied to torch's own
exchange (permute + all_to_all_single + permute on the ProcessGroup) — an all-to-all only moves
rows, so quantizing before or after it gives the same bytes — for both modes, uneven splits,
kv_replicas in both modes, three input dtypes, both formats, out=, return_scales, async, the
functional form and the gradient (straight through, and FP8 with grad_wire_dtype); the edge
rows (zeros, NaN, Inf) travel too; torch.compile; the errors. A control perturbs one received
scale and must be caught. Random geometries and data every run (the seed is printed on failure)."""

import os
import random

import fp8_reference as _fp8
import pytest
import torch
import torch.distributed as dist
from fastcomms import ulysses
from fastcomms.ulysses import UlyssesGroup

WIRES = [torch.float8_e4m3fn, torch.float8_e5m2]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _seed():
    s = torch.tensor([int.from_bytes(os.urandom(4), "little")], dtype=torch.int64)
    dist.broadcast(s, 0)
    return int(s.item())


def _same(a, b):
    a, b = a.contiguous(), b.contiguous()
    same = a.shape == b.shape and a.dtype == b.dtype
    return same and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _ref(pg, x, wire, mode, seq, heads, kv=1):
    """The reference: torch's exchange of x's rows (kv: the virtual heads as repeat_interleave
    makes them), then the torch quantization round trip row by row; mode 1 with kv sums the
    replicas after it."""
    if mode == 0 and kv > 1:
        x = x.repeat_interleave(kv, dim=2)
    moved = pg.all_to_all_4d(x, mode=mode, seq_splits=seq, head_splits=heads)
    q, s = _fp8.quantize_reference(moved, wire)
    y = _fp8.dequantize_reference(q, s, x.dtype)
    if mode == 1 and kv > 1:
        y = y.unflatten(2, (y.shape[2] // kv, kv)).sum(3)
    return y, q, s


def fp8_wire(comm, rank, size):
    seed = _seed()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    g, pg = UlyssesGroup(comm), UlyssesGroup(None)
    try:
        for case in range(8):
            mode, wire, dtype = rng.randint(0, 1), rng.choice(WIRES), rng.choice(DTYPES)
            b, d = rng.randint(1, 2), rng.choice([1, 5, 16, 32])
            seq = [rng.randint(0, 3) for _ in range(size)]
            seq[rng.randrange(size)] += 1
            heads = [rng.randint(1, 2) for _ in range(size)]
            what = f"seed {seed} case {case} mode {mode} {wire} {dtype} seq {seq} heads {heads}"
            shape = (b, seq[rank], sum(heads), d) if mode == 0 else (b, sum(seq), heads[rank], d)
            x = (torch.randn(shape, generator=gen) * 10 ** rng.uniform(-3, 3)).to(dtype)
            if x.numel() and case % 4 == 0:  # edge rows travel: a NaN, an Inf, a zero row
                x.view(-1, d)[0, 0] = float("nan")
                x.view(-1, d)[-1, :] = 0
                x.view(-1, d)[x.numel() // d // 2, -1] = float("inf")
            want, wq, ws = _ref(pg, x, wire, mode, seq, heads)
            sp = dict(mode=mode, seq_splits=seq, head_splits=heads, wire_dtype=wire)
            got = g.all_to_all_4d(x, **sp)
            assert _same(got, want), what
            assert _same(pg.all_to_all_4d(x, **sp), want), f"process group: {what}"
            q, s = g.all_to_all_4d(x, return_scales=True, **sp)
            assert _same(q, wq) and _same(s, ws), f"return_scales: {what}"
            # control: one perturbed scale (of a row with a finite nonzero value) must be caught
            qf = q.float().reshape(s.numel(), d)
            rows = (s.reshape(-1).isfinite() & (qf.isfinite() & (qf != 0)).any(-1)).nonzero()
            if len(rows):
                bad = s.clone()
                bad.view(-1)[int(rows[0])] *= 2
                assert not _same(_fp8.dequantize_reference(q, bad, dtype), want), f"control {what}"
            out = torch.full(want.shape, float("nan"), dtype=dtype)
            assert g.all_to_all_4d(x, out=out, **sp) is out and _same(out, want), f"out= {what}"
            w = g.all_to_all_4d_async(x, **sp)
            assert _same(w.wait(), want), f"async {what}"
            f = ulysses.all_to_all_4d(x, comm, **sp)
            assert _same(f, want), f"functional {what}"
        # kv replicas, both modes (h KV heads, one virtual head per rank)
        for mode in (0, 1):
            wire, seq = rng.choice(WIRES), [rng.randint(1, 3) for _ in range(size)]
            kv, heads = size, [1] * size
            shape = (1, seq[rank], 1, 16) if mode == 0 else (1, sum(seq), 1, 16)
            x = torch.randn(shape, generator=gen, dtype=torch.bfloat16)
            want = _ref(pg, x, wire, mode, seq, heads, kv)[0]
            got = g.all_to_all_4d(
                x, mode=mode, seq_splits=seq, head_splits=heads, kv_replicas=kv, wire_dtype=wire
            )
            assert _same(got, want), f"seed {seed} kv {kv} mode {mode}"
        # the gradient: straight through in the gradient's dtype, or FP8 with grad_wire_dtype
        seq, heads = [2] * size, [1] * size
        x = torch.randn(1, 2, size, 8, generator=gen, requires_grad=True)
        y = g.all_to_all_4d(x, wire_dtype=torch.float8_e4m3fn)
        gy = torch.randn(y.shape, generator=gen)
        (gx,) = torch.autograd.grad(y, x, gy)
        assert _same(gx, pg.all_to_all_4d(gy, mode=1)), f"seed {seed} backward"
        y = g.all_to_all_4d(x, wire_dtype=torch.float8_e4m3fn, grad_wire_dtype=torch.float8_e5m2)
        (gx,) = torch.autograd.grad(y, x, gy)
        assert _same(gx, _ref(pg, gy, torch.float8_e5m2, 1, None, None)[0]), "fp8 backward"
        # torch.compile(fullgraph=True): the method and the functional form trace as one op (NOTE
        # [fp8 wire exchange]); forward and backward (FP8 gradient) as eager, return_scales too
        method = torch.compile(
            lambda t: g.all_to_all_4d(
                t, wire_dtype=torch.float8_e4m3fn, grad_wire_dtype=torch.float8_e5m2
            ),
            fullgraph=True,
        )
        y = method(x)
        assert _same(y, g.all_to_all_4d(x.detach(), wire_dtype=torch.float8_e4m3fn)), "compiled"
        (gx,) = torch.autograd.grad(y, x, gy)
        assert _same(gx, _ref(pg, gy, torch.float8_e5m2, 1, None, None)[0]), "compiled backward"
        functional = torch.compile(
            lambda t: ulysses.all_to_all_4d(
                t, comm, wire_dtype=torch.float8_e5m2, return_scales=True
            ),
            fullgraph=True,
        )
        q, s = functional(x.detach())
        _, wq, ws = _ref(pg, x.detach(), torch.float8_e5m2, 0, None, None)
        assert _same(q, wq) and _same(s, ws), "compiled return_scales"
        # errors
        xi = torch.ones(1, 2, size, 8, dtype=torch.int32)
        with pytest.raises(TypeError, match="must be float16, bfloat16 or float32, got int32"):
            g.all_to_all_4d(xi, wire_dtype=torch.float8_e4m3fn)
        with pytest.raises(TypeError, match="wire_dtype must be torch.float8_e4m3fn"):
            g.all_to_all_4d(x.detach(), wire_dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="need wire_dtype"):
            g.all_to_all_4d(x.detach(), return_scales=True)
        with pytest.raises(RuntimeError, match="not differentiable"):
            g.all_to_all_4d(x, wire_dtype=torch.float8_e4m3fn, return_scales=True)
        with pytest.raises(TypeError, match="grad_wire_dtype must be torch.float8_e4m3fn"):
            g.all_to_all_4d(x.detach(), wire_dtype=torch.float8_e4m3fn, grad_wire_dtype=x.dtype)
        with pytest.raises(ValueError, match="it takes no out="):
            g.all_to_all_4d(
                x.detach(), wire_dtype=torch.float8_e5m2, return_scales=True, out=torch.empty(0)
            )
        with pytest.raises(ValueError, match=r"out is \[1, 2, 5\] float32, expected a contiguous"):
            g.all_to_all_4d(x.detach(), wire_dtype=torch.float8_e5m2, out=torch.empty(1, 2, 5))
        # meta tensors: the op's Meta kernel (the plan's shapes), the FP8 rows and scales too
        m = x.detach().to("meta")
        assert g.all_to_all_4d(m, wire_dtype=torch.float8_e4m3fn).shape == y.shape
        q, s = g.all_to_all_4d(m, wire_dtype=torch.float8_e4m3fn, return_scales=True)
        assert q.dtype == torch.float8_e4m3fn and q.shape == y.shape and s.shape == y.shape[:-1]
    finally:
        g.destroy()
        pg.destroy()


@pytest.mark.parametrize("size", [2, 3])
def test_fp8_wire(world, size):
    world(fp8_wire, size)
