# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The launcher tier (issue 35, NOTE [launchers]): ranks started the way users start them, each
making its communicators with no store. Real torchrun (`python -m torch.distributed.run`) with a
static port, --standalone and c10d rendezvous, at 2 and 3 ranks, with torch.distributed's default
group made before and after new_comm; plain processes with RANK/WORLD_SIZE (a shell loop),
SLURM's and Open MPI's variables; the FSDP example under torchrun; rank and size mismatches.
Every rank runs tests/python/launch_worker.py, which checks each result against torch.distributed.
The one-GPU cases skip without a CUDA device (scripts/gpu.sh runs them)."""

import os
import random
import socket
import subprocess
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "launch_worker.py")
EXAMPLE = os.path.join(ROOT, "examples", "train_ulysses_fsdp.py")
LAUNCH_VARS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHCOMM_RANK", "TORCHCOMM_SIZE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE",
)  # fmt: skip


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in LAUNCH_VARS and not k.startswith(("SLURM_", "OMPI_"))
    }
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env["OMP_NUM_THREADS"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _port(lo=20000, hi=40000) -> int:
    """A free loopback port in [lo, hi) (SLURM's default port must be reachable by a job id)."""
    for _ in range(200):
        p = random.randrange(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port")


def _torchrun(nproc, *args, launcher=(), timeout=240, env=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += list(launcher) or ["--master-port", str(_port())]
    r = subprocess.run(
        [*cmd, *args], capture_output=True, text=True, timeout=timeout, env=env or _env()
    )
    return r


def _plain(nproc, per_rank, *args, timeout=180):
    """nproc plain processes (a shell loop's way), per_rank(r) the launcher variables of rank r."""
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(**per_rank(r)),
        )
        for r in range(nproc)
    ]
    outs = []
    for p in procs:
        try:
            outs.append((p.wait(timeout=timeout), p.stdout.read()))
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append((None, p.stdout.read()))
    return outs


def _ok(r, nproc, launcher):
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    # (the ranks' lines may interleave)
    assert r.stdout.count("LAUNCH OK") == r.stdout.count(f"LAUNCH OK {launcher}:") == nproc, out


@pytest.mark.parametrize(("nproc", "order"), [(2, "fastcomms-first"), (3, "torch-first")])
def test_torchrun_static_port_every_op(nproc, order):
    """torchrun --master-port P: the agent serves the store on P; new_comm joins it (before this,
    rank 0 tried to serve P too: 'Address already in use')."""
    r = _torchrun(nproc, WORKER, "--full", "--order", order)
    _ok(r, nproc, "torchrun")
    assert "joins the launcher's store" in r.stdout


def test_torchrun_standalone():
    r = _torchrun(2, WORKER, "--full", launcher=["--standalone"])
    _ok(r, 2, "torchrun")


def test_torchrun_c10d_rendezvous():
    port = _port()
    r = _torchrun(
        3,
        WORKER,
        launcher=[
            "--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"job{port}",
        ],
    )  # fmt: skip
    _ok(r, 3, "torchrun")


@pytest.mark.parametrize("nproc", [2, 3])
def test_torchrun_fsdp_example(nproc):
    shape = [] if nproc == 2 else ["--heads", "3", "--dim", "48", "--seq", "48"]
    r = _torchrun(
        nproc, EXAMPLE, "--backend", "gloo", "--sp", str(nproc), "--dp", "1", "--steps", "3",
        "--check", *shape,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    assert "loss matches the reference" in r.stdout, r.stdout


def test_example_says_at_once_what_ranks_need():
    """Ranks on a launcher that did not start sp x dp of them: one line, exit 2, no traceback."""
    r = _torchrun(3, EXAMPLE, "--backend", "gloo", "--sp", "2", "--dp", "1", timeout=120)
    assert r.returncode != 0
    assert "= 2 ranks, but the launcher started 3 (WORLD_SIZE)" in r.stderr, r.stderr[-3000:]
    assert f'{EXAMPLE}", line' not in r.stderr, r.stderr[-3000:]  # (torchrun's own report stays)


def test_plain_processes_both_orders():
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from a shell loop (or mp.spawn): rank 0 serves the
    store, and torch.distributed's env:// store shares its port (either order)."""
    port = _port()
    for n, order in ((2, "fastcomms-first"), (3, "torch-first")):
        outs = _plain(
            n,
            lambda r, n=n, p=port: dict(
                RANK=r, WORLD_SIZE=n, MASTER_ADDR="127.0.0.1", MASTER_PORT=p
            ),
            "--full",
            "--order",
            order,
        )
        for rc, out in outs:
            assert rc == 0 and "LAUNCH OK env:" in out, out[-4000:]
        port += 1


def test_slurm_variables():
    """srun's variables on plain processes: no MASTER_ADDR (the first host of the node list), no
    MASTER_PORT (20000 + SLURM_JOB_ID % 20000)."""
    port = _port()
    job = port - 20000 + 20000 * random.randrange(1, 50)  # a job id whose default port is free

    def slurm(r):
        return dict(
            SLURM_PROCID=r, SLURM_NTASKS=3, SLURM_LOCALID=r, SLURM_JOB_ID=job,
            SLURM_JOB_NODELIST="localhost", SLURM_STEP_ID=0,
        )  # fmt: skip

    for rc, out in _plain(3, slurm, "--order", "no-torch"):
        assert rc == 0, out[-4000:]
        assert "LAUNCH OK slurm: rank" in out and f"localhost:{port}" in out, out[-4000:]


def test_openmpi_variables():
    port = _port()

    def ompi(r):
        return dict(
            OMPI_COMM_WORLD_RANK=r, OMPI_COMM_WORLD_SIZE=2, OMPI_COMM_WORLD_LOCAL_RANK=r,
            OMPI_COMM_WORLD_LOCAL_SIZE=2, MASTER_PORT=port,
        )  # fmt: skip

    for rc, out in _plain(2, ompi, "--order", "no-torch"):
        assert rc == 0 and "LAUNCH OK openmpi: rank" in out, out[-4000:]


def test_size_mismatch_is_named_on_both_ranks():
    port = _port()
    outs = _plain(
        2,
        lambda r: dict(RANK=r, WORLD_SIZE=2 + r, MASTER_PORT=port),
        "--order", "no-torch", "--timeout", "20",
    )  # fmt: skip
    for rc, out in outs:
        assert rc not in (0, None), out[-3000:]
        assert "was started with a world of" in out and "every rank needs the same size" in out
        assert "(from RANK/WORLD_SIZE)" in out, out[-3000:]  # where this rank's size came from


def test_duplicate_rank_is_refused():
    port = _port()
    outs = _plain(
        3,
        lambda r: dict(RANK=min(r, 1), WORLD_SIZE=3, MASTER_PORT=port),
        "--order", "no-torch", "--timeout", "10",
    )  # fmt: skip
    assert any("another process also took rank 1" in out for _, out in outs), outs
    assert all(rc not in (0, None) for rc, _ in outs), outs  # nobody hangs or passes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu.sh)")
@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_torchrun_one_gpu(backend):
    """World 1 on the GPU under torchrun, every op."""
    r = _torchrun(1, WORKER, "--device", "cuda", "--backend", backend, "--full")
    _ok(r, 1, "torchrun")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu.sh)")
def test_torchrun_two_ranks_share_one_gpu():
    """2 ranks on GPU 0 (CUDA_VISIBLE_DEVICES=0; as MPS clients where scripts/gpu.sh runs the
    tests under tools/gpu/mps.sh): the Ulysses op over the nvlink transport, poisoned output,
    against permute + all_to_all_single over gloo."""
    env = _env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    r = _torchrun(2, WORKER, "--device", "cuda", "--shared-gpu-ulysses", env=env)
    _ok(r, 2, "torchrun")
    assert r.stdout.count("(ulysses over nvlink, GPU shared)") == 2, r.stdout


# -- the environment, read without processes ---------------------------------------------------
def test_first_host_of_a_slurm_node_list():
    from fastcomms._bootstrap import first_host

    assert first_host("gpu[03-05,9],cpu1") == "gpu03"
    assert first_host("node7,node8") == "node7"
    assert first_host("n[1-2]") == "n1"
    assert first_host("a-b-c") == "a-b-c"


def test_detect_order_and_errors(monkeypatch):
    from fastcomms import _bootstrap

    for k in list(os.environ):
        if k in LAUNCH_VARS or k.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(k)
    assert _bootstrap.detect() is None
    with pytest.raises(ValueError, match="no launcher is recognized"):
        _bootstrap.required()
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2")
    with pytest.raises(ValueError, match="set MASTER_ADDR to rank 0's host"):
        _bootstrap.detect()  # two hosts: 127.0.0.1 would be wrong
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[10-11]")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    launch = _bootstrap.detect()  # SLURM before Open MPI
    assert (launch.launcher, launch.rank, launch.size) == ("slurm", 2, 8)
    assert (launch.addr, launch.port) == ("gpu10", 20000 + 123456 % 20000)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    launch = _bootstrap.detect()  # torchrun (inside srun) before SLURM
    assert (launch.launcher, launch.rank, launch.agent_store, launch.port) == (
        "torchrun",
        5,
        True,
        1234,
    )
    monkeypatch.setenv("MASTER_PORT", "0")  # torchrun --master-port 0 passes 0 on
    with pytest.raises(ValueError, match=r"got 0 \(MASTER_PORT\); torchrun --master-port 0"):
        _bootstrap.detect()
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv("RANK", "6")
    with pytest.raises(ValueError, match=r"rank 6 and size 6 from RANK/WORLD_SIZE"):
        _bootstrap.detect()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK must be an integer, got 'x'"):
        _bootstrap.detect()
