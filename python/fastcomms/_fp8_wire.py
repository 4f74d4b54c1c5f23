# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The FP8 wire dtypes for the MoE layer's own checks (``moe.py``). The Ulysses op checks its FP8
calls in C++ (NOTE [fp8 wire exchange] in python/src/ulysses_op.cpp); the torch reference of the
numerics is tests/python/fp8_reference.py."""

from __future__ import annotations

import torch

#: The dtypes that can be sent as FP8 (and that FP8 is dequantized into), and the wire formats.
VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WIRE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_value_dtype(dtype: object, what: str) -> None:
    """Raises TypeError unless ``dtype`` is float16, bfloat16 or float32."""
    if dtype not in VALUE_DTYPES:
        name = str(dtype).removeprefix("torch.")
        raise TypeError(f"fp8: {what} must be float16, bfloat16 or float32, got {name}")
