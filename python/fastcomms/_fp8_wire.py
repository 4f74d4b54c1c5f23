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

import weakref

import torch

from . import _C
from ._fp8 import check_value_dtype, check_wire_dtype

# op id -> its UlyssesGroup (UlyssesGroup.__init__ adds itself), for the op's kernel
groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _exchange(group, gid, x, mode, seq, heads, kv, out, wire, return_scales):
    """quantize → the op on the FP8 rows and on the scales → dequantize (or the raw pair)."""
    where = f"[rank {group._rank}/{group._size}] all_to_all_4d"
    summed = mode == 1 and kv > 1
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


def _checked(group, x, mode, kv, out, wire, return_scales, grad_wire):
    """The call's arguments, checked before anything runs (or is traced)."""
    where = f"[rank {group._rank}/{group._size}] all_to_all_4d"
    if wire is None:
        raise ValueError(f"{where}: return_scales and grad_wire_dtype need wire_dtype")
    check_value_dtype(x.dtype, f"{where}: x's dtype with wire_dtype")
    check_wire_dtype(wire)
    if grad_wire is not None:
        check_wire_dtype(grad_wire)
    if return_scales and (out is not None or (mode == 1 and kv > 1)):
        raise ValueError(
            f"{where}: return_scales=True returns new FP8 rows and scales; it takes no out= and "
            "no mode 1 with kv_replicas > 1 (whose replicas are summed after dequantizing)"
        )
    if (out is not None or return_scales) and torch.is_grad_enabled() and x.requires_grad:
        raise RuntimeError(
            f"{where}: out= and return_scales=True are not differentiable; x requires grad under "
            "grad mode"
        )


# NOTE [fp8 wire op]: the exchange with wire_dtype is one torch op, so torch.compile traces it
# (fullgraph) like the plain op: its kernel is _exchange on the group the op id names, its fake
# kernel the plan's shapes (as the plain op's Meta kernel), its backward the other mode with the
# same splits, by the plain op in the gradient's dtype or by this op with grad_wire.
@torch.library.custom_op("fastcomms::ulysses_all_to_all_4d_fp8", mutates_args=())
def _op(
    x: torch.Tensor,
    gid: int,
    mode: int,
    seq: list[int] | None,
    heads: list[int] | None,
    kv: int,
    wire: torch.dtype,
    return_scales: bool,
    grad_wire: torch.dtype | None,
) -> list[torch.Tensor]:
    got = _exchange(groups[gid], gid, x, mode, seq, heads, kv, None, wire, return_scales)
    return list(got) if return_scales else [got]


@_op.register_fake
def _(x, gid, mode, seq, heads, kv, wire, return_scales, grad_wire):
    shape, result = _C.ulysses_shapes(gid, list(x.shape), x.element_size(), mode, seq, heads, kv)
    if return_scales:
        return [x.new_empty(shape, dtype=wire), x.new_empty(shape[:-1], dtype=torch.float32)]
    return [x.new_empty(result)]


def _setup_context(ctx, inputs, output):
    _, gid, mode, seq, heads, kv, _, _, grad_wire = inputs
    ctx.args = (gid, 1 - mode, seq, heads, kv)
    ctx.grad_wire = grad_wire


def _backward(ctx, grads):
    g, args, wire = grads[0], ctx.args, ctx.grad_wire
    if wire is None:
        gx = torch.ops.fastcomms.ulysses_all_to_all_4d(g, *args)
    else:
        gx = _op(g, *args, wire, False, wire)[0]
    return gx, None, None, None, None, None, None, None, None


_op.register_autograd(_backward, setup_context=_setup_context)


def call(group, x, mode, seq, heads, kv, out, wire, return_scales, grad_wire):
    """UlyssesGroup.all_to_all_4d and the functional form with ``wire_dtype`` (NOTE [fp8 wire
    op]); ``out=`` runs the exchange directly (not differentiable)."""
    _checked(group, x, mode, kv, out, wire, return_scales, grad_wire)
    if out is not None:
        return _exchange(group, group._id, x, mode, seq, heads, kv, out, wire, False)
    got = _op(x, group._id, mode, seq, heads, kv, wire, return_scales, grad_wire)
    return tuple(got) if return_scales else got[0]


def call_on_lane(group, gid, x, mode, seq, heads, kv, out, wire):
    """The async form's exchange on the group's side stream (the caller set the stream)."""
    _checked(group, x, mode, kv, out, wire, False, None)
    return _exchange(group, gid, x, mode, seq, heads, kv, out, wire, False)
