# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A developer probe (not a test): where the host time of one Python Ulysses call goes, on one
GPU at world 1 (torch.distributed NCCL default group of one rank, the NVLink transport; the
device work is a local copy). For each call kind: cProfile's top entries (Python functions and
the extension's calls) and torch.profiler's CPU-side table (aten ops and CUDA runtime calls).
Usage: python3 tools/gpu/profile_host.py [--kinds zero,copy,async,functional] [--calls 2000]
"""

import argparse
import cProfile
import os
import pstats
import tempfile

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kinds", default="zero,copy,async,functional")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--shape", default="1,64,40,128")
    args = ap.parse_args()
    import torch.distributed as dist
    from fastcomms.ulysses import UlyssesGroup
    from fastcomms.ulysses import all_to_all_4d as functional_a2a

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "s"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)
        g = UlyssesGroup(None, device=dev, transport="nvlink")
        x = torch.randn(
            tuple(int(v) for v in args.shape.split(",")), device=dev, dtype=torch.bfloat16
        )
        zo = g.empty_output(x)
        calls = {
            "zero": lambda: g.all_to_all_4d(x, out=zo),
            "copy": lambda: g.all_to_all_4d(x),
            "async": lambda: g.all_to_all_4d_async(x),
            "functional": lambda: functional_a2a(x, g),
        }
        for kind in args.kinds.split(","):
            fn = calls[kind]
            for _ in range(200):
                fn()
            torch.cuda.synchronize()
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.calls):
                fn()
            pr.disable()
            torch.cuda.synchronize()
            print(f"===== {kind}: cProfile over {args.calls} calls =====")
            pstats.Stats(pr).sort_stats("tottime").print_stats(14)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                for _ in range(200):
                    fn()
                torch.cuda.synchronize()
            print(f"===== {kind}: torch.profiler (CPU), 200 calls =====")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
        g.destroy()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
