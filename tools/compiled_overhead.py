# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What a communicator method costs inside a compiled function against the same call eagerly,
and how much of an async call a compiled function hides (NOTE [compiled communicator methods],
NOTE [compiled async calls]). World 1: over gloo on CPU (no device needed) or, with
``--backend nccl``, over NCCL on cuda:0.

- host: ``comm.all_reduce(t, SUM, False)`` then ``t + 1``, eager and compiled (inductor,
  fullgraph), the compiled ``t + 1`` alone (torch's own cost per compiled call), that alone
  followed by the eager step ("beside": what the eager call costs next to compiled code, where
  the host's caches hold both; a call costs more there than in a loop of its own) and
  ``torch.add``, for a few sizes; then the same measures for ``aten._cdist_forward``, an op of
  torch's that inductor leaves as a fallback call. Rounds of N back-to-back calls, the variants
  interleaved round by round, medians after a warm-up (on CUDA, a synchronize ends each round).
- overlap: inside one compiled function, ``all_gather_single`` of ``--overlap-mib`` (a copy at
  world 1, on the communicator's own stream or thread) beside a chain of matrix products on the
  caller's stream; "gemm" the chain alone, "comm" the call alone, "async" both with
  ``async_op=True`` and the wait after the chain, "sync" both with ``async_op=False``; each timed
  per call (on CUDA by events behind a queued wait, so that the host's issue time is not
  counted), interleaved rounds, medians; hidden = (gemm + comm - async) / comm. ``--grad``: the
  gathered input needs a gradient and the output is made inside the function (``--local-out``:
  the output made there without a gradient); else the output is made once, before.
  ``--no-memory-reorder``: the four functions compiled with inductor's
  ``reorder_for_peak_memory`` off, which otherwise moves an output made inside the function, and
  the async call that writes it, after the compute (NOTE [compiled async calls]).

A benchmark, not a test. Usage: python3 tools/compiled_overhead.py [--backend gloo|nccl]
[--calls 2000] [--rounds 7] [--sizes 16,65536,1048576] [--only host,overlap] [--overlap-mib 64]
[--gemm 1024] [--chain 4] [--grad] [--local-out] [--no-memory-reorder]"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


def _host(comm, args, dev, sync):
    import fastcomms

    def step(t):
        comm.all_reduce(t, fastcomms.ReduceOp.SUM, False)
        return t + 1

    def alone(t):  # what torch's compiled frame costs without the call
        return t + 1

    compiled_alone = torch.compile(alone, fullgraph=True, backend="inductor")
    fns = {
        "eager": step,
        "compiled": torch.compile(step, fullgraph=True, backend="inductor"),
        "alone": compiled_alone,
        # the eager step right after a compiled function, as the same step pays it beside
        # compiled code (the host's caches hold both), the matched eager figure of the call
        "beside": lambda t: (compiled_alone(t), step(t)),
        "add": lambda t: torch.add(t, 1),
    }
    print(f"host: us per call, median of {args.rounds} rounds of {args.calls} calls")
    print("  alone: the compiled t + 1 without the call; beside: alone, then the eager step;")
    print("  call: compiled - alone (the compiled call); eager: the eager step - torch.add;")
    print("  eager': beside - alone - torch.add (the eager call beside a compiled function)")
    cols = ("step", "compiled", "alone", "beside", "add", "call", "eager", "eager'")
    print(f"{'elements':>10}" + "".join(f"{c:>9}" for c in cols) + "  call/eager call/eager'")
    for n in (int(v) for v in args.sizes.split(",")):
        t = torch.randn(n, device=dev)
        e, c, a, b, add = _interleaved(fns, (t,), args, sync)
        row = (e, c, a, b, add, c - a, e - add, b - a - add)
        print(
            f"{n:>10}"
            + "".join(f"{v:>9.2f}" for v in row)
            + f"{(c - a) / (e - add):>10.2f}x{(c - a) / (b - a - add):>11.2f}x"
        )
    # the same measures for one of torch's own ops that inductor leaves as a fallback call
    cd = torch.ops.aten._cdist_forward.default
    x, y = torch.randn(64, 16, device=dev), torch.randn(64, 16, device=dev)
    r = cd(x, y, 2.0, None)
    aten_alone = torch.compile(alone, fullgraph=True, backend="inductor")
    aten = {
        "eager": lambda t: cd(t, y, 2.0, None) + 1,
        "compiled": torch.compile(lambda t: cd(t, y, 2.0, None) + 1, fullgraph=True),
        "alone": lambda t: aten_alone(r),
        "beside": lambda t: (aten_alone(r), cd(t, y, 2.0, None) + 1),
        "add": lambda t: torch.add(r, 1),
    }
    e, c, a, b, add = _interleaved(aten, (x,), args, sync)
    print(
        f"aten._cdist_forward (64, 16) + 1: eager {e:.2f} (torch.add {add:.2f}), compiled {c:.2f}, "
        f"alone {a:.2f}, beside {b:.2f}; call {c - a:.2f} against eager {e - add:.2f} "
        f"({(c - a) / (e - add):.2f}x) and eager' {b - a - add:.2f} "
        f"({(c - a) / (b - a - add):.2f}x)"
    )


def _interleaved(fns, args_, args, sync):
    """Median µs per call of each of ``fns``, rounds interleaved after a warm-up."""
    for fn in fns.values():  # warm-up (and the compile)
        for _ in range(20):
            fn(*args_)
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for name, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn(*args_)
            sync()
            times[name].append((time.perf_counter() - t0) / args.calls * 1e6)
    return [statistics.median(times[k]) for k in fns]


def _overlap(comm, args, dev, sync):
    n = args.overlap_mib * 2**20 // 4
    src, dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
    if args.grad:  # NOTE [differentiable in-place calls]: the call's input needs a gradient
        src.requires_grad_()
    a = torch.randn(args.gemm, args.gemm, device=dev) / args.gemm**0.5

    def chain(x):
        for _ in range(args.chain):
            x = x @ a
        return x

    def gemm(x):
        return chain(x)

    def target():  # with --grad (or --local-out) made inside the function, as a forward's is
        return torch.empty(n, device=dev) if args.grad or args.local_out else dst

    def comm_only(x):
        o = target()
        comm.all_gather_single(o, src, True).wait()
        return x + 1, o

    def both(x, async_op):
        o = target()
        w = comm.all_gather_single(o, src, async_op)
        y = chain(x)
        w.wait()
        return y, o

    opts = {"reorder_for_peak_memory": False} if args.no_memory_reorder else None
    fns = {
        "gemm": torch.compile(gemm, fullgraph=True, options=opts),
        "comm": torch.compile(comm_only, fullgraph=True, options=opts),
        "async": torch.compile(lambda x: both(x, True), fullgraph=True, options=opts),
        "sync": torch.compile(lambda x: both(x, False), fullgraph=True, options=opts),
    }
    cuda = dev.type == "cuda"

    def timed(fn):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            # a queued wait first, so the host issues the whole call before the stream reaches
            # it: the events time the device's work, not the Python call
            torch.cuda._sleep(args.sleep_cycles)
            s.record()
            fn(a)
            e.record()
            e.synchronize()
            return s.elapsed_time(e) * 1e3
        t0 = time.perf_counter()
        fn(a)
        return (time.perf_counter() - t0) * 1e6

    for fn in fns.values():  # the compiles, a warm-up
        for _ in range(3):
            fn(a)
    sync()
    assert torch.equal(fns["comm"](a)[1], src), "all_gather_single at world 1 copies its input"
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        for k, fn in fns.items():
            times[k].extend(timed(fn) for _ in range(5))
    med = {k: statistics.median(v) for k, v in times.items()}
    hidden = (med["gemm"] + med["comm"] - med["async"]) / med["comm"]
    hidden_sync = (med["gemm"] + med["comm"] - med["sync"]) / med["comm"]
    print(
        f"overlap: all_gather_single {args.overlap_mib} MiB beside {args.chain} matmuls "
        f"{args.gemm}^3 float32{', its input needing a gradient' if args.grad else ''}"
        f"{', its output made inside the function' if args.grad or args.local_out else ''}"
        f"{', reorder_for_peak_memory off' if args.no_memory_reorder else ''}, "
        f"us per call, median of {args.rounds} rounds of 5"
    )
    print("  " + "  ".join(f"{k} {v:.1f}" for k, v in med.items()))
    print(f"  hidden: async {hidden:.1%}, sync {hidden_sync:.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl"))
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--sizes", default="16,65536,1048576", help="float32 elements, comma-separated")
    ap.add_argument("--only", default="host,overlap")
    ap.add_argument("--overlap-mib", type=int, default=64)
    ap.add_argument("--gemm", type=int, default=1024)
    ap.add_argument("--chain", type=int, default=4)
    ap.add_argument(
        "--grad", action="store_true", help="overlap: the gathered tensor needs a gradient"
    )
    ap.add_argument(
        "--local-out", action="store_true", help="overlap: the output made inside the function"
    )
    ap.add_argument(
        "--no-memory-reorder",
        action="store_true",
        help="overlap: compile with inductor's reorder_for_peak_memory off",
    )
    ap.add_argument("--sleep-cycles", type=int, default=5_000_000, help="CUDA: the queued wait")
    args = ap.parse_args()

    import fastcomms

    dev = torch.device("cuda:0" if args.backend == "nccl" else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    os.environ.setdefault("TORCHCOMM_RANK", "0")
    os.environ.setdefault("TORCHCOMM_SIZE", "1")
    with tempfile.TemporaryDirectory() as d:
        store = dist.FileStore(os.path.join(d, "store"), 1)
        comm = fastcomms.new_comm(args.backend, dev, "overhead", store=store)
        gpu = f", {torch.cuda.get_device_name(dev)}" if dev.type == "cuda" else ""
        print(
            f"torch {torch.__version__}, fastcomms {fastcomms.__version__}, {args.backend}, "
            f"{os.cpu_count()} CPUs{gpu}"
        )
        only = args.only.split(",")
        if "host" in only:
            _host(comm, args, dev, sync)
        if "overlap" in only:
            _overlap(comm, args, dev, sync)
        comm.finalize()


if __name__ == "__main__":
    main()
