# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Type information as users' tools see it: mypy accepts examples/typed_usage.py through the
package's py.typed and the extension's stub, and rejects a misuse that only the stub can name
(so the check can fail)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MYPY = shutil.which("mypy", path=os.path.dirname(sys.executable)) or shutil.which("mypy")


def _mypy(path, tmp_path):
    env = dict(os.environ, MYPYPATH=str(ROOT / "python"))
    return subprocess.run(
        [MYPY, "--follow-imports=silent", "--cache-dir", str(tmp_path / "cache"), str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


@pytest.mark.skipif(MYPY is None, reason="mypy is not installed (requirements-dev.txt has it)")
def test_mypy_sees_the_api(tmp_path):
    assert (ROOT / "python/fastcomms/py.typed").exists()
    assert (ROOT / "python/fastcomms/_C.pyi").exists()
    ok = _mypy(ROOT / "examples/typed_usage.py", tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import fastcomms\n"
        "from fastcomms import RedOpType\n"
        "x: int = RedOpType.SUM\n"
        "y = fastcomms._C.Comm.no_such_method\n"
    )
    r = _mypy(bad, tmp_path)
    assert r.returncode != 0
    assert "bad.py:3" in r.stdout and "RedOpType" in r.stdout, r.stdout
    assert "bad.py:4" in r.stdout and "no_such_method" in r.stdout, r.stdout


def test_typed_example_runs():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples/typed_usage.py")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0 and "rank 0/1" in r.stdout, r.stdout + r.stderr
