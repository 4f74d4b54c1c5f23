# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What the call checks (NOTE [call check modes]) cost per call on CPU: ranks as processes over
gloo on loopback, one communicator per variant on one TCPStore (as a torchrun job has), all_reduce,
all_to_all_single and a send/recv ring at 4 B, 4 KiB and 1 MiB. Variants: the checks off (0), the
default (1: fingerprint tags, the probe of slow calls, point-to-point headers), gloo's strict
in-band check (one allgather of the records before each collective), the communicator's strict
check through the store (the path nccl, nvlink and backend libraries take, here forced on gloo
with gloo's own off), and torch.distributed's own gloo on the same store. Every round times N
back-to-back calls of each variant in turn (interleaved); median of the rounds, slowest rank.

Usage: python3 tools/bench_call_check.py [--nproc 2] [--calls 200] [--rounds 7]"""

import argparse
import datetime
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp

VARIANTS = {
    "off": {"check_calls": "0", "gloo.check_calls": "0"},
    "default": {"check_calls": "0", "gloo.check_calls": "1"},
    "in band": {"gloo.check_calls": "strict"},
    "store": {"check_calls": "strict", "gloo.check_calls": "0"},
}
SIZES = [("4 B", 1), ("4 KiB", 1 << 10), ("1 MiB", 1 << 18)]  # float32 elements (per peer
# for all_to_all_single)


class _Torch:
    """torch.distributed's gloo default group with the communicator's method names."""

    def all_reduce(self, t, op, async_op):
        import torch.distributed as dist

        dist.all_reduce(t)

    def all_to_all_single(self, o, t, async_op):
        import torch.distributed as dist

        dist.all_to_all_single(o, t)

    def send(self, t, dst, async_op):
        import torch.distributed as dist

        dist.send(t, dst)

    def recv(self, t, src, async_op):
        import torch.distributed as dist

        dist.recv(t, src)

    def get_rank(self):
        import torch.distributed as dist

        return dist.get_rank()

    def finalize(self):
        pass


def _rank(rank, size, port, calls, rounds, q):
    import fastcomms
    import torch.distributed as dist

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    store = dist.TCPStore(
        "127.0.0.1", port, size, rank == 0, timeout=datetime.timedelta(seconds=60)
    )
    comms = {
        v: fastcomms.new_comm("gloo", "cpu", f"cc-{i}", store=store, hints=h)
        for i, (v, h) in enumerate(VARIANTS.items())
    }
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("torch", store), rank=rank, world_size=size
    )
    comms["torch gloo"] = _Torch()

    def ring(c, t, o):  # even ranks send first
        nxt, prv = (rank + 1) % size, (rank - 1) % size
        if rank % 2 == 0:
            c.send(t, nxt, False)
            c.recv(o, prv, False)
        else:
            c.recv(o, prv, False)
            c.send(t, nxt, False)

    ops = {
        "all_reduce": lambda c, t, o: c.all_reduce(t, fastcomms.ReduceOp.SUM, False),
        "all_to_all_single": lambda c, t, o: c.all_to_all_single(o, t, False),
        "send/recv ring": ring,
    }
    times = {}
    for op, fn in ops.items():
        for label, n in SIZES:
            count = n * (size if op == "all_to_all_single" else 1)
            t, o = torch.ones(count), torch.empty(count)
            for c in comms.values():  # warm-up
                for _ in range(max(1, calls // 10)):
                    fn(c, t, o)
            for _ in range(rounds):
                for v, c in comms.items():
                    start = time.perf_counter()
                    for _ in range(calls):
                        fn(c, t, o)
                    times.setdefault((op, label, v), []).append(
                        (time.perf_counter() - start) / calls * 1e6
                    )
    q.put((rank, {k: statistics.median(v) for k, v in times.items()}))
    for c in comms.values():
        c.finalize()


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_rank, args=(r, a.nproc, port, a.calls, a.rounds, q))
        for r in range(a.nproc)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}")
    per_rank = [q.get()[1] for _ in procs]
    slowest = {k: max(r[k] for r in per_rank) for k in per_rank[0]}
    print(
        f"call check cost: {a.nproc} ranks, gloo on loopback, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs, {a.calls} calls x {a.rounds} interleaved rounds, "
        "median us per call, slowest rank"
    )
    names = [*VARIANTS, "torch gloo"]
    print("| op | size | " + " | ".join(names) + " | default − off | default / off |")
    print("|---" * (4 + len(names)) + "|")
    for op in ("all_reduce", "all_to_all_single", "send/recv ring"):
        for label, _ in SIZES:
            v = {k: slowest.get((op, label, k)) for k in names}
            cells = " | ".join("" if v[k] is None else f"{v[k]:.1f}" for k in names)
            d, o = v["default"], v["off"]
            print(f"| {op} | {label} | {cells} | {d - o:+.1f} | {100 * (d / o - 1):+.1f}% |")


if __name__ == "__main__":
    main()
