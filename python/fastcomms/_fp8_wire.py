# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""FP8 on the wire for the Ulysses all-to-all (API.md §2, issue 38; the numerics are NOTE [fp8
wire] in include/fastcomms/ulysses/fp8.hpp, the torch reference ``fastcomms._fp8``).

NOTE [fp8 wire exchange]: a call with ``wire_dtype`` quantizes x's rows of ``d`` values (one
float32 scale per (token, head) row) with the extension's kernels (CPU: the host implementation,
CUDA: the kernels on the caller's stream), moves the FP8 rows and the scales through the group's
Ulysses op as two exchanges of the same geometry, and dequantizes the received rows into the
output dtype (or returns them with their scales, ``return_scales=True``). An all-to-all only moves
rows, so the result is exactly quantize → exchange → dequantize of the torch reference, which is
what the tests hold it to. On the NVLink transport the scales travel padded to 16 bytes per row
(the peer-to-peer path moves rows of whole 16-byte units), elsewhere as 4 bytes. Mode 1 with
``kv_replicas`` moves the virtual heads and sums each head's replicas after dequantizing (the
scales belong to the rows as sent). On the NVLink transport (groups of two ranks or more, d a
multiple of 16) quantization is fused into the transfer (NOTE [fp8 fused push]): the SM kernel
reads x once and writes FP8 rows and their scales into the peers' windows, and the copy-out
dequantizes (or copies the FP8 rows and scales out, ``return_scales``); the copy engines cannot
quantize, so this path never takes them. Elsewhere quantization is a kernel of its own before the
exchange. Backward: the gradient in its own dtype by the other mode
(straight through the quantization), or FP8 again with ``grad_wire_dtype``.
"""

from __future__ import annotations

import torch

from . import _C
from ._fp8 import check_value_dtype, check_wire_dtype


def _exchange(group, gid, x, mode, seq, heads, kv, out, wire, return_scales):
    """quantize → the op on the FP8 rows and on the scales → dequantize (or the raw pair)."""
    where = f"[rank {group._rank}/{group._size}] all_to_all_4d"
    check_value_dtype(x.dtype, f"{where}: x's dtype with wire_dtype")
    check_wire_dtype(wire)
    summed = mode == 1 and kv > 1
    if return_scales and (out is not None or summed):
        raise ValueError(
            f"{where}: return_scales=True returns new FP8 rows and scales; it takes no out= and "
            "no mode 1 with kv_replicas > 1 (whose replicas are summed after dequantizing)"
        )
    x = x.contiguous()
    k = 1 if summed else kv  # mode 1 with replicas: the virtual heads as sent, summed below
    if x.is_cuda and group.transport == "nvlink":
        done = _fused(group, gid, x, mode, seq, heads, k, out, wire, return_scales, summed, kv)
        if done is not None:
            return done
    q = torch.empty(x.shape, dtype=wire, device=x.device)
    scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
    _C._fp8_quantize(x, q, scales)
    pad = 4 if group.transport in ("nvlink", "hierarchical") else 1  # P2P rows: 16-byte units
    s = scales.unsqueeze(-1)
    if pad > 1:
        s = torch.nn.functional.pad(s, (0, pad - 1))
    qo = _C.ulysses_all_to_all_4d(q, gid, mode, seq, heads, k)
    so = _C.ulysses_all_to_all_4d(s, gid, mode, seq, heads, k)[..., 0].contiguous()
    if return_scales:
        return qo, so
    if summed:
        y = torch.empty(qo.shape, dtype=x.dtype, device=x.device)
        _C._fp8_dequantize(qo, so, y)
        return _sum_replicas(group, y, kv, out)
    if out is None:
        out = torch.empty(qo.shape, dtype=x.dtype, device=x.device)
    else:
        _check_out(where, out, qo.shape, x.dtype)
    _C._fp8_dequantize(qo, so, out)
    return out


def _fused(group, gid, x, mode, seq, heads, k, out, wire, return_scales, summed, kv):
    """NOTE [fp8 fused push]: the transport quantizes as it writes into the peers' windows and
    dequantizes in its copy-out; None where it has no fused path for this call."""
    shape = list(group._shapes(gid, x, mode, seq, heads, k)[0])
    code = 0 if wire == torch.float8_e4m3fn else 1
    if return_scales:
        qo = torch.empty(shape, dtype=wire, device=x.device)
        so = torch.empty(shape[:-1], dtype=torch.float32, device=x.device)
        return (qo, so) if _C.ulysses_fp8_fused(x, gid, mode, seq, heads, k, qo, so, code) else None
    if summed:
        y = torch.empty(shape, dtype=x.dtype, device=x.device)
        if not _C.ulysses_fp8_fused(x, gid, mode, seq, heads, k, y, None, code):
            return None
        return _sum_replicas(group, y, kv, out)
    dst = out if out is not None else torch.empty(shape, dtype=x.dtype, device=x.device)
    if out is not None:
        _check_out(f"[rank {group._rank}/{group._size}] all_to_all_4d", out, shape, x.dtype)
    return dst if _C.ulysses_fp8_fused(x, gid, mode, seq, heads, k, dst, None, code) else None


def _sum_replicas(group, y, kv, out):
    """Mode 1 with kv replicas: each head's replicas summed (into ``out`` when given)."""
    reps = y.unflatten(2, (y.shape[2] // kv, kv))
    if out is None:
        return reps.sum(3)
    where = f"[rank {group._rank}/{group._size}] all_to_all_4d"
    _check_out(where, out, reps.shape[:3] + reps.shape[4:], y.dtype)
    return torch.sum(reps, 3, out=out)


def _check_out(where, out, shape, dtype):
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"{where}: out is {tuple(out.shape)} {out.dtype}, expected a contiguous "
            f"{tuple(shape)} {dtype}"
        )


class _Fp8Exchange(torch.autograd.Function):
    """The differentiable form: backward is the other mode with the same splits, in the
    gradient's dtype or (grad_wire) FP8 again."""

    @staticmethod
    def forward(ctx, x, group, mode, seq, heads, kv, wire, grad_wire):
        ctx.args = (group, mode, seq, heads, kv, grad_wire)
        return _exchange(group, group._id, x, mode, seq, heads, kv, None, wire, False)

    @staticmethod
    def backward(ctx, grad):
        group, mode, seq, heads, kv, grad_wire = ctx.args
        if grad_wire is None:
            g = group.all_to_all_4d(
                grad, mode=1 - mode, seq_splits=seq, head_splits=heads, kv_replicas=kv
            )
        else:
            g = _Fp8Exchange.apply(grad, group, 1 - mode, seq, heads, kv, grad_wire, grad_wire)
        return g, None, None, None, None, None, None, None


def call(group, x, mode, seq, heads, kv, out, wire, return_scales, grad_wire):
    """UlyssesGroup.all_to_all_4d with ``wire_dtype``."""
    if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.requires_grad:
        if out is not None or return_scales:
            raise RuntimeError(
                f"[rank {group._rank}/{group._size}] all_to_all_4d: out= and return_scales=True "
                "are not differentiable; x requires grad under grad mode"
            )
        return _Fp8Exchange.apply(x, group, mode, seq, heads, kv, wire, grad_wire)
    return _exchange(group, group._id, x, mode, seq, heads, kv, out, wire, return_scales)


def call_on_lane(group, gid, x, mode, seq, heads, kv, out, wire):
    """The async form's exchange on the group's side stream (the caller set the stream)."""
    return _exchange(group, gid, x, mode, seq, heads, kv, out, wire, False)
