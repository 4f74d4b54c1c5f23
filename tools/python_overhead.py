# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Python package's own cost per UlyssesGroup call, without any transport work: world 1 over
gloo on CPU, the group's transport replaced by a stub whose call returns a finished work at once,
so what is timed is argument handling, checks, shape lookup and dispatch (NOTE [host cost per
call]). Median of 7 rounds of N back-to-back calls after a warm-up; no device needed.

Usage: python3 tools/python_overhead.py [--calls 20000]"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist


class _Done:
    def wait(self):
        pass


class _Stub:
    """The real transport's shapes; its exchange does nothing."""

    def __init__(self, t):
        self._t = t

    def all_to_all_4d(self, *args):
        return _Done()

    def output_shape(self, *args):
        return self._t.output_shape(*args)


def _median_us(fn, calls):
    for _ in range(max(1, calls // 20)):
        fn()
    rounds = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(rounds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    a = ap.parse_args()
    from fastcomms.ulysses import UlyssesGroup

    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group(
            "gloo", store=dist.FileStore(os.path.join(d, "s"), 1), rank=0, world_size=1
        )
        g = UlyssesGroup(None)
        g._t = _Stub(g._t)
        x = torch.randn(1, 64, 40, 128)
        z = torch.empty_like(x)
        rows = [
            ("zero copy (out=)", lambda: g.all_to_all_4d(x, out=z)),
            ("copying (out=None)", lambda: g.all_to_all_4d(x)),
            ("torch.empty of the output (floor of the copying call)", lambda: torch.empty(x.shape)),
        ]
        for what, fn in rows:
            print(f"{what:56s} {_median_us(fn, a.calls):6.2f} us per call")
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
