# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torch.distributed's own torchcomms switch (``dist.config.use_torchcomms``) on fastcomms
(issue 15): with a module named ``torchcomms`` that aliases fastcomms (the four lines
docs/torchcomms.md shows), init_process_group and new_group make fastcomms communicators and
torch's collectives run on them; world 3 over gloo, a subgroup of two of the ranks."""

import os
import subprocess
import sys

from conftest import free_port

HERE = os.path.dirname(os.path.abspath(__file__))

ALIAS = """\
import sys
import fastcomms
import fastcomms._comms
import fastcomms.hooks
sys.modules["torchcomms._comms"] = fastcomms._comms
sys.modules["torchcomms.hooks"] = fastcomms.hooks
from fastcomms import *  # noqa: F401,F403
"""


def test_torch_switch_runs_on_fastcomms(tmp_path):
    (tmp_path / "torchcomms").mkdir()
    (tmp_path / "torchcomms" / "__init__.py").write_text(ALIAS)
    size, port = 3, free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *(p for p in sys.path if p)])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(size))
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "torch_switch_worker.py")],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(size)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=120)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0] + "\n(killed after 120 s)")
    report = "\n".join(
        f"--- rank {r} (exit {p.returncode}) ---\n{o}"
        for r, (p, o) in enumerate(zip(procs, outs, strict=True))
    )
    assert all(p.returncode == 0 for p in procs), report
    assert all(f"rank {r}: ok" in o for r, o in enumerate(outs)), report
