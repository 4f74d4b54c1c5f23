# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Attention with 2-D sequence parallelism (USP: Ulysses inside, a ring across), forward and
backward, checked against single-process attention.

Each rank holds a piece of the sequence of q, k, v, shaped (batch, tokens, heads, head dim).
The Ulysses all-to-all gives every rank of a Ulysses group the tokens of its whole ring shard on
heads / ulysses_size heads; ring attention then passes K/V blocks around the ring (one
``RingGroup.exchange`` a step, the next block in flight while this one is computed), merging the
blocks' outputs by their log-sum-exp; the inverse all-to-all brings the heads back. Causal
attention uses the zig-zag layout (ring.zigzag_shard), so every ring step's block is either the
diagonal or exactly half a block and every rank does the same work.

The backward is ring attention's own (a custom autograd Function): each block's gradients come
from the block kernel's backward given the merged output and log-sum-exp (the same identity
flash attention's backward uses), the K/V blocks go around the ring again and their gradient
accumulators travel with them on a second ring, arriving back at their owner after a full turn.
The all-to-alls are differentiable on their own.

Blocks run on PyTorch's fused attention kernels with log-sum-exp (flash on CPU, flash on CUDA for
float16/bfloat16); ``--impl math`` computes them in plain torch ops instead.

  torchrun --nproc-per-node 4 examples/usp_attention.py --ring 2 --ulysses 2    # CPU, gloo
  torchrun --nproc-per-node 8 examples/usp_attention.py --ring 2 --ulysses 4    # GPUs, NCCL

Each case (non-causal and causal, multi-head and grouped-query) compares this rank's output and
its q/k/v gradients with the same slice of a single-process ``scaled_dot_product_attention`` on
the whole sequence; rank 0 prints the largest differences and the run exits non-zero on a miss.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F


# -- one block: output and log-sum-exp, and the backward given the merged output ------------------
def _acc_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def _expand(t, g):
    """(b, h_kv, s, d) -> (b, h_kv * g, s, d): each K/V head serves g query heads."""
    return t if g == 1 else t.repeat_interleave(g, dim=1)


def _fold(t, g):
    """The gradient of _expand: the g copies' gradients summed into their head."""
    return t if g == 1 else t.unflatten(1, (t.shape[1] // g, g)).sum(2)


def _pick(impl, q):
    if impl != "auto":
        return impl
    if q.is_cuda:
        return "flash" if q.dtype in (torch.float16, torch.bfloat16) else "math"
    return "cpu_flash"


def _scores(q, k, causal, scale):
    s = torch.matmul(q.to(_acc_dtype(q.dtype)), k.to(_acc_dtype(q.dtype)).transpose(-1, -2))
    s = s * scale
    if causal:  # square diagonal blocks only (top-left aligned)
        s = s.masked_fill(
            torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf")
        )
    return s


def block_forward(q, k, v, causal, scale, impl):
    """(out, lse) of attention of q (b, h, sq, d) on k, v (b, h_kv, sk, d)."""
    g = q.shape[1] // k.shape[1]
    k, v = _expand(k, g), _expand(v, g)
    impl = _pick(impl, q)
    if impl == "cpu_flash":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale
        )
        return o, lse
    if impl == "flash":  # CUDA, float16/bfloat16
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, causal, False, scale=scale
        )[:2]
        return o, lse
    s = _scores(q, k, causal, scale)
    lse = s.logsumexp(-1)
    return torch.matmul(torch.exp(s - lse.unsqueeze(-1)).to(v.dtype), v), lse


def block_backward(do, q, k, v, o, lse, causal, scale, impl):
    """(dq, dk, dv) of one block, where o and lse are the merged output and log-sum-exp of q's
    rows over every block: the probabilities exp(s - lse) are then the whole attention's, and
    rowsum(do * o) is its softmax-backward term, so the block's gradients are exact."""
    g = q.shape[1] // k.shape[1]
    ke, ve = _expand(k, g), _expand(v, g)
    impl = _pick(impl, q)
    if impl == "cpu_flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, ke, ve, o, lse, 0.0, causal, scale=scale
        )
    elif impl == "flash":
        # dense (not variable-length) blocks: no cumulative sequence lengths; no dropout: no
        # random state (what the forward itself returns there)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            do,
            q,
            ke,
            ve,
            o,
            lse,
            None,
            None,
            q.shape[2],
            ke.shape[2],
            0.0,
            causal,
            unused,
            unused,
            scale=scale,
        )
    else:
        acc = _acc_dtype(q.dtype)
        p = torch.exp(_scores(q, ke, causal, scale) - lse.to(acc).unsqueeze(-1))
        do_a = do.to(acc)
        dv = torch.matmul(p.transpose(-1, -2), do_a)
        dp = torch.matmul(do_a, ve.to(acc).transpose(-1, -2))
        ds = p * (dp - (do_a * o.to(acc)).sum(-1, keepdim=True))
        dq = torch.matmul(ds, ke.to(acc)) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.to(acc)) * scale
    return dq, _fold(dk, g), _fold(dv, g)


