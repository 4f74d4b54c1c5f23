# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""NOTE [process abort]: with abort_process_on_timeout_or_error the process aborts on a timeout,
and the communicator's abort hooks run first, also where the abort starts on a backend's own
thread (the nccl watchdog); a hook that never returns delays the abort by ProcessAbort::kHookGrace
(10 s) at most. Ranks are processes (process_abort_worker.py); the control without the option
raises TimeoutError and runs no hook."""

import os
import signal
import subprocess
import sys
import tempfile
import time

import fastcomms
import pytest
import torch

needs_gloo = pytest.mark.skipif(
    not fastcomms.is_backend_built("gloo"), reason="this build has no gloo backend"
)
WORKER = os.path.join(os.path.dirname(__file__), "process_abort_worker.py")


def _run(backend, size, hook, sync="sync"):
    """Runs the worker's ranks; returns (rank 0's exit code, its output, the marker's text or
    None, seconds rank 0 took)."""
    with tempfile.TemporaryDirectory() as d:
        store, marker = os.path.join(d, "store"), os.path.join(d, "marker")
        args = [backend, None, str(size), store, hook, marker, sync]
        procs = [
            subprocess.Popen(
                [sys.executable, WORKER, *[str(r) if a is None else a for a in args]],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(size)
        ]
        t0 = time.monotonic()
        out, _ = procs[0].communicate(timeout=120)
        took = time.monotonic() - t0
        for p in procs[1:]:
            p.kill()
            p.wait()
        text = open(marker).read() if os.path.exists(marker) else None
        return procs[0].returncode, out, text, took


@needs_gloo
@pytest.mark.parametrize("hook,sync", [("write", "sync"), ("block", "sync"), ("write", "async")])
def test_timeout_aborts_the_process_after_the_abort_hooks(hook, sync):
    """Also an async op's timeout, which the wait on its work raises."""
    code, out, marker, took = _run("gloo", 2, hook, sync)
    assert code == -signal.SIGABRT, (code, out)
    assert "aborting the process (abort_process_on_timeout_or_error)" in out, out
    assert "timed out" in out, out
    assert marker is not None and "abort hook ran" in marker, out
    if hook == "block":  # the grace bounds a hook that never returns
        assert "did not finish within 10 s" in out, out
        assert took < 60, took


@needs_gloo
@pytest.mark.parametrize("sync", ["sync", "async"])
def test_control_without_the_option_raises_and_runs_no_hook(sync):
    code, out, marker, _ = _run("gloo", 2, "off", sync)
    assert code == 3 and "raised TimeoutError" in out, (code, out)
    assert marker is None


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the GPU tier runs in scripts/gpu.sh)",
)
@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_watchdog_timeout_runs_the_abort_hooks_first(backend):
    """A world of one whose op waits behind a 30 s kernel: the backend's watchdog finds it
    overdue after the 1 s timeout and aborts the process, the hooks first (before NOTE [process
    abort] it called std::abort() itself and no hook ran)."""
    code, out, marker, took = _run(backend, 1, "write")
    assert code == -signal.SIGABRT, (code, out)
    assert "all_reduce (op " in out and "timed out after 1000 ms" in out, out
    assert marker is not None and "abort hook ran" in marker, out
    assert took < 30, took
