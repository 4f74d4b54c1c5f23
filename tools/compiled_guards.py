# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The guard check a compiled Ulysses call pays before its graph runs: each compiled function's
guards (torch.compile, fullgraph) checked alone, µs per check, for the functional form
(``all_to_all_4d(t, g) + 1``), the method (``g.all_to_all_4d(t) + 1``), the op called directly
(``torch.ops.fastcomms.ulysses_all_to_all_4d(t, gid, 0, None, None, 1) + 1``) and ``t + 1``
alone. The variants interleaved round by round, medians. World 1 over gloo on CPU; no device
needed. A benchmark, not a test. Usage: python3 tools/compiled_guards.py [--rounds 9]"""

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch._dynamo.eval_frame import _debug_get_cache_entry_list


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--checks", type=int, default=20000)
    args = ap.parse_args()
    from fastcomms.ulysses import UlyssesGroup
    from fastcomms.ulysses import all_to_all_4d as functional

    path = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
    g = UlyssesGroup(None, device=torch.device("cpu"))
    x, gid, op = torch.randn(1, 16, 8, 16), g._id, torch.ops.fastcomms.ulysses_all_to_all_4d
    bodies = {
        "functional": lambda t: functional(t, g) + 1,
        "method": lambda t: g.all_to_all_4d(t) + 1,
        "torch.ops": lambda t: op(t, gid, 0, None, None, 1) + 1,
        "alone": lambda t: t + 1,
    }
    checks = {}
    for name, body in bodies.items():
        assert torch.equal(torch.compile(body, fullgraph=True)(x), x + 1), name
        (entry,) = _debug_get_cache_entry_list(body.__code__)
        # the frame's locals as the guards read them: the argument and the closure's cells
        cells = zip(body.__code__.co_freevars, body.__closure__ or (), strict=True)
        frame = {"t": x, **{k: c.cell_contents for k, c in cells}}
        checks[name] = (entry.guard_manager.check, frame)
        assert entry.guard_manager.check(frame), name
    samples = {k: [] for k in checks}
    for _ in range(args.rounds):
        for name, (check, frame) in checks.items():
            t0 = time.perf_counter()
            for _ in range(args.checks):
                check(frame)
            samples[name].append((time.perf_counter() - t0) * 1e6 / args.checks)
    print({k: round(statistics.median(v), 2) for k, v in samples.items()})
    g.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
