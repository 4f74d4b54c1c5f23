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
import json
import os
import statistics
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SHAPES = [(1, 64, 40, 128), (1, 1024, 40, 128)]  # x per rank, bf16: 0.6 and 10 MiB


def _rank(rank, world, path, args, outq):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("gloo", store=dist.FileStore(path, world), rank=rank, world_size=world)
    from fastcomms.ulysses import UlyssesGroup

    g = UlyssesGroup(None, device=dev, transport="nvlink")
    res = {}
    for shape in SHAPES:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank)).to(
            dev, torch.bfloat16
        )
        zo = g.empty_output(x)
        want = g.all_to_all_4d(x)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                g.all_to_all_4d(x, out=zo)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(args.calls):
                g.all_to_all_4d(x, out=zo)
        zo.zero_()
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(zo, want), f"rank {rank}: graph replay result {shape}"
        times = []
        for _ in range(args.rounds):
            dist.barrier()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(args.replays):
                graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3 / (args.replays * args.calls))
        res[str(shape)] = statistics.median(times)
        del graph
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
    path = os.path.join(tempfile.mkdtemp(), "store")
    ctx = mp.get_context("spawn")
    outq = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, args.nproc, path, args, outq)) for r in range(args.nproc)
    ]
    for p in procs:
        p.start()
    per_rank = dict(outq.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    env = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "nproc": args.nproc,
        "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
        "torch": torch.__version__,
    }
    print("env", json.dumps(env))
    for shape in SHAPES:
        worst = max(per_rank[r][str(shape)] for r in per_rank)
        print(f"world {args.nproc} {shape}: {worst:.2f} us per replayed call (slowest rank)")


if __name__ == "__main__":
    main()
