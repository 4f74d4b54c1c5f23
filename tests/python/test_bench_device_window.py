# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""CPU tier of tools/gpu/bench_device_window.py (the ping-pong latency figure of issue 52; it runs
in scripts/gpu.sh): the script imports and parses its arguments, says why it measures nothing
without a CUDA device, and its Triton kernel compiles for sm_90 without a GPU to PTX that carries
the ordering of NOTE [device window ordering] (release signal, acquire wait) and the clock."""

import importlib.util
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():
    pytest.importorskip("triton", reason="the benchmark's kernel is Triton")
    sys.path.insert(0, str(ROOT / "tools" / "gpu"))  # its _bench_common, as `python3 X.py` does
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_device_window", ROOT / "tools" / "gpu" / "bench_device_window.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(ROOT / "tools" / "gpu"))


def test_arguments_and_sizes(bench):
    a = bench.parse_args([])
    assert a.sizes == [8, 4096, 65536, 1 << 20]
    assert bench.parse_args(["--sizes", "8,16"]).sizes == [8, 16]
    with pytest.raises(SystemExit):
        bench.parse_args(["--slice", "10"])


def test_without_cuda_it_says_skipped(bench, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would measure")
    assert bench.main([]) == 2
    assert "skipped: no CUDA device" in capsys.readouterr().err


def test_summary_keeps_rank0_and_skips(bench):
    rows = [
        {
            "bytes": 8,
            "variant": "v",
            "rank": r,
            "median_us": 2.0 + r,
            "rounds": 7,
            "round_trips_per_round": 10,
            "programs": 1,
        }
        for r in (1, 0)
    ] + [{"bytes": 8, "variant": "nccl send/recv", "rank": 0, "skipped": "why"}]
    got = bench._summary(rows)
    assert got[0]["rt_median_us"] == 2.0 and got[0]["per_rank_us"] == [2.0, 3.0]
    assert got[1] == {"bytes": 8, "variant": "nccl send/recv", "skipped": "why"}


def test_kernel_compiles_to_ordered_ptx(bench):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {
        "win": "i64",
        "src_buf": "i64",
        "nbytes": "i64",
        "slice_bytes": "i64",
        "iters": "i32",
        "done": "i64",
        "clock": "*i64",
        "rc": "*i32",
    }
    try:
        c = triton.compile(
            ASTSource(fn=bench.ping_pong, signature=sig), target=GPUTarget("cuda", 90, 32)
        )
    except Exception as e:  # a triton without its CUDA toolchain (ptxas) cannot compile here
        if "ptxas" in str(e) or "NVIDIA" in str(e):
            pytest.skip(f"triton cannot compile for CUDA here: {e}")
        raise
    ptx = c.asm["ptx"]
    for want in ("red.release.sys.global.add.u64", "ld.acquire.sys.global.u64", "%globaltimer"):
        assert want in ptx, want
