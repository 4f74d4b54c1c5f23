# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""examples/train_ulysses_fsdp.py on CPU (issue 15): 4 processes as a 2 x 2 mesh (Ulysses over
"sp", FSDP2 over "dp") train a few steps and match a one-process reference; the armed control
(attention over the local shard only) must be caught by the same check."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(ROOT, "examples", "train_ulysses_fsdp.py")


def _run(*extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return subprocess.run(
        [
            sys.executable,
            EXAMPLE,
            "--backend",
            "gloo",
            "--sp",
            "2",
            "--dp",
            "2",
            "--steps",
            "4",
            "--check",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )


def test_example_matches_reference():
    # fastcomms and the torch.distributed baseline, interleaved in the same processes: both
    # must match the reference (the baseline is what the GPU benchmark compares with)
    r = _run("--compare")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "loss matches the reference" in r.stdout, r.stdout
    assert "losses (torch baseline" in r.stdout and "losses (gloo" in r.stdout, r.stdout
    assert "step time ratio baseline / fastcomms" in r.stdout, r.stdout


def test_example_control_is_caught():
    r = _run("--fault-local-attention")
    assert r.returncode == 1 and "MISMATCH" in r.stdout, r.stdout + r.stderr
