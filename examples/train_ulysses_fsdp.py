# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A small transformer trained with Ulysses sequence parallelism on one mesh dimension ("sp") and
FSDP2 on the other ("dp"), on fastcomms communicators, with synthetic data.

Every rank holds a shard of the sequence; attention runs over the whole sequence on a slice of the
heads (the Ulysses all-to-all before and after it); parameters are sharded over "dp" and
replicated over "sp" (FSDP2's hybrid mode over the 2-D mesh), so gradients are averaged over all
ranks. With ``--check`` rank 0 also trains the same model on the same data in one process, without
any communication, and compares the losses step by step (float32; they differ only by the order
of floating-point reductions, tolerance ``--rtol``).

  python examples/train_ulysses_fsdp.py --backend gloo --sp 2 --dp 2 --check     # CPU, 4 procs
  python examples/train_ulysses_fsdp.py --backend nvlink --sp 2 --dp 1 --check   # 2 GPUs

``--baseline`` runs the same training on torch.distributed's own process groups (NCCL on GPUs,
gloo on CPU) with the Ulysses all-to-all written as most Ulysses code has it (permute, torch's
differentiable all_to_all_single, permute), for a step-time comparison; rank 0 prints the median
step time after two warm-up steps either way.

It starts its own ranks with torch.multiprocessing, or runs as one rank under torchrun
(``torchrun --nproc-per-node 4 examples/train_ulysses_fsdp.py --check``; any launcher that sets
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT). On CUDA it needs a GPU per rank (FSDP2 runs on
NCCL) and says so at once where there are fewer. A progress bar shows loss and tokens/s
when tqdm is installed (``pip install tqdm``); otherwise one line per step.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, dim, heads, ulysses=None, fault=False):
        super().__init__()
        self.heads, self.ulysses, self.fault = heads, ulysses, fault
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x):  # x: (b, s_local, dim)
        b, s, dim = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        if self.ulysses is not None and not self.fault:  # (b, s_local, h, d) -> (b, s, h_local, d)
            q, k, v = (self.ulysses.all_to_all_4d(t.contiguous(), mode=0) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        ).transpose(1, 2)
        if self.ulysses is not None and not self.fault:  # back to (b, s_local, h, d)
            y = self.ulysses.all_to_all_4d(y.contiguous(), mode=1)
        return self.out(y.reshape(b, s, dim))


class Block(nn.Module):
    def __init__(self, dim, heads, ulysses=None, fault=False):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, ulysses, fault)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class Model(nn.Module):
    def __init__(self, vocab, dim, heads, layers, seq, ulysses=None, fault=False):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, dim), nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, ulysses, fault) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens, positions):
        x = self.emb(tokens) + self.pos[positions]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def batches(args, step):
    """The global batch of a step: (dp * batch, seq) tokens and next-token targets."""
    g = torch.Generator().manual_seed(1000 + step)
    data = torch.randint(0, args.vocab, (args.dp * args.batch, args.seq + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def make_model(args, ulysses=None):
    torch.manual_seed(args.seed)
    fault = ulysses is not None and args.fault_local_attention
    return Model(args.vocab, args.dim, args.heads, args.layers, args.seq, ulysses, fault)


def reference_losses(args):
    """The same training in one process, without communication."""
    model = make_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    positions = torch.arange(args.seq)
    out = []
    for step in range(args.steps):
        tokens, targets = batches(args, step)
        loss = F.cross_entropy(model(tokens, positions).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


class PermuteUlysses:
    """The baseline (``--baseline``): the all-to-all as most Ulysses code writes it, on a torch
    process group: permute, torch's differentiable all_to_all_single, permute."""

    def __init__(self, group, size):
        self.group, self.size = group, size

    def all_to_all_4d(self, x, mode=0):
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        (b, s, h, d), n = x.shape, self.size
        if mode == 0:  # (b, s_local, h, d) -> (b, s, h_local, d)
            send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
            recv = all_to_all_single_autograd(send, None, None, self.group)
            return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)
        send = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
        recv = all_to_all_single_autograd(send, None, None, self.group)
        return recv.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)

    def destroy(self):
        pass


def _fastcomms_mesh(rank, size, args, store, device):
    """The (sp, dp) mesh on fastcomms communicators and the Ulysses group over "sp"; rank r sits at
    (r // dp, r % dp), row-major."""
    import fastcomms
    from fastcomms.device_mesh import init_device_mesh
    from fastcomms.ulysses import UlyssesGroup

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    timeout = datetime.timedelta(seconds=300)
    world = fastcomms.new_comm(args.backend, device, "world", store=store, timeout=timeout)
    s, d = divmod(rank, args.dp)
    sp = world.split([i * args.dp + d for i in range(args.sp)], "sp")
    dp = world.split([s * args.dp + i for i in range(args.dp)], "dp")
    mesh = init_device_mesh((sp, dp), ("sp", "dp"), _global_comm=world)

    def close():
        for c in (sp, dp, world):
            c.finalize()

    return mesh, UlyssesGroup(mesh["sp"], device=device), close


def _torch_mesh(rank, size, args, store, device):
    """The same mesh on torch.distributed's own groups, with the permute all-to-all."""
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        # under a launcher (store None): torch's env:// rendezvous
        **({} if store is None else {"store": dist.PrefixStore("baseline", store)}),
        rank=rank,
        world_size=size,
        **({"device_id": device} if device.type == "cuda" else {}),
    )
    mesh = init_device_mesh(device.type, (args.sp, args.dp), mesh_dim_names=("sp", "dp"))
    return mesh, PermuteUlysses(mesh.get_group("sp"), args.sp), dist.destroy_process_group


