# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What test_fp8.py (the C++ host implementation) and test_fp8_gpu.py (the CUDA kernels) share:
the inputs, the calls into the extension and the byte comparison."""

from __future__ import annotations

import math

import torch
from fastcomms import _C
from fp8_reference import FP8_MAX, VALUE_DTYPES, dequantize_reference, quantize_reference

WIRES = (torch.float8_e4m3fn, torch.float8_e5m2)
DTYPES = VALUE_DTYPES
DS = (1, 3, 16, 64, 128, 130)
KINDS = ("normal", "student_t", "spiked")


def impl_quantize(x: torch.Tensor, wire: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) from the extension (host code for CPU tensors, the kernels for CUDA ones)."""
    q = torch.empty(x.shape, dtype=wire, device=x.device)
    s = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _C._fp8_quantize(x, q, s)
    return q, s


def impl_dequantize(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    _C._fp8_dequantize(q, s, out)
    return out


def mismatch(got: torch.Tensor, want: torch.Tensor, what: str = "") -> str | None:
    """None when the two tensors hold the same bytes (dtype and shape included), else a line
    naming the first differing element and how many differ."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: got {got.dtype}{tuple(got.shape)}, want {want.dtype}{tuple(want.shape)}"
    n = got.element_size()
    a = got.detach().cpu().contiguous().view(torch.uint8).reshape(-1, n)
    b = want.detach().cpu().contiguous().view(torch.uint8).reshape(-1, n)
    bad = (a != b).any(dim=1).nonzero().flatten()
    if bad.numel() == 0:
        return None
    i = int(bad[0])
    flat_got = got.detach().cpu().reshape(-1)
    flat_want = want.detach().cpu().reshape(-1)
    return (
        f"{what}: {bad.numel()} of {a.shape[0]} elements differ; first at flat index {i}: got "
        f"{flat_got[i].float().item()!r} (bytes {a[i].tolist()}), want "
        f"{flat_want[i].float().item()!r} (bytes {b[i].tolist()})"
    )


def check_roundtrip(x: torch.Tensor, wire: torch.dtype, out_dtypes=DTYPES, what: str = "") -> None:
    """Asserts the extension's quantize and dequantize equal the reference byte for byte."""
    q_ref, s_ref = quantize_reference(x, wire)
    q, s = impl_quantize(x, wire)
    tag = f"{what} x={x.dtype}{tuple(x.shape)} wire={wire}"
    for m in (mismatch(s, s_ref, tag + " scales"), mismatch(q, q_ref, tag + " q")):
        assert m is None, m
    for dt in out_dtypes:
        m = mismatch(
            impl_dequantize(q_ref, s_ref, dt),
            dequantize_reference(q_ref, s_ref, dt),
            f"{tag} dequantize to {dt}",
        )
        assert m is None, m


def random_rows(
    kind: str, rows: int, d: int, dtype: torch.dtype, gen: torch.Generator, device="cpu"
) -> torch.Tensor:
    """Rows of `kind` data: "normal", "student_t" (df=3, heavy tails) or "spiked" (normal with
    about 1% of the values 50-5000x larger); every row scaled by its own power of ten within the
    dtype's range, so scales span many binades."""
    z = torch.randn(rows, d, generator=gen)
    if kind == "student_t":
        chi2 = (torch.randn(rows, d, 3, generator=gen) ** 2).sum(-1)
        z = z / torch.sqrt(chi2 / 3)
    elif kind == "spiked":
        spikes = torch.rand(rows, d, generator=gen) < 0.01
        mag = 50 * 100 ** torch.rand(rows, d, generator=gen)
        z = torch.where(spikes, z * mag, z)
    lo, hi = (-3.0, 3.0) if dtype == torch.float16 else (-30.0, 30.0)
    row_scale = 10 ** (lo + (hi - lo) * torch.rand(rows, 1, generator=gen, dtype=torch.float64))
    return (z.double() * row_scale).to(dtype).to(device)


def _fp8_values(wire: torch.dtype) -> torch.Tensor:
    """Every finite non-negative value of `wire`, ascending."""
    v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(wire).float()
    v = v[torch.isfinite(v) & (v >= 0)]
    return torch.unique(v)


def edge_rows(d: int, dtype: torch.dtype, wire: torch.dtype) -> torch.Tensor:
    """Rows that meet every rule of NOTE [fp8 wire]: zeros, -0, NaN, +-Inf, rows whose scale is
    exactly 1 (the max first) holding every FP8 value and every midpoint between neighbours (ties
    to even, FP8 subnormals), values at +-FMAX * scale, float32 subnormals (scale 0 or a
    subnormal scale), and the dtype's largest values."""
    fmax = FP8_MAX[wire]
    f32_like = dtype != torch.float16
    rows: list[list[float]] = []

    def add(values: list[float]) -> None:
        vals = (values * (d // max(len(values), 1) + 1))[:d] if values else [0.0] * d
        rows.append(vals)

    nan, inf = math.nan, math.inf
    add([0.0])
    add([-0.0])
    add([0.0, -0.0])
    add([nan])
    add([nan, 0.0, -0.0])
    add([1.5, nan, -2.0, 0.25])
    add([1.0, inf, -3.0])
    add([-inf, 1.0, 0.0])
    add([inf, -inf, nan, 2.0])
    add([fmax, -fmax])
    add([3.0, -3.0, 1.5, -2.9999])
    if f32_like:
        add([1e-41, -3e-44, 1e-45])  # float32 subnormals, scale 0 for e4m3
        add([4e-41, -1e-45])  # around FMAX * 2^-150 for e5m2
        add([1e-38, -2e-39, 5e-40])  # a subnormal scale
        add([3.0e38, -1e-30, 1.0])  # the largest values, tiny beside them
        add([1e-30, -1e30, 7.0])
    else:
        add([6e-8, -6e-8, 1e-7])  # float16 subnormals
        add([65504.0, -65504.0, 1.0, 6e-5])
    add([1.0] + [2.0**-k for k in range(1, 40)])  # a wide dynamic range
    listed = torch.tensor(rows, dtype=torch.float64).to(torch.float32).to(dtype)
    # Every FP8 value, every midpoint between neighbours (exact in every input dtype), its
    # negation and the input dtype's neighbours of each midpoint, in rows of scale exactly 1.
    vals = _fp8_values(wire)
    mids = ((vals[1:] + vals[:-1]) / 2).to(dtype)
    as_int = mids.view(torch.int16 if mids.element_size() == 2 else torch.int32)
    grid = torch.cat(
        [vals.to(dtype), mids, -mids, (as_int + 1).view(dtype), (as_int - 1).view(dtype)]
    )
    if d == 1:
        return torch.cat([listed, grid.reshape(-1, 1)])
    per = d - 1
    n = (grid.numel() + per - 1) // per
    body = torch.cat([grid, torch.zeros(n * per - grid.numel(), dtype=dtype)]).reshape(n, per)
    gridded = torch.cat([torch.full((n, 1), fmax, dtype=dtype), body], dim=1)
    return torch.cat([listed, gridded])


def all_bit_patterns(dtype: torch.dtype, wire: torch.dtype, d: int = 64) -> torch.Tensor:
    """Every 16-bit pattern of a half dtype (or a spread of float32 patterns), each row starting
    with FMAX so its scale is 1 and y is x itself: the conversion of every value in range."""
    fmax = FP8_MAX[wire]
    if dtype == torch.float32:
        bits = torch.arange(0, 2**32, 40503, dtype=torch.int64)
        v = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    else:
        v = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype).float()
    v = v[torch.isnan(v) | (v.abs() <= fmax)]
    per = d - 1
    n = (v.numel() + per - 1) // per
    pad = torch.zeros(n * per - v.numel())
    body = torch.cat([v, pad]).reshape(n, per)
    return torch.cat([torch.full((n, 1), fmax), body], dim=1).to(dtype)
