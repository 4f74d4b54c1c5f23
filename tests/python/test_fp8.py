# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""FP8 on the wire, the C++ host implementation (ulysses/fp8.cpp) against the torch reference
(fp8_reference.py here) byte for byte: random rows (normal, Student-t, outlier-spiked) for
every d, input dtype and format; the edge rows of NOTE [fp8 wire]; every 16-bit input pattern in
range; any FP8 byte under any scale on the way back. Controls: the comparison must report a
perturbed scale or byte, and the inputs must tell the reference from two plausible wrong
quantizers."""

import math

import pytest
import torch
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
from fp8_reference import FP8_MAX, dequantize_reference, quantize_reference


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_random_rows(dtype, wire):
    gen = torch.Generator().manual_seed(38)
    for d in DS:
        for kind in KINDS:
            x = random_rows(kind, 40, d, dtype, gen)
            check_roundtrip(x, wire, what=f"{kind} d={d}")
    # Leading dimensions are rows too (b, s, n, d).
    check_roundtrip(random_rows("normal", 2 * 3 * 5, 16, dtype, gen).reshape(2, 3, 5, 16), wire)


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", DS)
def test_edge_rows(dtype, wire, d):
    check_roundtrip(edge_rows(d, dtype, wire), wire, what=f"edge d={d}")


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_input_value_in_range(dtype, wire):
    check_roundtrip(all_bit_patterns(dtype, wire), wire, out_dtypes=(dtype,))


@pytest.mark.parametrize("wire", WIRES, ids=str)
def test_dequantize_any_byte_any_scale(wire):
    """Every FP8 byte (NaNs and e5m2's infinities included) under scales of 0, -0, subnormal,
    huge and +inf: the product's rounding into each dtype (float16 overflow to inf included)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(wire)
    scales = torch.tensor(
        [0.0, -0.0, 1.0, 1e-45, 3e-39, 1.7e-5, 0.3, 146.2142857, 1e4, 6e33, 3e38, math.inf],
        dtype=torch.float32,
    )
    q = codes.repeat(scales.numel(), 1)
    for dt in DTYPES:
        m = mismatch(impl_dequantize(q, scales, dt), dequantize_reference(q, scales, dt), str(dt))
        assert m is None, m


def test_empty_and_d_zero():
    for shape in [(0, 16), (3, 0), (0, 0), (2, 0, 4)]:
        x = torch.ones(shape, dtype=torch.bfloat16)
        check_roundtrip(x, torch.float8_e4m3fn, what="empty")
    _, s = impl_quantize(torch.ones(3, 0), torch.float8_e5m2)
    assert s.tolist() == [0.0, 0.0, 0.0]


def test_semantics_spelled_out():
    """NOTE [fp8 wire]'s consequences on explicit rows (the reference and the host agree)."""
    x = torch.tensor(
        [[0.0, -0.0, 0.0], [1.0, math.nan, -2.0], [1.0, math.inf, -3.0], [448.0, 1.0, -448.0]]
    )
    q, s = impl_quantize(x, torch.float8_e4m3fn)
    out = impl_dequantize(q, s, torch.float32)
    amax = torch.tensor([0.0, 2.0, math.inf, 448.0])
    assert s.tolist() == (amax / torch.full((4,), 448.0)).tolist()  # float32 division
    assert q.view(torch.uint8)[0].tolist() == [0x00, 0x80, 0x00]  # -0 stays -0
    assert torch.equal(out[0], x[0]) and math.copysign(1, out[0, 1].item()) == -1
    assert torch.isnan(out[1]).tolist() == [False, True, False]  # NaN only where it was
    assert out[1, 0].item() == 1.0 and out[1, 2].item() == -2.0
    assert torch.isnan(out[2]).all()  # an Inf poisons its row
    assert q.view(torch.uint8)[1, 1].item() == 0x7F and q.view(torch.uint8)[2, 1].item() == 0x7F
    assert out[3].tolist() == [448.0, 1.0, -448.0]


def test_error_bound():
    """In FP8's normal range a value comes back within half an ulp: 2^-4 (e4m3), 2^-3 (e5m2)."""
    gen = torch.Generator().manual_seed(1)
    x = random_rows("normal", 64, 128, torch.float32, gen)
    for wire, bound, min_normal in (
        (torch.float8_e4m3fn, 2**-4, 2**-6),
        (torch.float8_e5m2, 2**-3, 2**-14),
    ):
        q, s = impl_quantize(x, wire)
        out = impl_dequantize(q, s, torch.float32)
        normal = x.abs() >= s.unsqueeze(-1) * min_normal
        rel = ((out - x).abs() / x.abs())[normal]
        assert rel.max().item() <= bound * (1 + 1e-6), (wire, rel.max().item())


# ---- controls: the checks above can fail ----------------------------------------------------


def test_control_comparison_reports_a_perturbed_scale_or_byte():
    x = random_rows("normal", 8, 64, torch.bfloat16, torch.Generator().manual_seed(2))
    q, s = impl_quantize(x, torch.float8_e4m3fn)
    q_ref, s_ref = quantize_reference(x, torch.float8_e4m3fn)
    assert mismatch(q, q_ref) is None and mismatch(s, s_ref) is None
    s_bad = s.clone()
    s_bad[3] = torch.nextafter(s_bad[3], torch.tensor(math.inf))
    assert mismatch(s_bad, s_ref) is not None
    q_bad = q.clone()
    q_bad.view(torch.uint8)[5, 7] ^= 1
    m = mismatch(q_bad, q_ref)
    assert m is not None and "1 of 512" in m
    # A NaN with other bits is not the canonical NaN: bytes, not values, are compared.
    out = dequantize_reference(q_ref, s_ref, torch.float32)
    out_bad = out.clone()
    out_bad.view(torch.int32)[0, 0] = 0x7FC00001
    out[0, 0] = math.nan
    assert mismatch(out_bad, out) is not None


def _quantize_with_reciprocal(x, wire):
    # Wrong on purpose: y = x * (1 / scale) instead of x / scale.
    fmax = FP8_MAX[wire]
    xf = x.float()
    amax = torch.where(torch.isnan(xf), 0.0, xf.abs()).amax(-1)
    s = amax / fmax
    inv = torch.where(s > 0, 1.0 / s, torch.ones_like(s)).unsqueeze(-1)
    return (xf * inv).clamp(-fmax, fmax).to(wire), s


def _quantize_half_away(x, wire):
    # Wrong on purpose: ties rounded away from zero (one step above each exact midpoint).
    q, s = quantize_reference(x, wire)
    xf = x.float() / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    back = q.float()
    up = q.view(torch.uint8) + torch.where(back.abs() < xf.abs(), 1, 0).to(torch.uint8)
    return up.view(wire), s


@pytest.mark.parametrize("wrong", [_quantize_with_reciprocal, _quantize_half_away])
def test_control_inputs_tell_wrong_quantizers_apart(wrong):
    """The inputs the tests use catch a quantizer that multiplies by 1/scale or rounds ties
    away from zero: each differs from the reference on them."""
    found = 0
    gen = torch.Generator().manual_seed(3)
    for wire in WIRES:
        for x in (
            random_rows("normal", 64, 64, torch.float32, gen),
            edge_rows(16, torch.float32, wire),
        ):
            q_ref, _ = quantize_reference(x, wire)
            q_bad, _ = wrong(x, wire)
            ok = ~torch.isnan(x.float()).any(-1, keepdim=True).expand_as(x)
            found += int((q_bad.view(torch.uint8) != q_ref.view(torch.uint8))[ok].sum())
    assert found > 0


# ---- validation --------------------------------------------------------------------------------


def test_reference_validation_messages():
    with pytest.raises(TypeError, match="float16, bfloat16 or float32, got int32"):
        quantize_reference(torch.ones(2, 3, dtype=torch.int32), torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2, got float16"):
        quantize_reference(torch.ones(2, 3), torch.float16)
    q, s = quantize_reference(torch.ones(2, 3), torch.float8_e5m2)
    with pytest.raises(TypeError, match="float8_e4m3fn or torch.float8_e5m2, got float32"):
        dequantize_reference(q.float(), s, torch.float32)
    with pytest.raises(TypeError, match="output dtype must be float16, bfloat16 or float32, got"):
        dequantize_reference(q, s, torch.float64)
    with pytest.raises(ValueError, match=r"scales must have shape q.shape\[:-1\] = \(2,\), got"):
        dequantize_reference(q, s[:1], torch.float32)


def test_extension_validation_messages():
    x = torch.ones(4, 8)
    q = torch.empty(4, 8, dtype=torch.float8_e4m3fn)
    s = torch.empty(4)
    with pytest.raises(
        TypeError, match="unquantized dtype must be float16, bfloat16 or float32, " "got float64"
    ):
        impl_quantize(x.double(), torch.float8_e4m3fn)
    with pytest.raises(
        TypeError, match="wire dtype must be float8_e4m3fn or float8_e5m2, got " "bfloat16"
    ):
        impl_quantize(x, torch.bfloat16)
    from fastcomms import _C

    with pytest.raises(ValueError, match=r"scales has shape \[3\], expected \[4\]"):
        _C._fp8_quantize(x, q, torch.empty(3))
    with pytest.raises(TypeError, match="scales must be float32, got Double"):
        _C._fp8_quantize(x, q, s.double())
    with pytest.raises(ValueError, match="contiguous"):
        _C._fp8_quantize(torch.ones(8, 4).t(), q, s)
    with pytest.raises(ValueError, match=r"q has shape \[4, 7\], expected \[4, 8\]"):
        _C._fp8_dequantize(q[:, :7], s, x)
