# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A small mixture-of-experts transformer block trained with expert parallelism
(``fastcomms.moe``), its losses checked against the same model in one process.

The block: x + attention(norm(x)), then h + shared_expert(norm(h)) + moe(norm(h)), where the MoE
routes each token to its top-k of E experts (a softmax router, the top-k weights renormalized).
Every rank holds its own batch of sequences and E / P of the experts, stored as two stacked
weights (local experts, hidden, ffn) and (local experts, ffn, hidden) and applied as grouped
matmuls over ``recv_x``'s expert groups; the dispatch sends each token to the ranks of its experts
and the combine brings the weighted rows back, both differentiable. The other parameters are
replicated (data parallel: their gradients are averaged with an all-reduce). The loss is the mean
over every rank's tokens of a regression on a fixed target, so one process holding all the data
and all the experts computes the same losses: each rank builds that reference model too (same
seeds) and the run fails on a mismatch.

  torchrun --nproc-per-node 2 examples/moe_layer.py                        # CPU, gloo
  torchrun --nproc-per-node 4 examples/moe_layer.py --experts 8 --topk 2   # CPU, gloo
  torchrun --nproc-per-node 2 examples/moe_layer.py --device cuda          # GPUs, nccl

``--async-dispatch`` overlaps the dispatch with the shared expert (``async_op=True``).
Rank 0 prints the transport the group chose and why (docs/moe.md): on CPU the collective one
(gloo all-to-alls); on CUDA over this nccl communicator with every rank on one host the device
one (``device_alltoallv_single``, counts on the GPU, no host sync), else the collective one.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn


def grouped_mm(x, w, bounds):
    """Rows x[bounds[g]:bounds[g + 1]] times w[g] for each group g, the rest zeros:
    (rows, K) x (G, K, N) -> (rows, N). (On GPUs torch._grouped_mm does this in one kernel.)"""
    parts = [x[bounds[g] : bounds[g + 1]] @ w[g] for g in range(w.shape[0])]
    parts.append(x.new_zeros((x.shape[0] - bounds[-1], w.shape[2])))
    return torch.cat(parts)


