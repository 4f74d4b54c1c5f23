# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""FP8 on the wire, the accuracy it costs (NOTE [fp8 wire]): values round-tripped through
the FP8 reference (tests/python/fp8_reference.py: the bytes the C++ and CUDA implementations
write too), on CPU.

1. Per block (one (token, head) row of d values): the relative L2 error ||out - x|| / ||x||, its
   mean and max over blocks, the largest element error relative to its block's amax, and the
   mean relative error of single values |out - x| / |x| (x != 0), for
   normal, heavy-tailed (Student-t, df=3) and outlier-spiked (1% of values x100) data, both
   formats, float32 / bfloat16 / float16 in and out.
2. One attention layer: torch SDPA on random bfloat16 Q, K, V of shape (b, h, s, d) with and
   without the FP8 round trip of Q, K and V (a scale per (token, head)), each compared with SDPA
   in float32 on the original inputs; bfloat16 SDPA on the original inputs is the floor.

Usage: python3 tools/fp8_accuracy.py [--blocks 4096] [--d 128] [--seq 1024] [--seed 0]"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

# the reference is a test helper (tests/python), not part of the runtime package
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../tests/python"))
from fp8_reference import dequantize_reference, quantize_reference  # noqa: E402

WIRES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _data(kind: str, blocks: int, d: int, gen: torch.Generator) -> torch.Tensor:
    z = torch.randn(blocks, d, generator=gen)
    if kind == "student_t(3)":
        chi2 = (torch.randn(blocks, d, 3, generator=gen) ** 2).sum(-1)
        z = z / torch.sqrt(chi2 / 3)
    elif kind == "spiked 1% x100":
        z = torch.where(torch.rand(blocks, d, generator=gen) < 0.01, z * 100, z)
    return z


def _roundtrip(x: torch.Tensor, wire: torch.dtype) -> torch.Tensor:
    q, s = quantize_reference(x, wire)
    return dequantize_reference(q, s, x.dtype)


def block_table(blocks: int, d: int, gen: torch.Generator) -> list[tuple]:
    rows = []
    for kind in ("normal", "student_t(3)", "spiked 1% x100"):
        base = _data(kind, blocks, d, gen)
        for dname, dt in DTYPES.items():
            x = base.to(dt)
            xf = x.double()
            for wname, wire in WIRES.items():
                err = _roundtrip(x, wire).double() - xf
                rel = err.norm(dim=-1) / xf.norm(dim=-1)
                amax = xf.abs().amax(-1, keepdim=True)
                el = (err.abs() / amax).amax(-1)
                nz = xf != 0
                per_value = (err.abs()[nz] / xf.abs()[nz]).mean().item()
                rows.append(
                    (
                        kind,
                        dname,
                        wname,
                        rel.mean().item(),
                        rel.max().item(),
                        el.max().item(),
                        per_value,
                    )
                )
    return rows


def attention_table(seq: int, d: int, gen: torch.Generator) -> list[tuple]:
    b, h = 1, 8
    q, k, v = (torch.randn(b, h, seq, d, generator=gen).to(torch.bfloat16) for _ in range(3))
    truth = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).double()

    def err(out: torch.Tensor) -> tuple[float, float]:
        e = out.double() - truth
        return (e.norm() / truth.norm()).item(), e.abs().max().item()

    rows = [("bfloat16, no FP8 (floor)",) + err(F.scaled_dot_product_attention(q, k, v))]
    for wname, wire in WIRES.items():
        # Q, K, V are (b, h, s, d): the rows are (token, head) blocks of d values either way.
        q8, k8, v8 = (_roundtrip(t, wire) for t in (q, k, v))
        rows.append(
            (f"bfloat16, Q/K/V through {wname}",) + err(F.scaled_dot_product_attention(q8, k8, v8))
        )
        rows.append(
            (f"bfloat16, only V through {wname}",) + err(F.scaled_dot_product_attention(q, k, v8))
        )
    return rows


def _print(title: str, header: list[str], rows: list[tuple]) -> None:
    cells = [[f"{c:.3e}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print(title)
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=False)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in cells:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + " |")
    print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    _print(
        f"Per block ({args.blocks} blocks of d={args.d}; relative L2 error per block, and the "
        "largest element error over its block's amax; the mean error of single values)",
        ["data", "dtype", "wire", "mean rel L2", "max rel L2", "max |err|/amax", "mean |err|/|x|"],
        block_table(args.blocks, args.d, gen),
    )
    _print(
        f"Attention, SDPA on (1, 8, {args.seq}, {args.d}) random normal Q/K/V, error against "
        "float32 SDPA of the original inputs",
        ["inputs", "rel L2", "max abs"],
        attention_table(args.seq, args.d, gen),
    )
    print(f"torch {torch.__version__}, {time.perf_counter() - t0:.1f} s on CPU")


if __name__ == "__main__":
    main()
