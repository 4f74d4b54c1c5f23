# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""README's quickstart, as written (issue 35): each block marked ``<!-- quickstart: NAME -->`` is
taken from README.md and run the way the README says: the two scripts under real torchrun with 2
ranks (CPU, gloo), the bench command through the package's entry point (with fewer iterations)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_launch import _env, _port  # noqa: E402


def _block(name):
    text = open(os.path.join(ROOT, "README.md")).read()
    m = re.search(rf"<!-- quickstart: {re.escape(name)} -->\n```\w+\n(.*?)```", text, re.S)
    assert m, f"README.md has no quickstart block {name!r}"
    return m.group(1)


@pytest.mark.parametrize("name", ["torchcomms", "fast-ulysses"])
def test_quickstart_script_under_torchrun(tmp_path, name):
    script = tmp_path / "quickstart.py"
    script.write_text(_block(name))
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(_port()), str(script)],
        capture_output=True, text=True, timeout=240, env=_env(),
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    for rank in (0, 1):
        assert f"rank {rank}" in r.stdout, r.stdout
    if name == "torchcomms":
        assert r.stdout.count("[3.0, 3.0, 3.0, 3.0]") == 2, r.stdout


def test_quickstart_bench():
    words = _block("bench").split()
    assert words[:2] == ["fastcomms", "bench"], words
    r = subprocess.run(
        [sys.executable, "-m", "fastcomms", *words[1:], "--iters", "2", "--rounds", "2",
         "--warmup", "1", "--no-progress"],
        capture_output=True, text=True, timeout=300, env=_env(),
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-5000:]
    assert "backend gloo" in r.stdout and "(no CUDA device: CPU ranks over gloo)" in r.stdout
