# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torch.distributed NCCL on the same ops, sizes and timing as bench_nccl_ops, then the joined
table. Usage: python3 tools/gpu/bench_torch_nccl.py OURS.csv (OURS.csv from bench_nccl_ops)."""

import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SIZES = [8, 1 << 10, 64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30]


def worker(rank: int, world: int, init_file: str, out_file: str) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    a = torch.ones((1 << 30) * world // 4, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    lines = []
    for nbytes in SIZES:
        n = nbytes // 4
        ops = {
            "all_reduce": lambda n=n: dist.all_reduce(a[:n]),
            "broadcast": lambda n=n: dist.broadcast(a[:n], 0),
            "all_gather_single": lambda n=n: dist.all_gather_into_tensor(b[: n * world], a[:n]),
            "reduce_scatter_single": lambda n=n: dist.reduce_scatter_tensor(b[:n], a[: n * world]),
            "all_to_all_single": lambda n=n: dist.all_to_all_single(b[: n * world], a[: n * world]),
        }
        iters = 5 if nbytes >= (256 << 20) else 50
        for name, fn in ops.items():
            for _ in range(5):
                fn()
            samples = []
            for _ in range(7):
                torch.cuda.synchronize()
                t0 = torch.cuda.Event(enable_timing=True)
                t1 = torch.cuda.Event(enable_timing=True)
                t0.record()
                for _ in range(iters):
                    fn()
                t1.record()
                t1.synchronize()
                samples.append(1000.0 * t0.elapsed_time(t1) / iters)
            lines.append(f"torch,{name},{nbytes},{statistics.median(samples):.2f}")
    if rank == 0:
        with open(out_file, "w") as f:
            f.write("\n".join(lines) + "\n")
    dist.destroy_process_group()


def main() -> None:
    ours_csv = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "torch.csv")
        mp.spawn(worker, args=(2, os.path.join(tmp, "init"), out), nprocs=2)
        theirs = open(out).read().splitlines()
    rows = {}
    for line in open(ours_csv).read().splitlines() + theirs:
        parts = line.split(",")
        if len(parts) != 4 or parts[0] not in ("fastcomms", "torch"):
            continue
        who, op, nbytes, us = parts
        rows.setdefault((op, int(nbytes)), {})[who] = float(us)
    print(
        f"torch {torch.__version__}, NCCL {torch.cuda.nccl.version()}, 2 ranks, float32, sync ops"
    )
    head = ("op", "bytes", "torch us", "ours us", "ours/torch", "extra us")
    print(
        f"{head[0]:24s} {head[1]:>12s} {head[2]:>10s} {head[3]:>10s} {head[4]:>10s} {head[5]:>9s}"
    )
    for (op, nbytes), v in sorted(rows.items()):
        if "torch" in v and "fastcomms" in v:
            t, o = v["torch"], v["fastcomms"]
            print(f"{op:24s} {nbytes:12d} {t:10.2f} {o:10.2f} {o / t:10.3f} {o - t:9.2f}")


if __name__ == "__main__":
    main()