def train(rank, size, args, store):
    """Trains on this rank; returns {kind: per-step global losses} for the kinds run
    ("fastcomms", "baseline" or both, interleaved step by step with ``--compare``)."""
    from torch.distributed.fsdp import fully_shard

    cuda = args.backend in ("nccl", "nvlink")
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = (
        torch.device("cuda", local % torch.cuda.device_count()) if cuda else torch.device("cpu")
    )
    if cuda:
        torch.cuda.set_device(device)
    kinds = ["baseline"] if args.baseline else ["fastcomms"]
    if args.compare:  # torch's default group first: our mesh then keeps it as the default
        kinds = ["baseline", "fastcomms"]
    # FSDP2's hybrid mode replicates over the first mesh dimension (sp), shards over dp
    s, d = divmod(rank, args.dp)
    runs = {}
    for kind in kinds:
        make_mesh = _torch_mesh if kind == "baseline" else _fastcomms_mesh
        mesh, ulysses, close = make_mesh(rank, size, args, store, device)
        model = make_model(args, ulysses).to(device)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        runs[kind] = dict(mesh=mesh, ulysses=ulysses, close=close, model=model, opt=opt)
    shard = args.seq // args.sp
    positions = torch.arange(s * shard, (s + 1) * shard, device=device)
    losses = {k: [] for k in kinds}
    step_s = {k: [] for k in kinds}
    bar = _progress(args, rank)
    t0 = time.perf_counter()
    for step in range(args.steps):
        tokens, targets = batches(args, step)
        rows = slice(d * args.batch, (d + 1) * args.batch)
        cols = slice(s * shard, (s + 1) * shard)
        tokens, targets = tokens[rows, cols].to(device), targets[rows, cols].to(device)
        for kind in kinds:
            run = runs[kind]
            if cuda:
                torch.cuda.synchronize()
            t_step = time.perf_counter()
            loss = F.cross_entropy(run["model"](tokens, positions).flatten(0, 1), targets.flatten())
            run["opt"].zero_grad()
            loss.backward()
            run["opt"].step()
            if cuda:
                torch.cuda.synchronize()
            step_s[kind].append(time.perf_counter() - t_step)
            # the global loss: every rank's shard has the same number of tokens
            total = loss.detach().clone()
            dist.all_reduce(total, group=run["mesh"].get_group("sp"))
            dist.all_reduce(total, group=run["mesh"].get_group("dp"))
            losses[kind].append(total.item() / size)
        tok_s = args.dp * args.batch * args.seq * (step + 1) / (time.perf_counter() - t0)
        bar(step, losses[kinds[-1]][-1], tok_s * len(kinds))
    for kind in reversed(kinds):  # ours first: torch's default group outlives our groups
        runs[kind]["ulysses"].destroy()
        runs[kind]["close"]()
    if rank == 0 and args.steps > 2:
        med = {k: statistics.median(v[2:]) for k, v in step_s.items()}
        for kind in kinds:
            what = (
                "torch.distributed + permute" if kind == "baseline" else f"fastcomms {args.backend}"
            )
            print(
                f"median step time ({what}, {args.steps - 2} steps after 2 warm-up): "
                f"{med[kind] * 1e3:.3f} ms",
                flush=True,
            )
        if len(kinds) == 2:
            print(
                f"step time ratio baseline / fastcomms: {med['baseline'] / med['fastcomms']:.3f}x",
                flush=True,
            )
    return losses


