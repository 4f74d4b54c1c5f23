# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Python CLI: doctor answers, bench runs two CPU ranks and checks every result."""

import os
import subprocess
import sys

import pytest
import torch

ENV = dict(os.environ)


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "fastcomms", *args],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )


def test_doctor():
    r = _run("doctor")
    assert r.returncode == 0, r.stderr
    assert "backends    " in r.stdout and "gloo" in r.stdout
    # this machine (CI) has no GPU: CPU tensors take gloo, and doctor says why
    assert "transport   CPU tensors: the collective path over gloo (no CUDA device)" in r.stdout


def test_bench_checks_every_result():
    r = _run(
        "bench",
        "--nproc",
        "2",
        "--shape",
        "1,64,8,16",
        "--dtype",
        "float32",
        "--iters",
        "3",
        "--warmup",
        "1",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    assert "(1, 64, 8, 16)" in r.stdout or "[1, 64, 8, 16]" in r.stdout


def test_bench_refuses_gpu_backends_clearly():
    r = _run("bench", "--backend", "nvlink", "--nproc", "2")
    assert r.returncode == 2
    assert "--backend nvlink with --nproc 2 needs 2 GPUs" in r.stderr
    assert "this machine has 0" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without GPUs")
def test_nvlink_matrix_is_none_not_a_guess_without_nvml():
    import fastcomms

    assert fastcomms.nvlink_matrix([0, 1]) is None


def test_check_every_op(tmp_path):
    out = tmp_path / "check.json"
    r = _run("check", "--backend", "gloo", "--nproc", "3", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all checks passed" in r.stdout
    import json

    res = json.loads(out.read_text())
    assert res["backend"] == "gloo" and len(res["results"]) == 10
    assert all(row["ok"] for row in res["results"]), res


@pytest.mark.skipif(torch.cuda.is_available(), reason="the control needs a machine without GPUs")
def test_check_reports_a_failure():
    # armed control: the nccl backend cannot start on this CPU machine; check says so and fails
    r = _run("check", "--backend", "nccl", "--nproc", "2")
    assert r.returncode == 1 and "FAIL" in r.stdout, r.stdout + r.stderr
