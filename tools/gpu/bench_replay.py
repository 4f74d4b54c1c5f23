# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Device time per Ulysses call replayed in a CUDA graph, at any world size (issue 36: is the
fixed cost per call also paid beyond world 1?). Ranks are spawned on GPU rank % device_count
over torch's gloo group; the group takes the NVLink transport. Per shape: 20 zero-copy calls
(``out=`` an ``empty_output`` buffer) captured in one graph on every rank, checked against the
eager call, then replayed 50 times per round, rounds started together (a barrier), median of 9
rounds, µs per call by CUDA events; the slowest rank is reported. On one GPU run it under
tools/gpu/mps.sh: with several ranks on it the times are HBM copies, not link figures.
A benchmark, not a test. Usage: python3 tools/gpu/bench_replay.py [--nproc 2]"""

import argparse

import torch
import torch.distributed as dist
from _bench_common import graph_per_call, init_rank, print_env, spawn_ranks

SHAPES = [(1, 64, 40, 128), (1, 1024, 40, 128)]  # x per rank, bf16: 0.6 and 10 MiB


def _rank(rank, world, path, args, outq):
    dev = init_rank(rank, world, path)
    from fastcomms.ulysses import UlyssesGroup

    g = UlyssesGroup(None, device=dev, transport="nvlink")
    res = {}
    for shape in SHAPES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank)).to(
            dev, torch.bfloat16
        )
        zo = g.empty_output(x)
        want = g.all_to_all_4d(x)
        res[str(shape)] = graph_per_call(
            g,
            x,
            zo,
            want,
            calls=args.calls,
            replays=args.replays,
            rounds=args.rounds,
            barrier=dist.barrier,
            message=f"rank {rank}: graph replay result {shape}",
        )
    torch.cuda.synchronize()
    dist.barrier()
    g.destroy()
    outq.put((rank, res))
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    per_rank = dict(spawn_ranks(_rank, args.nproc, args, timeout=300))
    print_env(args.nproc)
    for shape in SHAPES:
        worst = max(per_rank[r][str(shape)] for r in per_rank)
        print(f"world {args.nproc} {shape}: {worst:.2f} us per replayed call (slowest rank)")


if __name__ == "__main__":
    main()
