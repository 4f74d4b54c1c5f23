# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Host cost of a communicator call with and without hooks (issue 54, item 3): a loop
of ``--calls`` ``comm.all_reduce(t, ReduceOp.SUM, False)`` on a 1-element float32 CPU tensor at
world 1 over gloo (``eager``), and the same through the communicator's torch.distributed process
group, ``dist.all_reduce(t, group=pg)`` (``pg``: NOTE [process group fast path]), each with no
hook, with a ``FlightRecorderHook`` registered (``+fr``) and with a Python pre-hook that does
nothing (``+hook``: NOTE [hooks on the fast path]) and with a ``clog`` writing every event to a
file (``+clog``: NOTE [clog]); the same call compiled (``compiled``: ``torch.compile`` of a
function making it, NOTE [compiled calls in C++]), without and with the pre-hook; and the call on
the "fake" backend, which is written in Python (``fake``: NOTE [python backend trampoline]),
without hooks, with the recorder and with the pre-hook. Each ``--tree`` is
``name=package_dir:build_dir`` (the ``fastcomms`` package and the build holding its extension);
the trees run in turn, one process per tree and round, interleaved, and inside a process the
kinds alternate loop by loop. The table gives the median over every timed loop, µs per call,
and the ratios with a hook to without.

Usage: python3 tools/bench_hook_cost.py --tree before=/work/main/python:/work/main/build/python \\
       --tree after=python:build/python [--rounds 5] [--calls 2000] [--loops 3]"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

KINDS = (
    "eager",
    "eager+fr",
    "eager+hook",
    "eager+clog",
    "pg",
    "pg+fr",
    "pg+hook",
    "pg+clog",
    "compiled",
    "compiled+hook",
    "fake",
    "fake+fr",
    "fake+hook",
)


def child(calls: int, loops: int) -> None:
    import fastcomms
    import torch
    import torch.distributed as dist
    from fastcomms import ReduceOp
    from fastcomms.device_mesh import _create_torchcomm_process_group
    from fastcomms.hooks import FlightRecorderHook, clog

    os.environ.update(TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1")
    out = {k: [] for k in KINDS}
    with tempfile.TemporaryDirectory() as d:
        comm = fastcomms.new_comm("gloo", "cpu", "hook_cost", store=dist.FileStore(f"{d}/s", 1))
        pg = _create_torchcomm_process_group(comm, "hook_cost_pg")
        fake = fastcomms.new_comm("fake", "cpu", "hook_cost_fake")
        t = torch.ones(1)

        def eager():
            comm.all_reduce(t, ReduceOp.SUM, False)

        def via_pg():
            dist.all_reduce(t, group=pg)

        def step(x):
            comm.all_reduce(x, ReduceOp.SUM, False)

        step = torch.compile(step, fullgraph=True, backend="inductor")

        def compiled():
            step(t)

        def on_fake():
            fake.all_reduce(t, ReduceOp.SUM, False)

        fns = {"eager": eager, "pg": via_pg, "compiled": compiled, "fake": on_fake}

        def loop(fn):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - t0) / calls * 1e6

        for fn in fns.values():  # warm-up
            loop(fn)
        for _ in range(loops):
            for kind in KINDS:
                rec = hook = None  # a FlightRecorderHook or a clog
                on = fake if kind.startswith("fake") else comm
                fn = fns[kind.split("+")[0]]
                if kind.endswith("+fr"):
                    rec = FlightRecorderHook(max_entries=2048)
                    rec.register_with_comm(on)
                if kind.endswith("+hook"):
                    hook = on.register_pre_hook(lambda name, op_id, args: None)
                if kind.endswith("+clog"):
                    rec = clog(os.path.join(d, "clog.log"), ["ALL"])
                    rec.register_with_comm(on)
                fn()  # (a compiled call may recompile when a hook comes or goes)
                out[kind].append(loop(fn))
                if rec is not None:
                    rec.unregister()
                    if kind.endswith("+clog"):
                        rec.close()
                if hook is not None:
                    hook.remove()
        fake.finalize()
        comm.finalize()
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", action="append", default=[], help="name=package_dir:build_dir")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--loops", type=int, default=3, help="timed loops per kind and process")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    if a.child:
        return child(a.calls, a.loops)
    trees = dict(t.split("=", 1) for t in a.tree)
    got = {name: {k: [] for k in KINDS} for name in trees}
    for _ in range(a.rounds):
        for name, dirs in trees.items():
            pkg, build = dirs.split(":", 1)
            path = f"{os.path.abspath(pkg)}:{os.path.abspath(build)}"
            env = dict(os.environ, PYTHONPATH=path)
            cmd = [sys.executable, __file__, "--child", "--calls", str(a.calls)]
            cmd += ["--loops", str(a.loops)]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True).stdout)
            for k, v in res.items():
                got[name][k] += v
    ratios = [(k, "eager") for k in ("compiled", "fake")]
    ratios += [(k, k.split("+")[0]) for k in KINDS if "+" in k]
    med = {n: {k: statistics.median(v) for k, v in res.items()} for n, res in got.items()}
    print("| call, µs (ratio: median over median) | " + " | ".join(trees) + " |")
    print("|---" * (len(trees) + 1) + "|")
    for k in KINDS:
        print(f"| {k} | " + " | ".join(f"{med[n][k]:.1f}" for n in trees) + " |")
    for a_, b_ in ratios:
        cells = " | ".join(f"{med[n][a_] / med[n][b_]:.2f}x" for n in trees)
        print(f"| {a_} / {b_} | {cells} |")


if __name__ == "__main__":
    main()