class Block(nn.Module):
    """The block; ``ep`` (an ExpertParallelGroup) or None (all experts here, the reference)."""

    def __init__(self, hidden, ffn, experts, topk, heads, ep=None, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)

        def param(*shape, scale):
            return nn.Parameter(torch.randn(*shape, generator=g) * scale)

        self.topk, self.heads, self.ep = topk, heads, ep
        self.qkv = param(hidden, 3 * hidden, scale=hidden**-0.5)
        self.proj = param(hidden, hidden, scale=hidden**-0.5)
        self.router = param(hidden, experts, scale=hidden**-0.5)
        self.shared_in = param(hidden, ffn, scale=hidden**-0.5)
        self.shared_out = param(ffn, hidden, scale=ffn**-0.5)
        w_in = torch.randn(experts, hidden, ffn, generator=g) * hidden**-0.5
        w_out = torch.randn(experts, ffn, hidden, generator=g) * ffn**-0.5
        mine = ep.local_experts if ep is not None else range(experts)
        self.w_in = nn.Parameter(w_in[mine.start : mine.stop].clone())
        self.w_out = nn.Parameter(w_out[mine.start : mine.stop].clone())

    def expert_params(self):
        return [self.w_in, self.w_out]

    def replicated_params(self):
        return [self.qkv, self.proj, self.router, self.shared_in, self.shared_out]

    def attention(self, x):
        b, s, h = x.shape
        q, k, v = (x @ self.qkv).view(b, s, 3, self.heads, h // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return o.transpose(1, 2).reshape(b, s, h) @ self.proj

    def route(self, x):
        probs = torch.softmax(x @ self.router, dim=-1)
        w, idx = probs.topk(self.topk, dim=-1)
        return idx, w / w.sum(-1, keepdim=True)

    def moe(self, x, async_dispatch=False):
        """x (tokens, hidden) -> the shared expert plus the routed experts' weighted sum."""
        idx, w = self.route(x)
        if self.ep is None:  # the reference: every expert here, slot by slot
            out = torch.zeros_like(x)
            for j in range(self.topk):
                h = torch.einsum("th,thf->tf", x, self.w_in[idx[:, j]])
                y = torch.einsum("tf,tfh->th", F.gelu(h), self.w_out[idx[:, j]])
                out = out + w[:, j : j + 1] * y
            return out + F.gelu(x @ self.shared_in) @ self.shared_out
        if async_dispatch:  # the dispatch moves while the shared expert computes
            work = self.ep.dispatch(x, idx, w, async_op=True)
            shared = F.gelu(x @ self.shared_in) @ self.shared_out
            recv_x, meta, handle = work.wait()
        else:
            recv_x, meta, handle = self.ep.dispatch(x, idx, w)
            shared = F.gelu(x @ self.shared_in) @ self.shared_out
        bounds = meta.offsets.tolist()  # (the collective path has read the counts already)
        h = F.gelu(grouped_mm(recv_x, self.w_in, bounds))
        y = grouped_mm(h, self.w_out, bounds)
        return shared + self.ep.combine(y, handle)  # weights: dispatch's w

    def forward(self, x, async_dispatch=False):
        x = x + self.attention(F.rms_norm(x, x.shape[-1:]))
        n = F.rms_norm(x, x.shape[-1:])
        return x + self.moe(n.flatten(0, 1), async_dispatch).view_as(x)


def data(step, rank, batch, seq, hidden):
    """Rank ``rank``'s inputs and targets at ``step`` (every rank can make every rank's)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(batch, seq, hidden, generator=g), torch.randn(
        batch, seq, hidden, generator=g
    )


@torch.no_grad()
def sgd(model, lr):
    """Plain SGD (torch.optim would do; its import pulls in torch._dynamo, seconds of CPU)."""
    for p in model.parameters():
        p -= lr * p.grad
        p.grad = None


def train(
    comm,
    steps=4,
    hidden=32,
    ffn=64,
    experts=8,
    topk=2,
    heads=4,
    batch=2,
    seq=8,
    lr=0.1,
    async_dispatch=False,
):
    """Trains the expert-parallel block over ``comm`` (a TorchComm) and the one-process reference
    side by side; returns (losses, reference losses). The same on every rank."""
    import fastcomms
    from fastcomms.moe import ExpertParallelGroup

    rank, size = comm.get_rank(), comm.get_size()
    device = comm.get_device()
    losses, ref_losses = [], []
    with ExpertParallelGroup(
        comm, experts, hidden, max_tokens_per_rank=batch * seq, dtype=torch.float32, device=device
    ) as ep:
        if rank == 0:
            print(f"moe transport: {ep.transport} ({ep.transport_reason})")
        model = Block(hidden, ffn, experts, topk, heads, ep=ep).to(device)
        ref = Block(hidden, ffn, experts, topk, heads)
        for step in range(steps):
            x, target = (t.to(device) for t in data(step, rank, batch, seq, hidden))
            # the global loss is the mean over every rank's tokens: each rank's mean / size
            loss = F.mse_loss(model(x, async_dispatch), target) / size
            loss.backward()  # expert gradients arrive from every rank's tokens
            for p in model.replicated_params():  # data parallel: summed over the ranks
                comm.all_reduce(p.grad, fastcomms.ReduceOp.SUM, False)
            sgd(model, lr)
            total = loss.detach().clone()
            comm.all_reduce(total, fastcomms.ReduceOp.SUM, False)
            losses.append(total.item())

            xs, ts = zip(*(data(step, r, batch, seq, hidden) for r in range(size)), strict=True)
            ref_loss = F.mse_loss(ref(torch.cat(xs)), torch.cat(ts))
            ref_loss.backward()
            sgd(ref, lr)
            ref_losses.append(ref_loss.item())
    return losses, ref_losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--async-dispatch", action="store_true")
    args = p.parse_args(argv)
    import fastcomms

    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        device = torch.device("cuda", torch.cuda.current_device())
        comm = fastcomms.new_comm("nccl", device, "moe")
    else:
        comm = fastcomms.new_comm("gloo", torch.device("cpu"), "moe")
    losses, ref = train(
        comm,
        steps=args.steps,
        hidden=args.hidden,
        experts=args.experts,
        topk=args.topk,
        async_dispatch=args.async_dispatch,
    )
    ok = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(losses, ref, strict=True))
    if comm.get_rank() == 0:
        print("losses (expert parallel):", " ".join(f"{v:.6f}" for v in losses))
        print("losses (one process):    ", " ".join(f"{v:.6f}" for v in ref))
        print("loss matches the reference" if ok else "MISMATCH against the reference")
    comm.finalize()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
