# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""CPU tier of the device window API (issue 52; the GPU tier is test_device_window_gpu.py):
the layout fastcomms.triton reads matches the C++ struct, the Triton functions compile to the
PTX the ordering note names (no GPU needed to compile), the header builds as host C++ without
CUDA, and where the device API cannot serve (gloo) it raises saying why."""

import pathlib
import shutil
import subprocess

import fastcomms
import pytest
from fastcomms import _C

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_triton_layout_is_the_cpp_struct():
    from fastcomms.triton._layout import LAYOUT

    assert LAYOUT == _C.device_window_layout() and LAYOUT["DeviceWindow"] > 0
    assert LAYOUT["RegisteredBuffer"] > LAYOUT["RegisteredBuffer.size"] >= 8


def test_get_include_finds_the_header():
    inc = pathlib.Path(fastcomms.get_include())
    assert (inc / "fastcomms" / "device" / "window.hpp").is_file()


@pytest.fixture
def gloo_comm(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    comm = fastcomms.new_comm("gloo", "cpu", "dw", store=dist.HashStore())
    yield comm
    comm.finalize()


def test_gloo_refuses_the_device_api_saying_why(gloo_comm):
    with pytest.raises(fastcomms.UnsupportedError, match=r"get_device_transport.*CUDA IPC"):
        gloo_comm.get_device_transport()
    with pytest.raises(fastcomms.UnsupportedError, match="has no windows"):
        gloo_comm.new_window()


def test_triton_module_imports_and_names_torchcomms_functions():
    tr = pytest.importorskip("triton", reason="fastcomms.triton needs triton")
    import fastcomms.triton as fct

    for name in (
        "put_block",
        "signal_block",
        "wait_signal",
        "wait_signal_from",
        "read_signal",
        "reset_signal",
        "wait_counter",
        "read_counter",
        "reset_counter",
        "fence",
        "flush_block",
        "barrier_block",
        "get_nvlink_address",
        "get_multimem_address",
        "rank",
        "num_ranks",
        "base",
        "size",
        "wait_signal_from_block",
        "wait_counter_block",
        "self_copy_block",
        "transport_send",
        "transport_recv",
        "transport_barrier",
        "transport_signal",
        "transport_wait_signal",
        "transport_get_type",
    ):
        assert isinstance(getattr(fct, name), tr.runtime.jit.JITFunction), name
    assert fct.requires_torchcomms(len) is len


def test_triton_example_compiles_to_the_ordered_ptx():
    """The example's ring all-reduce compiled for sm_90 without a GPU: the signals are
    red.release.sys, the waits ld.acquire.sys, the joins bar.sync (NOTE [device window
    ordering]); a put that dropped them would show here."""
    triton = pytest.importorskip("triton", reason="needs triton")
    import importlib.util

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    spec = importlib.util.spec_from_file_location(
        "ex", ROOT / "examples" / "device_window_triton.py"
    )
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    sig = {
        "win": "i64",
        "x_buf": "i64",
        "x_ptr": "*fp32",
        "chunk": "i64",
        "call": "i64",
        "BLOCK": "constexpr",
    }
    try:
        c = triton.compile(
            ASTSource(fn=ex.ring_all_reduce, signature=sig, constexprs={"BLOCK": 1024}),
            target=GPUTarget("cuda", 90, 32),
        )
    except Exception as e:  # a triton without its CUDA toolchain (ptxas) cannot compile here
        if "ptxas" in str(e) or "NVIDIA" in str(e):
            pytest.skip(f"triton cannot compile for CUDA here: {e}")
        raise
    ptx = c.asm["ptx"]
    for want in (
        "red.release.sys.global.add.u64",
        "ld.acquire.sys.global.u64",
        "st.release.sys.global.u64",
        "bar.sync",
    ):
        assert want in ptx, want


def test_header_is_host_cpp_without_cuda(tmp_path):
    """fastcomms/device/window.hpp gives host code the layout and enums with no CUDA headers."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    src = tmp_path / "t.cpp"
    src.write_text(
        '#include "fastcomms/device/window.hpp"\n'
        "static_assert(sizeof(fastcomms::device::DeviceWindow) == 112);\n"
        "int main() { return static_cast<int>(fastcomms::device::CmpOp::GE) - 5; }\n"
    )
    r = subprocess.run(
        [cxx, "-std=c++17", "-fsyntax-only", f"-I{ROOT / 'include'}", str(src)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr


def test_window_device_methods_exist_with_torchcomms_signatures():
    import inspect

    w = fastcomms.TorchCommWindow
    assert list(inspect.signature(w.get_device_window).parameters) == [
        "self",
        "signal_count",
        "counter_count",
        "barrier_count",
    ]
    assert inspect.signature(w.get_device_window).parameters["signal_count"].default == -1
    assert inspect.signature(w.get_device_window).parameters["barrier_count"].default == 1
    assert list(inspect.signature(w.register_local_buffer).parameters) == ["self", "tensor"]
    assert list(inspect.signature(w.deregister_local_buffer).parameters) == ["self", "handle"]
    assert callable(fastcomms.TorchComm.get_device_transport)


def test_store_window_needs_a_cuda_device(tmp_path):
    with pytest.raises(ValueError, match="needs a cuda:N device"):
        fastcomms.store_window(0, 1, "cpu", tmp_path)
