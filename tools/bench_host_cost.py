# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Host cost of a communicator call from Python (issue 36): a loop of ``--calls``
``comm.all_reduce(t, ReduceOp.SUM, False)`` on a 1-element float32 CPU tensor at world 1 over
gloo, and the same loop with the communicator's extension object replaced by a stub that returns
at once (the Python method alone, which the gloo round trip otherwise hides). Each ``--tree``
is a directory holding a ``fastcomms`` package (put before the build's extension on PYTHONPATH);
the trees run in turn, one process per tree and round, interleaved; the table gives the median
over every timed loop, µs per call. It also gives, per process, what starting costs: importing
fastcomms once torch is imported, and the process's first ``new_comm`` (ms, median over the
rounds).

Usage: python3 tools/bench_host_cost.py --tree before=/tmp/old --tree after=python
       [--rounds 7] [--calls 2000] [--build build/python]"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def child(calls: int, loops: int) -> None:
    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    import fastcomms
    from fastcomms import ReduceOp

    start = {"import_ms": [(time.perf_counter() - t0) * 1e3]}
    os.environ.update(TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1")
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        comm = fastcomms.new_comm("gloo", "cpu", "host_cost", store=dist.FileStore(f"{d}/s", 1))
        start["new_comm_ms"] = [(time.perf_counter() - t0) * 1e3]
        t = torch.ones(1)

        def loop():
            t0 = time.perf_counter()
            for _ in range(calls):
                comm.all_reduce(t, ReduceOp.SUM, False)
            return (time.perf_counter() - t0) / calls * 1e6

        class Stub:  # the extension's all_reduce, returning at once
            def all_reduce(self, *args):
                return None

        loop()  # warm-up
        out = {"gloo": [loop() for _ in range(loops)]}
        real, comm._c = comm._c, Stub()
        loop()
        out["stub"] = [loop() for _ in range(loops)]
        comm._c = real
        comm.finalize()
    print(json.dumps({**out, **start}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", action="append", default=[], help="name=directory")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--loops", type=int, default=3, help="timed loops per process")
    p.add_argument("--build", default="build/python")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.child:
        return child(a.calls, a.loops)
    trees = dict(t.split("=", 1) for t in a.tree)
    got = {name: {k: [] for k in ("gloo", "stub", "import_ms", "new_comm_ms")} for name in trees}
    for r in range(a.rounds):
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=f"{os.path.abspath(tree)}:{os.path.abspath(a.build)}")
            cmd = [sys.executable, __file__, "--child", "--calls", str(a.calls)]
            cmd += ["--loops", str(a.loops)]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True).stdout)
            for k, v in res.items():
                got[name][k] += v
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print(
        "| tree | gloo, µs per call | stub, µs per call | import fastcomms, ms "
        "| first new_comm, ms |"
    )
    print("|---|---|---|---|---|")
    for name, v in got.items():
        med = {k: statistics.median(x) for k, x in v.items()}
        print(
            f"| {name} | {med['gloo']:.2f} | {med['stub']:.2f} | {med['import_ms']:.0f} "
            f"| {med['new_comm_ms']:.0f} |"
        )


if __name__ == "__main__":
    main()
