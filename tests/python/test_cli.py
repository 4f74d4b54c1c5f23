# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The fastcomms command (console script, also python -m fastcomms): doctor and its preflight,
bench (ranks spawned or under torchrun, every result checked, --json, --plot), check, and the
release gate's rules (tools/wheel_gate.py) with controls that must fail."""

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
    # the launcher it detects (issue 35): none here, SLURM's variables when srun would set them
    assert "launcher    none (new_comm needs store=" in r.stdout, r.stdout
    env = {**ENV, "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "gpu[7-8]"}
    env = {k: v for k, v in env.items() if k not in ("RANK", "TORCHCOMM_RANK", "MASTER_ADDR")}
    r = subprocess.run(
        [sys.executable, "-m", "fastcomms", "doctor"], capture_output=True, text=True, env=env
    )
    assert "launcher    slurm: rank 1 of 4" in r.stdout and "gpu7:" in r.stdout, r.stdout


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
    assert "(1, 64, 8, 16)" in r.stdout
    assert "backend gloo (no CUDA device" in r.stdout or torch.cuda.is_available()


def test_bench_json_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    r = _run(
        "bench",
        "--nproc",
        "2",
        "--shape",
        "1,32,4,16",
        "--shape",
        "1,128,4,16",
        "--iters",
        "2",
        "--rounds",
        "2",
        "--warmup",
        "1",
        "--json",
        str(js),
        "--plot",
        str(png),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    doc = json.loads(js.read_text())
    assert [row["shape"] for row in doc["rows"]] == [[1, 32, 4, 16], [1, 128, 4, 16]]
    assert all(row["ok"] and row["ours_us"] > 0 and row["permute_us"] > 0 for row in doc["rows"])
    assert doc["backend"] == "gloo" and doc["environment"]["torch"] == torch.__version__
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_gpu_backends_clearly():
    r = _run("bench", "--backend", "nvlink", "--nproc", "2")
    assert r.returncode == 2
    assert "--backend nvlink needs a GPU; there is none" in r.stderr
    r = _run("bench", "--backend", "nccl", "--nproc", "2")
    assert r.returncode == 2
    assert "--backend nccl with 2 ranks on this host needs 2 GPUs" in r.stderr
    assert "this machine has 0" in r.stderr


def test_bench_ends_at_once_when_a_rank_dies():
    # armed control: an impossible shape raises on the ranks; the run ends with their error
    r = _run("bench", "--nproc", "2", "--shape", "1,8,3,16", "--iters", "1")
    assert r.returncode == 2 and "not divisible by 2 ranks" in r.stderr


def test_check_under_torchrun(tmp_path):
    from conftest import free_port

    port = free_port()  # for torchrun's store (its --master-port 0 hands the workers port 0)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(port),
            "-m",
            "fastcomms",
            "check",
            "--backend",
            "gloo",
            "--json",
            str(tmp_path / "c.json"),
        ],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    res = json.loads((tmp_path / "c.json").read_text())
    assert res["nproc"] == 2 and all(row["ok"] for row in res["results"]), res


def test_version_and_help():
    import fastcomms

    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"fastcomms {fastcomms.__version__}"
    r = _run("--help")
    assert r.returncode == 0 and all(c in r.stdout for c in ("bench", "check", "doctor"))


def test_doctor_preflight():
    r = _run("doctor", "--preflight")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "preflight passed" in r.stdout and "torch" in r.stdout


def test_preflight_flags_a_torch_mismatch():
    # armed control: a build made for another torch minor must be a FAIL with the fix
    from fastcomms import _C
    from fastcomms.cli import preflight_checks

    info = dict(_C.build_info())
    rows = {r[0]: r for r in preflight_checks(info)}
    assert rows["torch"][1] == "OK"
    info["torch"] = "2.9.1"
    rows = {r[0]: r for r in preflight_checks(info)}
    assert rows["torch"][1] == "FAIL" and "torch==2.9.*" in rows["torch"][3]


def test_wheel_gate_rules_can_fail():
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    import wheel_gate

    meta = (
        "Metadata-Version: 2.4\nName: fastcomms\nVersion: 0.1.0\nRequires-Python: >=3.10\n"
        "License-Expression: Apache-2.0\nRequires-Dist: torch==2.11.*\nRequires-Dist: rich>=13\n"
    )
    assert wheel_gate.check_metadata(meta, "2.11", "0.1.0") == []
    assert wheel_gate.check_metadata(
        meta.replace("torch==2.11.*", "torch==2.11.0"), "2.11", "0.1.0"
    )
    assert wheel_gate.check_metadata(meta, "2.12", "0.1.0")
    assert wheel_gate.check_metadata(
        meta.replace("License-Expression: Apache-2.0\n", ""), "2.11", "0.1.0"
    )
    assert wheel_gate.check_metadata(meta, "2.11", "0.2.0")
    for bad in (
        "gloo::transport::tcp::Pair::send()",
        "HMAC",
        "std::runtime_error::what() const",
        "operator new(unsigned long)",
        "evil_c_symbol",
    ):
        assert wheel_gate._bad_export(bad), bad
    for good in (
        "PyInit__C",
        "fastcomms::Communicator::rank() const",
        "std::vector<int, std::allocator<int> >::~vector()",
        "std::piecewise_construct",
        "_init",
    ):
        assert wheel_gate._bad_export(good) is None, good


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


def test_check_with_one_rank(tmp_path):
    """One rank (a one-GPU machine's gate runs so): every op runs except the send/recv ring, a
    send to itself, which is reported SKIPPED, not failed and not passed."""
    out = tmp_path / "check.json"
    r = _run("check", "--backend", "gloo", "--nproc", "1", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    rows = {row["op"]: row for row in json.loads(out.read_text())["results"]}
    assert rows["send/recv ring"]["skipped"] and "SKIPPED" in r.stdout, r.stdout
    assert all(row["ok"] and not row["skipped"] for op, row in rows.items() if "ring" not in op)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the control needs a machine without GPUs")
def test_check_reports_a_failure():
    # armed control: the nccl backend cannot start on this CPU machine; check says so and fails
    r = _run("check", "--backend", "nccl", "--nproc", "2")
    assert r.returncode == 1 and "FAIL" in r.stdout, r.stdout + r.stderr


def test_check_prints_errors_whole(monkeypatch, capsys):
    """An op's error keeps its "[rank r/n name op]" prefix in the table: rich would take it for
    markup and drop it (it did) unless escaped."""
    import argparse

    from fastcomms import cli

    msg = "ValueError: [rank 1/2 check send] dst must not be this rank (1)"
    per_rank = [[("send", True, "")], [("send", False, msg)]]
    monkeypatch.setattr(cli, "_run_ranks", lambda fn, size, args, timeout_s: (per_rank, None))
    args = argparse.Namespace(backend="gloo", nproc=2, json=None)
    assert cli.check(args) == 1
    assert "[rank 1/2 check send]" in capsys.readouterr().out


def test_pick_backend_says_why(monkeypatch):
    """bench/check's backend choice on machines this CI does not have: the probes are replaced,
    the rule is the real one (nvlink only on NVML's yes for every pair, never on unknown)."""
    from fastcomms import _C, cli

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(_C, "has_transport", lambda kind: True)
    joined = {(a, b): True for a in range(4) for b in range(4) if a != b}
    cases = [
        (4, 2, (joined, ""), "nvlink", "NVLink-joined"),
        (4, 2, ({**joined, (0, 1): False, (1, 0): False}, ""), "nccl", "not NVLink-joined"),
        (4, 2, (None, "NVML not found"), "nccl", "NVML cannot say"),
        (1, 2, (joined, ""), "gloo", "1 GPUs for 2 ranks"),
        (0, 2, (joined, ""), "gloo", "no CUDA device"),
    ]
    for ngpu, nproc, nvml, want, why in cases:
        monkeypatch.setattr(torch.cuda, "device_count", lambda n=ngpu: n)
        monkeypatch.setattr(cli, "_nvlink", lambda devs, r=nvml: r)
        backend, reason = cli.pick_backend(nproc)
        assert (backend, why in reason) == (want, True), (ngpu, nvml, backend, reason)
    # what is built counts, not only the GPUs (issue 35: a one-GPU image without libgloo)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cli, "_nvlink", lambda devs: (joined, ""))
    built = {"gloo": False, "nccl": True, "nvlink": True}
    monkeypatch.setattr(_C, "is_backend_built", lambda b: built[b])
    backend, reason = cli.pick_backend(2)
    assert backend == "nvlink" and "ranks sharing the GPUs" in reason, reason
    built["nvlink"] = False
    with pytest.raises(ValueError, match=r"no gloo backend \(built: nccl\)"):
        cli.pick_backend(2)
    built.update(gloo=True, nvlink=True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    built["nvlink"] = False
    assert cli.pick_backend(2) == ("nccl", "this build has no nvlink backend: nccl")
    built["nvlink"] = True
    # under torchrun across hosts: never nvlink
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "t")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(cli, "_nvlink", lambda devs: (joined, ""))
    assert cli.pick_backend(2)[0] == "nccl"


def test_private_mps_daemon_is_told_to_quit(tmp_path, monkeypatch):
    """NOTE [cli ranks on one GPU]: the daemon the command starts for ranks sharing a GPU gets
    "quit" on its control pipe when the run ends, and the ranks' MPS variables go. A stand-in
    control program records what it was given (no GPU needed)."""
    from fastcomms import cli

    log = tmp_path / "control.log"
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text(
        f'#!/bin/sh\necho "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY" >> {log}\n'
        f'[ "$1" = "-d" ] || cat >> {log}\n'
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    with cli._private_mps(True) as why:
        assert "private MPS daemon" in why, why
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.isdir(pipe)
    lines = log.read_text().splitlines()
    assert lines == [f"args=-d pipe={pipe}", f"args= pipe={pipe}", "quit"], lines
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and not os.path.exists(pipe)
    with cli._private_mps(False) as why:
        assert why == ""
