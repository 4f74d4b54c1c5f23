# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What the nccl backend's default call check (FASTCOMMS_CHECK_CALLS=1, NOTE [nccl call check])
costs per call on CUDA: one communicator per variant on one store, all_reduce (SUM, float32, in
place) and all_gather_single (each rank's input of SIZE bytes, output world x SIZE) at 4 KiB,
1 MiB and 64 MiB. Variants: check off (0), the default (1: the 16-byte all-gather before the op,
its landing copy on a side stream); optionally the hints' placements (fuse: the all-gather in the
op's own NCCL group; host: fingerprints in mapped pinned host memory; fuse+host) and torch's own
NCCL process group. Every round times N back-to-back calls of every variant in turn (the order
reversed every other round, so drift falls on both), after a warm-up whose first call also checks
the result; a round is wall-clock time from a synchronized start to a synchronized end, divided
by N. Reported: the median of the rounds per rank, the slowest rank's, in microseconds per call,
and each variant's cost over the check off.

Usage (2 ranks, one GPU each):
  python3 tools/gpu/bench_call_check.py [--nproc 2] [--rounds 9] [--variants 0,1,fuse,host,torch]
  torchrun --nproc-per-node 2 tools/gpu/bench_call_check.py [...]
--share puts the ranks round-robin on the GPUs there are (then the numbers are of HBM copies and
time slices, not of NVLink: record them as such)."""

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

VARIANTS = {  # the communicator's hints per variant (every rank the same)
    "0": {"check_calls": "0"},
    "1": {"check_calls": "1"},
    "fuse": {"check_calls": "1", "nccl.check_calls_fuse": "1"},
    "host": {"check_calls": "1", "nccl.check_calls_memory": "host"},
    "fuse+host": {
        "check_calls": "1",
        "nccl.check_calls_fuse": "1",
        "nccl.check_calls_memory": "host",
    },
}
SIZES = [("4 KiB", 4 << 10, 400), ("1 MiB", 1 << 20, 200), ("64 MiB", 64 << 20, 20)]
OPS = ("all_reduce", "all_gather")


class _TorchNccl:
    """torch.distributed's NCCL group with the communicator's method names."""

    def __init__(self, group):
        self.group = group

    def all_reduce(self, t, op, async_op):
        import torch.distributed as dist

        return dist.all_reduce(t, group=self.group, async_op=async_op)

    def all_gather_single(self, out, t, async_op):
        import torch.distributed as dist

        return dist.all_gather_into_tensor(out, t, group=self.group, async_op=async_op)

    def finalize(self):
        pass


def _rank(rank, world, args, store_path):
    import fastcomms
    import torch
    import torch.distributed as dist

    if store_path is None:  # torchrun: its rendezvous store
        store, rank, world = next(dist.rendezvous("env://"))
        store.set_timeout(datetime.timedelta(seconds=300))
    else:
        store = dist.FileStore(store_path, world)
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.cpu:
        dev, backend, sync = torch.device("cpu"), "gloo", lambda: None
    else:
        dev = torch.device("cuda", local % torch.cuda.device_count() if args.share else local)
        backend, sync = "nccl", torch.cuda.synchronize
        torch.cuda.set_device(dev)
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(world)
    # A gloo group to line the ranks up and gather the results (no GPU work).
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("torch", store), rank=rank, world_size=world
    )
    comms = {}
    for i, v in enumerate(args.variants):
        if v == "torch":
            comms[v] = _TorchNccl(dist.new_group(backend=backend))
            continue
        comms[v] = fastcomms.new_comm(
            backend,
            dev,
            f"cc{i}",
            store=dist.PrefixStore(f"cc{i}", store),
            timeout=datetime.timedelta(seconds=120),
            hints=VARIANTS[v],
        )
    sum_ = fastcomms.ReduceOp.SUM
    big = max(n for _, n, _ in SIZES)
    buf = torch.ones(big // 4, dtype=torch.float32, device=dev)
    out = torch.empty(big // 4 * world, dtype=torch.float32, device=dev)

    def call(c, op, n, async_op):
        if op == "all_reduce":
            return c.all_reduce(buf[:n], sum_, async_op)
        return c.all_gather_single(out[: n * world], buf[:n], async_op)

    def timed(c, op, n, calls):
        dist.barrier()  # the ranks start together
        sync()
        t0 = time.perf_counter()
        works = [call(c, op, n, args.mode == "async") for _ in range(calls)]
        if args.mode == "async":
            for w in works:
                w.wait()
        sync()
        return (time.perf_counter() - t0) / calls * 1e6

    results, failed = {}, {}
    for op in OPS:
        for label, nbytes, base_calls in SIZES:
            n = nbytes // 4
            calls = max(1, int(base_calls * args.calls))
            live = {}
            for v, c in comms.items():  # warm-up; the first call's result is checked
                try:
                    buf[:n].fill_(1.0)
                    call(c, op, n, False)
                    sync()
                    want = float(world) if op == "all_reduce" else 1.0
                    got = buf[:n] if op == "all_reduce" else out[: n * world]
                    if not bool((got == want).all()):
                        raise RuntimeError(f"wrong result (expected {want} everywhere)")
                    buf[:n].zero_()  # sums of zeros stay finite however many calls
                    for _ in range(max(1, calls // 5)):
                        call(c, op, n, False)
                    sync()
                    live[v] = c
                except Exception as e:  # noqa: BLE001 - a variant that fails is reported
                    failed[v] = f"{type(e).__name__}: {str(e)[:200]}"
            order = [v for v in comms if v in live]
            for r in range(args.rounds):
                for v in order if r % 2 == 0 else reversed(order):
                    results.setdefault((op, label, v), []).append(timed(live[v], op, n, calls))
    medians = {k: statistics.median(v) for k, v in results.items()}
    gathered = [None] * world
    dist.all_gather_object(gathered, (medians, failed))
    for v, c in comms.items():
        try:
            c.finalize()
        except Exception as e:  # noqa: BLE001 - a failed variant may raise its error again
            failed.setdefault(v, f"finalize: {type(e).__name__}: {str(e)[:200]}")
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        _print(gathered, world, args, torch)


def _print(gathered, world, args, torch):
    import fastcomms

    slowest = {}
    for medians, _ in gathered:
        for k, us in medians.items():
            slowest[k] = max(slowest.get(k, 0.0), us)
    failed = {}
    for _, f in gathered:
        failed.update(f)
    nccl_env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("NCCL_"))
    if args.cpu:
        where, nccl = "CPU over gloo (a smoke run of this script: no NCCL, no nccl check)", "-"
    else:
        where, nccl = torch.cuda.get_device_name(0), torch.cuda.nccl.version()
        nccl = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    print(
        f"call check cost: {world} ranks, {where}"
        f"{' (ranks sharing GPUs)' if args.share else ''}, torch {torch.__version__}, NCCL "
        f"{nccl}, fastcomms "
        f"{getattr(fastcomms, '__version__', '?')}, {args.mode} calls, {args.rounds} interleaved "
        f"rounds, median us per call, slowest rank" + (f"; {nccl_env}" if nccl_env else "")
    )
    names = list(args.variants)
    extra = [v for v in names if v not in ("0", "torch")]
    head = ["op", "size", *[f"{v} us" for v in names]]
    head += [f"{v} - 0" for v in extra] + [f"{v} / 0" for v in extra]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for op in OPS:
        for label, _, _ in SIZES:
            t = {v: slowest.get((op, label, v)) for v in names}
            cells = [op, label] + ["failed" if t[v] is None else f"{t[v]:.1f}" for v in names]
            base = t.get("0")
            for v in extra:
                cells.append("" if None in (t[v], base) else f"{t[v] - base:+.1f}")
            for v in extra:
                cells.append("" if None in (t[v], base) else f"{100 * (t[v] / base - 1):+.1f}%")
            print("| " + " | ".join(cells) + " |")
    for v, why in failed.items():
        print(f"variant {v} failed: {why}")


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn (not under torchrun)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved timed rounds")
    ap.add_argument(
        "--calls", type=float, default=1.0, help="scales the calls per round (400/200/20)"
    )
    ap.add_argument(
        "--variants",
        default="0,1",
        help="comma-separated, from: " + ", ".join([*VARIANTS, "torch"]) + " (default 0,1)",
    )
    ap.add_argument("--mode", choices=("sync", "async"), default="sync")
    ap.add_argument("--share", action="store_true", help="ranks round-robin on the GPUs there are")
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="smoke-run the script on CPU over gloo (checks the script, measures nothing of nccl)",
    )
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in args.variants if v not in VARIANTS and v != "torch"]
    if bad or "0" not in args.variants:
        ap.error(f"unknown variants {bad}" if bad else "--variants must include 0 (the baseline)")

    import torch

    under_torchrun = "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else args.nproc
    need = 1 if under_torchrun or args.share else world
    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() < need):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"SKIPPED: bench_call_check needs {world} CUDA GPUs (or --share), found {have}")
        return 0
    if under_torchrun:
        _rank(int(os.environ["RANK"]), world, args, None)
        return 0
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(world, args, os.path.join(d, "store")), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
