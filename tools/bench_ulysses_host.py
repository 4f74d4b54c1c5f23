# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Host cost of an eager Ulysses call from Python on CPU (issue 54): world 1 over gloo, a
UlyssesGroup over a TorchComm, x of ``--shape`` (float32, small so that the copy is a few hundred
bytes and the call's own host work dominates). Timed forms: plain ``g.all_to_all_4d(x)``,
``out=`` into a preallocated buffer, FP8 on the wire (``wire_dtype=torch.float8_e4m3fn``:
quantize, two exchanges, dequantize on the host) and async (``g.all_to_all_4d_async(x).wait()``).
Each ``--tree`` is ``name=PYTHON_DIR:BUILD_PYTHON_DIR`` (a ``fastcomms`` package and the build
folder holding its extension); the trees run in turn, one process per tree and round, interleaved;
the table gives the median over every timed loop, µs per call.

Usage: python3 tools/bench_ulysses_host.py --tree before=/tmp/b/python:/tmp/b/build \\
       --tree after=python:build/python [--rounds 7] [--calls 2000]"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

FORMS = ("plain", "out", "fp8", "async")


def child(calls: int, loops: int, shape: list[int]) -> None:
    import fastcomms
    import torch
    import torch.distributed as dist
    from fastcomms.ulysses import UlyssesGroup

    os.environ.update(TORCHCOMM_RANK="0", TORCHCOMM_SIZE="1")
    with tempfile.TemporaryDirectory() as d:
        comm = fastcomms.new_comm("gloo", "cpu", "uly_host", store=dist.FileStore(f"{d}/s", 1))
        g = UlyssesGroup(comm)
        x = torch.randn(shape)
        z = torch.empty_like(x)
        fp8 = torch.float8_e4m3fn
        forms = {
            "plain": lambda: g.all_to_all_4d(x),
            "out": lambda: g.all_to_all_4d(x, out=z),
            "fp8": lambda: g.all_to_all_4d(x, wire_dtype=fp8),
            "async": lambda: g.all_to_all_4d_async(x).wait(),
        }
        out = {}
        for name, fn in forms.items():

            def loop(fn=fn):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                return (time.perf_counter() - t0) / calls * 1e6

            loop()  # warm-up
            out[name] = [loop() for _ in range(loops)]
        g.destroy()
        comm.finalize()
    print(json.dumps(out))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tree", action="append", default=[], help="name=PYTHON_DIR:BUILD_DIR")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--loops", type=int, default=3, help="timed loops per process and form")
    p.add_argument("--shape", default="1,4,8,16")
    p.add_argument("--child", action="store_true")
    a = p.parse_args()
    shape = [int(v) for v in a.shape.split(",")]
    if a.child:
        return child(a.calls, a.loops, shape)
    trees = dict(t.split("=", 1) for t in a.tree)
    got = {name: {k: [] for k in FORMS} for name in trees}
    for r in range(a.rounds):
        for name, tree in trees.items():
            py, build = (os.path.abspath(v) for v in tree.split(":"))
            env = dict(os.environ, PYTHONPATH=f"{py}:{build}")
            cmd = [sys.executable, __file__, "--child", "--calls", str(a.calls)]
            cmd += ["--loops", str(a.loops), "--shape", a.shape]
            res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True).stdout)
            for k, v in res.items():
                got[name][k] += v
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr)
    print("| tree | " + " | ".join(f"{f}, µs per call" for f in FORMS) + " |")
    print("|---|" + "---|" * len(FORMS))
    for name, v in got.items():
        print(f"| {name} | " + " | ".join(f"{statistics.median(v[f]):.2f}" for f in FORMS) + " |")


if __name__ == "__main__":
    main()
