# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What a communicator method costs inside a compiled function against the same call eagerly
(NOTE [compiled communicator methods]): world 1 over gloo on CPU, ``comm.all_reduce(t, SUM,
False)`` then ``t + 1``, eager and compiled (inductor, fullgraph), for a few sizes; the compiled
call pays the clone of the written tensor, the copy back and the graph's own overhead. Rounds of
N back-to-back calls, the two kinds interleaved round by round, medians after a warm-up; no device
needed. A benchmark, not a test.

Usage: python3 tools/compiled_overhead.py [--calls 2000] [--rounds 7] [--sizes 16,65536,1048576]"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="16,65536,1048576", help="float32 elements, comma-separated")
    args = ap.parse_args()

    import fastcomms

    os.environ.setdefault("TORCHCOMM_RANK", "0")
    os.environ.setdefault("TORCHCOMM_SIZE", "1")
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "store"), 1)
        comm = fastcomms.new_comm("gloo", torch.device("cpu"), "overhead", store=store)

        def step(t):
            comm.all_reduce(t, fastcomms.ReduceOp.SUM, False)
            return t + 1

        compiled = torch.compile(step, fullgraph=True, backend="inductor")
        print(
            f"torch {torch.__version__}, fastcomms {fastcomms.__version__}, "
            f"{os.cpu_count()} CPUs; us per call, median of {args.rounds} rounds of "
            f"{args.calls} calls"
        )
        print(f"{'elements':>10} {'eager':>10} {'compiled':>10} {'ratio':>7}")
        for n in (int(v) for v in args.sizes.split(",")):
            t = torch.randn(n)
            for fn in (step, compiled):  # warm-up (and the compile)
                for _ in range(20):
                    fn(t)
            times = {"eager": [], "compiled": []}
            for _ in range(args.rounds):
                for name, fn in (("eager", step), ("compiled", compiled)):
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        fn(t)
                    times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
            e, c = statistics.median(times["eager"]), statistics.median(times["compiled"])
            print(f"{n:>10} {e:>10.2f} {c:>10.2f} {c / e:>6.2f}x")
        comm.finalize()


if __name__ == "__main__":
    main()
