# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""FP8 on the wire (issue 38): time per Ulysses call (mode 0, bfloat16 x) of

- ``bf16 zero copy``: ``all_to_all_4d(x, out=empty_output)``, the bf16 baseline;
- ``fp8 wire``: ``all_to_all_4d(x, wire_dtype=torch.float8_e4m3fn)`` (the extension's quantize
  kernel, the op on the FP8 rows and on the scales, the dequantize kernel: NOTE [fp8 wire
  exchange]);
- ``separate``: quantize and dequantize as torch ops (the reference, tests/python/fp8_reference.py)
  around the op on the FP8 bytes and on the scales: what stacks without a fused path do;

and the bytes each rank puts on the wire (bf16 rows; FP8 rows and a 16-byte scale per row).
Ranks are spawned on GPU rank % device_count; on one GPU run it under tools/gpu/mps.sh, and
read the times as HBM copies, not link figures. The fused and the separate path are checked
bit-exact against each other first. Rounds interleave the variants; medians of rounds after a
warm-up, CUDA events, a barrier before every round. A benchmark, not a test.

Usage: python3 tools/gpu/bench_fp8_wire.py [--nproc 2] [--rounds 7] [--iters 10]"""

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist
from _bench_common import init_rank, print_env, spawn_ranks

# the FP8 reference is a test helper (tests/python/fp8_reference.py), not in the runtime package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tests/python"))

SHAPES = [(1, 1024, 32, 128), (1, 8192, 32, 128), (1, 18900, 40, 128)]  # x per rank, bf16


def _rank(rank, world, path, args, outq):
    dev = init_rank(rank, world, path)
    import fp8_reference as _fp8
    from fastcomms.ulysses import UlyssesGroup

    g = UlyssesGroup(None, device=dev)
    wire = torch.float8_e4m3fn
    rows = []
    for shape in SHAPES:
        b, s, n, d = shape
        x = torch.randn(shape, generator=torch.Generator().manual_seed(rank)).to(
            dev, torch.bfloat16
        )
        z = g.empty_output(x)

        def separate(x=x):
            q, sc = _fp8.quantize_reference(x, wire)
            pad = torch.nn.functional.pad(sc.unsqueeze(-1), (0, 3))
            qo = g.all_to_all_4d(q.view(torch.uint8)).view(wire)
            so = g.all_to_all_4d(pad)[..., 0]
            return _fp8.dequantize_reference(qo, so, torch.bfloat16)

        variants = {
            "bf16 zero copy": lambda x=x, z=z: g.all_to_all_4d(x, out=z),
            "fp8 wire": lambda x=x: g.all_to_all_4d(x, wire_dtype=wire),
            "separate": separate,
        }
        # correctness first: the fused path and the separate path give the same bytes
        a, c = variants["fp8 wire"](), separate()
        torch.cuda.synchronize()
        assert torch.equal(
            a.view(torch.uint8), c.view(torch.uint8)
        ), f"fp8 wire != separate {shape}"
        times = {k: [] for k in variants}
        for r in range(args.warmup + args.rounds):
            for name, fn in variants.items():
                dist.barrier()
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                for _ in range(args.iters):
                    fn()
                e1.record()
                torch.cuda.synchronize()
                if r >= args.warmup:
                    times[name].append(e0.elapsed_time(e1) * 1e3 / args.iters)
        elems, rows_n = b * s * n * d, b * s * n
        # bytes each rank puts on the wire: bf16 rows, or FP8 rows plus a 16-byte scale per row
        # (padded on the peer-to-peer path)
        wire_bytes = {"bf16": 2 * elems, "fp8": elems + 16 * rows_n}
        rows.append(
            {
                "shape": shape,
                "MiB_per_rank": elems * 2 / 2**20,
                "us": {k: statistics.median(v) for k, v in times.items()},
                "wire_bytes": wire_bytes,
            }
        )
    g.destroy()
    if rank == 0:
        outq.put(rows)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=10)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_fp8_wire: needs CUDA")
    (rows,) = spawn_ranks(_rank, args.nproc, args, results=1, timeout=540)  # rank 0's rows
    print_env(args.nproc)
    head = ["x per rank", "MiB", "bf16 zc us", "fp8 wire us", "separate us", "bf16/fp8", "sep/fp8"]
    print(" ".join(f"{h:>12}" for h in head))
    for r in rows:
        u = r["us"]
        print(
            f"{str(r['shape']):>22} {r['MiB_per_rank']:7.1f} {u['bf16 zero copy']:11.1f} "
            f"{u['fp8 wire']:12.1f} {u['separate']:12.1f} "
            f"{u['bf16 zero copy'] / u['fp8 wire']:9.2f} {u['separate'] / u['fp8 wire']:8.2f}"
        )
    print("json", json.dumps(rows))


if __name__ == "__main__":
    main()