# -- ring attention -------------------------------------------------------------------------------
def _block_plan(step, r, P, s, causal):
    """Which rows of q and columns of K/V the block of ring step ``step`` covers, and whether it
    is the causal diagonal. Zig-zag: rank r holds chunks r and 2P-1-r; the K/V of rank j < r see
    every query row with their first chunk only; those of j > r are seen, whole, by the second
    half of the query rows only."""
    every, half = slice(0, s), s // 2
    if not causal:
        return every, every, False
    j = (r - step) % P
    if step == 0:
        return every, every, True
    if j < r:
        return every, slice(0, half), False
    return slice(half, s), every, False


def _merge(out, lse, o_b, lse_b):
    """out, lse (views, updated in place) <- the log-sum-exp merge with one block's o_b, lse_b."""
    new = torch.logaddexp(lse, lse_b.to(lse.dtype))
    out.mul_(torch.exp(lse - new).unsqueeze(-1))
    out.add_(o_b.to(out.dtype) * torch.exp(lse_b.to(lse.dtype) - new).unsqueeze(-1))
    lse.copy_(new)


class RingAttention(torch.autograd.Function):
    """q (b, h, s, d), k, v (b, h_kv, s, d): this ring rank's tokens (its ring shard, zig-zag
    when causal) on this rank's heads; returns (b, h, s, d)."""

    @staticmethod
    def forward(ctx, q, k, v, sp, causal, scale, impl):
        ring = sp.ring
        P, r, s = ring.size, ring.rank, q.shape[2]
        acc = _acc_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
        kv = (k, v)
        for step in range(P):
            work = ring.exchange(kv) if step + 1 < P else None  # the next block, in flight
            rows, cols, diag = _block_plan(step, r, P, s, causal)
            o_b, lse_b = block_forward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], diag, scale, impl
            )
            _merge(out[:, :, rows], lse[:, :, rows], o_b, lse_b)
            if work is not None:
                kv = work.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.sp, ctx.causal, ctx.scale, ctx.impl = sp, causal, scale, impl
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        sp, causal, scale, impl = ctx.sp, ctx.causal, ctx.scale, ctx.impl
        ring, grads = sp.ring, sp.ring_grad
        P, r, s = ring.size, ring.rank, q.shape[2]
        acc = _acc_dtype(q.dtype)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv, travelling = (k, v), None
        for step in range(P):
            work = ring.exchange(kv) if step + 1 < P else None
            rows, cols, diag = _block_plan(step, r, P, s, causal)
            dq_b, dk_b, dv_b = block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                diag,
                scale,
                impl,
            )
            dq[:, :, rows] += dq_b
            # the gradient accumulators of the K/V block held now: zeros at the first step (this
            # rank's own block), else what arrived with the block from rank - 1
            if travelling is None:
                dkv = [
                    torch.zeros(k.shape, dtype=acc, device=k.device),
                    torch.zeros_like(v, dtype=acc),
                ]
            else:
                dkv = list(travelling.wait())
            dkv[0][:, :, cols] += dk_b
            dkv[1][:, :, cols] += dv_b
            travelling = grads.exchange(dkv)  # on to rank + 1, with the K/V block
            if work is not None:
                kv = work.wait()
        dk, dv = travelling.wait()  # a full turn: this rank's own block's gradients
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def usp_attention(q, k, v, sp, *, causal=False, scale=None, impl="auto"):
    """Attention over the whole sequence with a SequenceParallelGroup ``sp``: q (b, s_local, h,
    d), k and v (b, s_local, h_kv, d), this rank's tokens as ``sp.shard(x, zigzag=causal)`` gives
    them; returns this rank's (b, s_local, h, d). Differentiable."""
    kv_replicas = sp.check_heads(q.shape[2], k.shape[2])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    a2a = sp.ulysses.all_to_all_4d
    q = a2a(q, mode=0)  # (b, s_ring, h / U, d)
    k = a2a(k, mode=0, kv_replicas=kv_replicas)
    v = a2a(v, mode=0, kv_replicas=kv_replicas)

    def heads_first(x):
        return x.transpose(1, 2).contiguous()

    o = RingAttention.apply(heads_first(q), heads_first(k), heads_first(v), sp, causal, scale, impl)
    return a2a(o.transpose(1, 2).contiguous(), mode=1)


