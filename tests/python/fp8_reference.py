# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""FP8 on the wire, the reference in torch ops (a test helper: moved out of the runtime package,
which runs the C++ and CUDA implementations) (NOTE [fp8 wire] in
include/fastcomms/ulysses/fp8.hpp): rows of the last dimension quantized to FP8 with one float32
scale per row, and back. The C++ host implementation and the CUDA kernels match these functions
byte for byte; the tests hold them to it. Works on CPU and CUDA tensors.

Two details that are not plain torch calls, both so that every implementation writes the same
bytes on every device:

- divisions are by tensors, never by a Python scalar: torch's CUDA division by a CPU scalar
  multiplies by its reciprocal, which is not the IEEE quotient;
- NaNs are canonical: a NaN on the wire is the byte 0x7F and a NaN out of ``dequantize`` is the
  dtype's positive quiet NaN (GPU arithmetic makes canonical NaNs where x86 keeps the sign, and
  torch's own CPU conversions differ by dtype: a NaN to bfloat16 is 0xFFFF, -NaN to float16
  0xFE00).
"""

from __future__ import annotations

import torch

__all__ = ["FP8_MAX", "VALUE_DTYPES", "dequantize_reference", "quantize_reference"]

#: The dtypes that can be sent as FP8 (and that FP8 is dequantized into), and the wire formats.
VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WIRE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def check_value_dtype(dtype: object, what: str) -> None:
    """The reference's own argument check: float16, bfloat16 or float32."""
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"fp8: {what} must be float16, bfloat16 or float32, got {_name(dtype)}")


def check_wire_dtype(wire_dtype: object) -> None:
    """The reference's own argument check: torch.float8_e4m3fn or torch.float8_e5m2."""
    if wire_dtype not in WIRE_DTYPES:
        raise TypeError(
            "fp8: wire_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got "
            f"{_name(wire_dtype)}"
        )


#: The largest finite value of each wire format.
FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}

# The positive quiet NaN of each output dtype, as its bits.
_NAN_BITS = {
    torch.float16: (torch.int16, 0x7E00),
    torch.bfloat16: (torch.int16, 0x7FC0),
    torch.float32: (torch.int32, 0x7FC00000),
}
_FP8_NAN = 0x7F


def _check_tensor(t: object, what: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fp8: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError(f"fp8: {what} must have at least one dimension (rows of d values)")
    return t


def quantize_reference(
    x: torch.Tensor, wire_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scales)``: ``x`` quantized over its last dimension. ``q`` has x's shape and
    ``wire_dtype``; ``scales`` is float32 shaped ``x.shape[:-1]``."""
    _check_tensor(x, "x")
    check_value_dtype(x.dtype, "x's dtype")
    check_wire_dtype(wire_dtype)
    fmax = FP8_MAX[wire_dtype]
    xf = x.float()
    a = xf.abs().masked_fill(xf.isnan(), 0)
    amax = a.amax(dim=-1) if x.shape[-1] else a.new_zeros(x.shape[:-1])  # (d == 0: no rows' max)
    scales = amax / torch.full_like(amax, fmax)
    s = scales.unsqueeze(-1)
    y = torch.where(s > 0, xf / s, xf)
    nan = torch.isnan(y)
    q = y.clamp(-fmax, fmax).to(wire_dtype)
    qb = torch.where(nan, torch.full_like(q.view(torch.uint8), _FP8_NAN), q.view(torch.uint8))
    return qb.view(wire_dtype), scales


def dequantize_reference(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``q`` (FP8) times its row's scale, in ``dtype`` (float16, bfloat16 or float32)."""
    _check_tensor(q, "q")
    check_wire_dtype(q.dtype)
    check_value_dtype(dtype, "the output dtype")
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        got = _name(scales.dtype) if isinstance(scales, torch.Tensor) else type(scales).__name__
        raise TypeError(f"fp8: scales must be a float32 tensor, got {got}")
    if tuple(scales.shape) != tuple(q.shape[:-1]):
        raise ValueError(
            f"fp8: scales must have shape q.shape[:-1] = {tuple(q.shape[:-1])}, got "
            f"{tuple(scales.shape)}"
        )
    if scales.device != q.device:
        raise ValueError(f"fp8: q is on {q.device} and scales on {scales.device}")
    prod = q.float() * scales.unsqueeze(-1)
    out = prod.to(dtype)
    int_dtype, bits = _NAN_BITS[dtype]
    raw = out.view(int_dtype)
    return torch.where(torch.isnan(prod), torch.full_like(raw, bits), raw).view(dtype)
