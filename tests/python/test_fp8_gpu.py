# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""FP8 on the wire, the CUDA kernels (cuda/fp8.cu) against the torch reference on the same GPU
and against the C++ host implementation on the CPU, byte for byte: the inputs of test_fp8.py,
plus every kernel variant (8 or 32 threads a row, 16-byte vectors or scalar) by d and by
alignment, and a grid that strides over rows. Skipped, saying so, where no CUDA GPU is."""

import math

import pytest
import torch
from fastcomms import _C
from fp8_cases import (
    DS,
    DTYPES,
    KINDS,
    WIRES,
    all_bit_patterns,
    check_roundtrip,
    edge_rows,
    impl_dequantize,
    impl_quantize,
    mismatch,
    random_rows,
)
from fp8_reference import dequantize_reference, quantize_reference


@pytest.fixture(autouse=True)
def _needs_gpu():
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        pytest.skip("needs a CUDA GPU")
    if not _C._fp8_has_cuda_kernels():
        pytest.skip("this build has no CUDA kernels (built without CUDA)")


def _same_as_host(x_gpu, wire):
    """The kernels equal the host implementation run on the same values on the CPU."""
    q, s = impl_quantize(x_gpu, wire)
    q_host, s_host = impl_quantize(x_gpu.cpu(), wire)
    for m in (mismatch(s, s_host, "scales vs host"), mismatch(q, q_host, "q vs host")):
        assert m is None, m
    for dt in DTYPES:
        m = mismatch(impl_dequantize(q, s, dt), impl_dequantize(q_host, s_host, dt), f"{dt} host")
        assert m is None, m


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_rows(dtype, wire):
    gen = torch.Generator().manual_seed(38)
    for d in DS + (8, 256, 512, 1000):
        for kind in KINDS:
            x = random_rows(kind, 300, d, dtype, gen, device="cuda")
            check_roundtrip(x, wire, what=f"{kind} d={d}")
            _same_as_host(x, wire)


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", DS)
def test_edge_rows(dtype, wire, d):
    x = edge_rows(d, dtype, wire).cuda()
    check_roundtrip(x, wire, what=f"edge d={d}")
    _same_as_host(x, wire)


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_input_value_in_range(dtype, wire):
    for d in (64, 65, 256):  # vector and scalar variants
        x = all_bit_patterns(dtype, wire, d).cuda()
        check_roundtrip(x, wire, out_dtypes=(dtype,))
        _same_as_host(x, wire)


@pytest.mark.parametrize("wire", WIRES, ids=str)
def test_dequantize_any_byte_any_scale(wire):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(wire)
    scales = torch.tensor(
        [0.0, -0.0, 1.0, 1e-45, 3e-39, 1.7e-5, 0.3, 146.2142857, 1e4, 6e33, 3e38, math.inf],
        dtype=torch.float32,
    )
    for d in (256, 255):
        q = codes[:d].repeat(scales.numel(), 1)
        for dt in DTYPES:
            got = impl_dequantize(q.cuda(), scales.cuda(), dt)
            assert (m := mismatch(got, dequantize_reference(q, scales, dt), str(dt))) is None, m


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("offset", [0, 1, 2, 3, 8])
def test_misaligned_pointers(dtype, offset):
    """Views starting `offset` elements into a buffer: x, q and out lose their 16-byte alignment
    and the scalar variants run; the bytes must not change."""
    gen = torch.Generator().manual_seed(offset)
    rows, d = 37, 64
    x0 = random_rows("spiked", rows, d, dtype, gen, device="cuda")
    buf = torch.empty(rows * d + offset, dtype=dtype, device="cuda")
    x = buf[offset:].view(rows, d)
    x.copy_(x0)
    for wire in WIRES:
        qbuf = torch.empty(rows * d + offset, dtype=wire, device="cuda")
        q = qbuf[offset:].view(rows, d)
        s = torch.empty(rows, device="cuda")
        _C._fp8_quantize(x, q, s)
        q_ref, s_ref = quantize_reference(x0, wire)
        assert (m := mismatch(q, q_ref, "q")) is None, m
        assert (m := mismatch(s, s_ref, "scales")) is None, m
        obuf = torch.empty(rows * d + offset, dtype=dtype, device="cuda")
        out = obuf[offset:].view(rows, d)
        _C._fp8_dequantize(q, s, out)
        assert (m := mismatch(out, dequantize_reference(q_ref, s_ref, dtype), "out")) is None, m


def test_grid_strides_over_rows():
    """More rows than one launch's grid: d = 3 takes the scalar variant at 8 threads a row, 32
    rows a block, and the grid is capped at 2^20 blocks (2^25 rows)."""
    rows, d = (1 << 25) + 5, 3
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(rows, d, device="cuda", generator=gen)
    x[-1] = torch.tensor([1.0, -2.0, 0.5], device="cuda")
    q, s = impl_quantize(x, torch.float8_e4m3fn)
    q_ref, s_ref = quantize_reference(x, torch.float8_e4m3fn)
    assert (m := mismatch(s, s_ref, "scales")) is None, m
    assert (m := mismatch(q, q_ref, "q")) is None, m
    out = impl_dequantize(q, s, torch.float32)
    assert (m := mismatch(out, dequantize_reference(q, s, torch.float32), "out")) is None, m


def test_current_stream_and_device():
    """The kernels run on the caller's current stream (ordered after work queued there)."""
    s = torch.cuda.Stream()
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.stream(s):
        y = x * 2  # queued on s; the quantize below must see it
        q, sc = impl_quantize(y, torch.float8_e4m3fn)
    s.synchronize()
    q_ref, s_ref = quantize_reference(x * 2, torch.float8_e4m3fn)
    assert mismatch(q, q_ref) is None and mismatch(sc, s_ref) is None


def test_control_comparison_sees_a_kernel_byte():
    x = random_rows("normal", 16, 64, torch.float16, torch.Generator().manual_seed(4), "cuda")
    q, _ = impl_quantize(x, torch.float8_e5m2)
    q_ref, _ = quantize_reference(x, torch.float8_e5m2)
    assert mismatch(q, q_ref) is None
    q.view(torch.uint8)[0, 0] ^= 0x80
    assert mismatch(q, q_ref) is not None