# -- the check ------------------------------------------------------------------------------------
def reference_attention(q, k, v, *, causal=False, scale=None):
    """Single-process attention on the whole sequence, (b, s, h, d) in and out."""
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(1, 2)


def check_case(sp, *, batch, seq, heads, kv_heads, dim, causal, dtype, device, impl, seed=0):
    """One case: this rank's output and q/k/v gradients against the same slice of single-process
    attention on the whole sequence (every rank draws the same whole tensors). Returns the largest
    absolute differences (output, gradients)."""
    gen = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)

    q, k, v = (
        draw(batch, seq, heads, dim),
        draw(batch, seq, kv_heads, dim),
        draw(batch, seq, kv_heads, dim),
    )
    w = draw(batch, seq, heads, dim)  # the loss is sum(out * w)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = reference_attention(*full, causal=causal)
    (want * w).sum().backward()
    local = [sp.shard(t, zigzag=causal).clone().requires_grad_() for t in (q, k, v)]
    got = usp_attention(*local, sp, causal=causal, impl=impl)
    (got * sp.shard(w, zigzag=causal)).sum().backward()
    out_err = (got.detach() - sp.shard(want.detach(), zigzag=causal)).abs().max().item()
    grad_err = max(
        (a.grad - sp.shard(b.grad, zigzag=causal)).abs().max().item()
        for a, b in zip(local, full, strict=True)
    )
    return out_err, grad_err


def run_checks(
    sp,
    *,
    batch=1,
    seq=None,
    heads=None,
    dim=16,
    dtype=torch.float64,
    device="cpu",
    impl="auto",
    tol=None,
    log=print,
):
    """Non-causal and causal, multi-head and grouped-query (K/V heads split over the Ulysses ranks,
    and fewer K/V heads than Ulysses ranks, replicated) cases; raises AssertionError on a miss.
    Returns the rows it printed."""
    u = sp.ulysses_size
    heads = heads or 4 * u
    seq = seq or 8 * sp.size
    # 16-bit: the flash blocks of a 2-block causal case on an H200 differ from float64 by up to
    # 0.023 in dk; a wrong merge or gradient ring misses by O(1)
    tol = tol or {torch.float64: 1e-9, torch.float32: 2e-4}.get(dtype, 1e-1)
    kv_cases = sorted({heads, u, max(1, u // 2)}, reverse=True)
    rows, worst = [], 0.0
    for causal in (False, True):
        for kv in kv_cases:
            if heads % kv:
                continue
            out_err, grad_err = check_case(
                sp,
                batch=batch,
                seq=seq,
                heads=heads,
                kv_heads=kv,
                dim=dim,
                causal=causal,
                dtype=dtype,
                device=device,
                impl=impl,
                seed=1 + kv + 100 * causal,
            )
            worst = max(worst, out_err, grad_err)
            rows.append(
                f"causal={causal!s:5} heads {heads:3} kv_heads {kv:3}: "
                f"max |out - ref| {out_err:.2e}, max |grad - ref| {grad_err:.2e}"
            )
            log(rows[-1])
    if worst > tol:
        raise AssertionError(
            f"usp_attention differs from single-process attention: {worst:.2e} > {tol:.0e}"
        )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ring", type=int, required=True)
    ap.add_argument("--ulysses", type=int, required=True)
    ap.add_argument("--seq", type=int, default=None, help="whole sequence (default 8 x world)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default 4 x ulysses)")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--dtype", default=None, help="float64 on CPU, bfloat16 on CUDA by default")
    ap.add_argument("--impl", default="auto", choices=["auto", "cpu_flash", "flash", "math"])
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    from fastcomms.sequence_parallel import SequenceParallelGroup

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = (
        getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if cuda else torch.float64)
    )
    sp = SequenceParallelGroup((args.ring, args.ulysses))
    log = print if dist.get_rank() == 0 else (lambda *a: None)
    log(
        f"USP attention, ring {sp.ring_size} x ulysses {sp.ulysses_size} on {device.type} "
        f"({sp.ring.transport} ring, {sp.ulysses.transport} all-to-all), {dtype}"
    )
    ok = True
    try:
        run_checks(
            sp,
            seq=args.seq,
            heads=args.heads,
            dim=args.dim,
            dtype=dtype,
            device=device,
            impl=args.impl,
            log=log,
        )
    except AssertionError as e:
        print(f"[rank {dist.get_rank()}] {e}", file=sys.stderr)
        ok = False
    flags = torch.tensor([0 if ok else 1], device=device)
    dist.all_reduce(flags)
    log(
        "every rank matches single-process attention (output and q/k/v gradients)"
        if flags.item() == 0
        else f"{flags.item()} rank(s) differ"
    )
    sp.destroy()
    dist.destroy_process_group()
    return 0 if flags.item() == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