def _progress(args, rank):
    if rank != 0:
        return lambda *a: None
    try:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, desc="train", unit="step")

        def show(step, loss, tok_s):
            bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}")
            bar.update(1)

        return show
    except ImportError:
        return lambda step, loss, tok_s: print(
            f"step {step + 1}/{args.steps}: loss {loss:.5f}, {tok_s:,.0f} tokens/s", flush=True
        )


def _rank_main(rank, size, args, path, q):
    store = dist.FileStore(path, size)
    try:
        q.put((rank, train(rank, size, args, store), None))
    except BaseException as e:  # report, then fail
        import traceback

        q.put((rank, None, traceback.format_exc()))
        raise SystemExit(1) from e


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="gloo", choices=["gloo", "nccl", "nvlink"])
    ap.add_argument("--sp", type=int, default=2, help="sequence-parallel ranks (Ulysses)")
    ap.add_argument("--dp", type=int, default=2, help="data-parallel ranks (FSDP2)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=2, help="sequences per dp rank")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare with a one-process reference")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="run on torch.distributed's own groups with the permute all-to-all (for comparison)",
    )
    ap.add_argument(
        "--compare",
        action="store_true",
        help="run fastcomms and the baseline in the same processes, step by step interleaved",
    )
    ap.add_argument("--rtol", type=float, default=1e-4)
    ap.add_argument(
        "--fault-local-attention",
        action="store_true",
        help="(the test's armed control) skip the all-to-alls: each rank attends over its own "
        "shard only, so --check must report a mismatch",
    )
    args = ap.parse_args(argv)
    size = args.sp * args.dp
    if args.seq % args.sp or args.heads % args.sp or args.dim % args.heads:
        ap.error("seq and heads must divide by --sp, dim by --heads")
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if launched and int(os.environ["WORLD_SIZE"]) != size:
        print(
            f"train_ulysses_fsdp: --sp {args.sp} x --dp {args.dp} = {size} ranks, but the "
            f"launcher started {os.environ['WORLD_SIZE']} (WORLD_SIZE)",
            file=sys.stderr,
        )
        return 2
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size)) if launched else size
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.backend != "gloo" and ngpu < local:
        # NCCL (FSDP2's collectives, and the nvlink backend's non-Ulysses ops) refuses two ranks
        # on one GPU ("invalid usage"): say so before any rank starts
        print(
            f"train_ulysses_fsdp: --backend {args.backend} with {local} ranks on this host needs "
            f"{local} GPUs (FSDP2 runs on NCCL, one GPU per rank); this machine has {ngpu}: use "
            "--backend gloo (CPU), fewer ranks (--sp 1 --dp 1), or more GPUs",
            file=sys.stderr,
        )
        return 2
    if launched:  # under torchrun (or any launcher setting RANK): this process is one rank
        rank = int(os.environ["RANK"])
        # no store: fastcomms and torch.distributed each find the launcher's (NOTE [launchers])
        results = {rank: train(rank, size, args, None)}
    else:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        with tempfile.TemporaryDirectory() as d:
            procs = [
                ctx.Process(target=_rank_main, args=(r, size, args, os.path.join(d, "s"), q))
                for r in range(size)
            ]
            for p in procs:
                p.start()
            results, errors = {}, []
            for _ in procs:
                r, losses, err = q.get(timeout=900)
                results[r] = losses
                if err:
                    errors.append(f"rank {r}:\n{err}")
            for p in procs:
                p.join()
        if errors:
            print("\n".join(errors), file=sys.stderr)
            return 1
    if 0 not in results:
        return 0
    for kind, losses in results[0].items():
        what = "torch baseline" if kind == "baseline" else args.backend
        print(
            f"losses ({what}, sp={args.sp}, dp={args.dp}): " + ", ".join(f"{v:.6f}" for v in losses)
        )
    if args.check:
        ref = reference_losses(args)
        worst = max(
            abs(a - b) / abs(b)
            for losses in results[0].values()
            for a, b in zip(losses, ref, strict=True)
        )
        print("reference (one process): " + ", ".join(f"{v:.6f}" for v in ref))
        ok = worst <= args.rtol and all(
            math.isfinite(v) for losses in results[0].values() for v in losses
        )
        print(
            f"largest relative difference {worst:.2e} (rtol {args.rtol:.0e}): "
            f"{'loss matches the reference' if ok else 'MISMATCH'}"
        )
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
