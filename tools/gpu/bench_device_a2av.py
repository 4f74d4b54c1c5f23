# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""device_alltoallv_single (issue 52) against what MoE token exchanges use today, on the MoE
shape of issue 52: 4096 tokens x 4096 hidden bf16 per rank, uniform and skewed routing
(receiver q gets a share proportional to 2^-q of every rank's tokens). Time per call of

- ``device``: ``comm.device_alltoallv_single(out, x, out_splits, in_splits)`` with the splits
  as int64 CUDA tensors (NOTE [device all-to-all-v]); also ``device graph``, one call replayed
  from a CUDA graph (per-call launch cost gone);
- ``tolist + nccl``: ``torch.distributed.all_to_all_single`` after ``.tolist()`` of the split
  tensors (the device-to-host copy and its sync are part of the call), on NCCL: needs one GPU
  per rank (NCCL refuses ranks sharing a GPU);
- ``symm_mem vdev``: torch's ``symm_mem.all_to_all_vdev`` (NVSHMEM), where this torch has it
  and it sets up (else the reason is printed);
- ``local copy``: ``dst.copy_(src)`` of the bytes this rank sends to its peers, on its own GPU:
  the floor of an HBM copy, printed for scale (with ranks sharing one GPU under MPS every figure
  is an HBM copy, not a link figure).

Correctness first: the device result is compared with ``tolist + nccl`` (or, on one GPU, with
gloo on the host) byte for byte. Rounds interleave the variants; each round times ``--iters``
calls with CUDA events after a host barrier; medians of the rounds after one warm-up round.
Ranks are spawned on GPU rank % device_count; on one GPU run it under tools/gpu/mps.sh. A
benchmark, not a test. Prints an ``env`` line, then one JSON line per (routing, variant).

Usage: python3 tools/gpu/bench_device_a2av.py [--nproc 2] [--rounds 7] [--iters 10]
       [--tokens 4096] [--hidden 4096] [--no-symm-mem]"""

import argparse
import datetime
import statistics
import sys

import torch
import torch.distributed as dist
from _bench_common import print_env, print_slowest_rank, spawn_ranks


def _counts(routing, world, tokens):
    """counts[p][q]: tokens rank p sends rank q (every rank routes alike)."""
    if routing == "uniform":
        w = torch.ones(world, dtype=torch.float64)
    else:  # skewed: receiver q's share ~ 2^-q
        w = torch.tensor([2.0**-q for q in range(world)], dtype=torch.float64)
    row = torch.floor(w / w.sum() * tokens).to(torch.int64)
    row[0] += tokens - int(row.sum())
    return row.repeat(world, 1)


def _timed(fn, iters, barrier):
    barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters  # µs per call


def _symm_mem_variant(x, counts, rank, world, hidden, dev):
    """torch's all_to_all_vdev on symmetric memory (flat element splits), or raises saying why
    not. Two schemas exist: (input, out, in_out_splits[3, W], group) in torch 2.8 and (input,
    out, in_splits[W], out_splits_offsets[2, W], group) later; both are served."""
    import torch.distributed._symmetric_memory as symm_mem

    if not hasattr(torch.ops.symm_mem, "all_to_all_vdev"):
        raise RuntimeError("this torch has no symm_mem.all_to_all_vdev")
    if hasattr(symm_mem, "set_backend"):
        symm_mem.set_backend("NVSHMEM")
    group_name = dist.group.WORLD.group_name
    symm_mem.enable_symm_mem_for_group(group_name)
    nargs = len(torch.ops.symm_mem.all_to_all_vdev.default._schema.arguments)
    max_out = int(counts.sum(0).max()) * hidden  # the same size on every rank
    inp = symm_mem.empty(x.numel(), dtype=x.dtype, device=dev)
    o = symm_mem.empty(max_out, dtype=x.dtype, device=dev)
    tensors = [inp, o]
    if nargs == 4:
        splits = symm_mem.empty((3, world), dtype=torch.int64, device=dev)
        tensors.append(splits)
        in_row = splits[0]
    else:
        in_row = symm_mem.empty(world, dtype=torch.int64, device=dev)
        out_so = symm_mem.empty((2, world), dtype=torch.int64, device=dev)
        tensors += [in_row, out_so]
    for t in tensors:
        symm_mem.rendezvous(t, group=group_name)
    inp.copy_(x.reshape(-1))
    elems = (counts[rank] * hidden).to(dev)

    def call():
        in_row.copy_(elems)
        if nargs == 4:
            torch.ops.symm_mem.all_to_all_vdev(inp, o, splits, group_name)
        else:
            torch.ops.symm_mem.all_to_all_vdev(inp, o, in_row, out_so, group_name)

    call()
    torch.cuda.synchronize()
    return call


def _rank(rank, world, path, args, outq):
    import fastcomms

    ngpu = torch.cuda.device_count()
    shared = ngpu < world  # ranks share GPUs: MPS clients, no NCCL
    torch.cuda.set_device(rank % ngpu)
    dev = torch.device("cuda", torch.cuda.current_device())
    store = dist.FileStore(path, world)
    if shared:
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("torch", store), rank=rank, world_size=world
        )
    else:
        dist.init_process_group(
            "nccl",
            store=dist.PrefixStore("torch", store),
            rank=rank,
            world_size=world,
            device_id=dev,
        )
    import os

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(world)
    comm = fastcomms.new_comm(
        "nvlink",
        dev,
        "bench_a2av",
        store=dist.PrefixStore("fc", store),
        timeout=datetime.timedelta(seconds=120),
        hints={"nvlink.lazy_nccl": "1"} if shared else None,
    )
    ctrl = dist.new_group(backend="gloo") if not shared else None

    def barrier():
        torch.cuda.synchronize()
        dist.barrier(group=ctrl)

    tokens, hidden = args.tokens, args.hidden
    gen = torch.Generator().manual_seed(rank)

    def measure(routing):  # one routing: every closure binds this call's tensors
        rows = []
        counts = _counts(routing, world, tokens)
        send, recv = counts[rank], counts[:, rank]
        x = torch.randn(tokens, hidden, generator=gen).to(dev, torch.bfloat16)
        out = torch.empty(int(recv.sum()), hidden, dtype=torch.bfloat16, device=dev)
        in_splits, out_splits = send.to(dev), recv.to(dev)
        comm.device_alltoallv_prepare(max(int(c.sum()) for c in counts.t()) * hidden * 2)
        comm.device_alltoallv_single(out, x, out_splits, in_splits, False)
        torch.cuda.synchronize()
        # correctness: the same bytes as torch.distributed's all_to_all_single
        ref = torch.empty_like(out)
        if shared:
            refc = torch.empty(ref.shape, dtype=ref.dtype)
            dist.all_to_all_single(
                refc.view(torch.uint8), x.cpu().view(torch.uint8), recv.tolist(), send.tolist()
            )
            ref = refc.to(dev)
        else:
            dist.all_to_all_single(ref, x, recv.tolist(), send.tolist())
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), f"{routing}: differs"

        variants = {
            "device": lambda: comm.device_alltoallv_single(out, x, out_splits, in_splits, False)
        }
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.device_alltoallv_single(out, x, out_splits, in_splits, False)
        variants["device graph"] = graph.replay
        skipped = {}
        if not shared:
            ref_out = torch.empty_like(out)
            variants["tolist + nccl"] = lambda: dist.all_to_all_single(
                ref_out, x, out_splits.tolist(), in_splits.tolist()
            )
        else:
            skipped["tolist + nccl"] = "ranks share a GPU: NCCL refuses duplicate GPUs"
        try:
            if args.no_symm_mem:
                raise RuntimeError("left out (--no-symm-mem)")
            call = _symm_mem_variant(x, counts, rank, world, hidden, dev)
            variants["symm_mem vdev"] = call
        except Exception as e:  # noqa: BLE001 - printed: why the anchor is absent
            skipped["symm_mem vdev"] = f"{type(e).__name__}: {e}"[:200]
        sent = int(send.sum() - send[rank])
        src = x[:sent] if sent else x[:1]
        dst = torch.empty_like(src)
        variants["local copy"] = lambda: dst.copy_(src)

        times = {k: [] for k in variants}
        for r in range(args.rounds + 1):
            for name, fn in variants.items():
                t = _timed(fn, args.iters, barrier)
                if r > 0:
                    times[name].append(t)
        crossing = int((counts.sum() - counts.diag().sum()) * hidden * 2)  # bytes, all ranks
        for name, ts in times.items():
            rows.append(
                {
                    "routing": routing,
                    "variant": name,
                    "rank": rank,
                    "median_us": statistics.median(ts),
                    "rounds": len(ts),
                    "bytes_crossing_all_ranks": crossing,
                }
            )
        for name, why in skipped.items():
            rows.append({"routing": routing, "variant": name, "rank": rank, "skipped": why})
        barrier()
        return rows

    rows = []
    for routing in ("uniform", "skewed"):
        rows += measure(routing)
    comm.finalize()
    outq.put(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--no-symm-mem", action="store_true", help="leave out symm_mem vdev")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 2
    print_env(args.nproc)
    got = spawn_ranks(_rank, args.nproc, args, timeout=900)
    print_slowest_rank(got, keep=("bytes_crossing_all_ranks",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
