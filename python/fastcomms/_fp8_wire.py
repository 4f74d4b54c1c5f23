# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""FP8 on the wire for the Ulysses all-to-all (API.md §2, issue 38; the numerics are NOTE [fp8
wire] in include/fastcomms/ulysses/fp8.hpp, the torch reference in tests/python/fp8_reference.py).

NOTE [fp8 wire exchange]: a call with ``wire_dtype`` quantizes x's rows of ``d`` values (one
float32 scale per (token, head) row) with the extension's kernels, moves the FP8 rows and the
scales through the group's Ulysses op as two exchanges of the same geometry (the scales padded to
16 bytes a row on the peer-to-peer paths) and dequantizes into the output dtype (or returns them,
``return_scales=True``): exactly quantize -> exchange -> dequantize of the torch reference. Mode 1
with ``kv_replicas`` sums each head's replicas after dequantizing. On the NVLink transport the
quantization is fused into the transfer where it can be (NOTE [fp8 fused push], docs/design.md).
Backward: the gradient in its own dtype by the other mode, or FP8 again with ``grad_wire_dtype``.
"""

from __future__ import annotations

import weakref

import torch

from . import _C

#: The dtypes that can be sent as FP8 (and that FP8 is dequantized into), and the wire formats.
VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WIRE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _name(dtype: object) -> str:
    return str(dtype).removeprefix("torch.")


def check_value_dtype(dtype: object, what: str) -> None:
    """Raises TypeError unless ``dtype`` is float16, bfloat16 or float32."""
    if dtype not in VALUE_DTYPES:
        raise TypeError(f"fp8: {what} must be float16, bfloat16 or float32, got {_name(dtype)}")


def check_wire_dtype(wire_dtype: object) -> None:
    """Raises TypeError unless ``wire_dtype`` is torch.float8_e4m3fn or torch.float8_e5m2."""
    if wire_dtype not in WIRE_DTYPES:
        raise TypeError(
            "fp8: wire_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got "
            f"{_name(wire_dtype)}"
        )


# op id -> its UlyssesGroup (UlyssesGroup.__init__ adds itself), for the op's kernel
groups: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _exchange(group, gid, x, mode, seq, heads, kv, out, wire, return_scales):
    """quantize -> the op on the FP8 rows and on the scales -> dequantize (or the raw pair)."""
    summed = mode == 1 and kv > 1
    k = 1 if summed else kv  # mode 1 with replicas: the virtual heads as sent, summed below
    x = x.contiguous()
    got = None
    if x.is_cuda and group.transport == "nvlink":
        got = _fused(
            group, gid, x, mode, seq, heads, k, None if summed else out, wire, return_scales
        )
    if got is None:
        q = torch.empty(x.shape, dtype=wire, device=x.device)
        scales = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        _C._fp8_quantize(x, q, scales)
        s = scales.unsqueeze(-1)
        if group.transport in ("nvlink", "hierarchical"):  # P2P rows: 16-byte units
            s = torch.nn.functional.pad(s, (0, 3))
        qo = _C.ulysses_all_to_all_4d(q, gid, mode, seq, heads, k)
        so = _C.ulysses_all_to_all_4d(s, gid, mode, seq, heads, k)[..., 0].contiguous()
        if return_scales:
            return qo, so
        got = _into(group, None if summed else out, qo.shape, x)
        _C._fp8_dequantize(qo, so, got)
    if summed:  # each head's replicas summed (into ``out`` when given)
        reps = got.unflatten(2, (got.shape[2] // kv, kv))
        if out is None:
            return reps.sum(3)
        return torch.sum(reps, 3, out=_into(group, out, reps.shape[:3] + reps.shape[4:], got))
    return got


def _fused(group, gid, x, mode, seq, heads, k, out, wire, return_scales):
    """NOTE [fp8 fused push]: the transport quantizes as it writes into the peers' windows and
    dequantizes in its copy-out; None where it has no fused path for this call."""
    shape = list(group._shapes(gid, x, mode, seq, heads, k)[0])
    if return_scales:
        dst = x.new_empty(shape, dtype=wire)
        so = x.new_empty(shape[:-1], dtype=torch.float32)
    else:
        dst, so = _into(group, out, shape, x), None
    code = 0 if wire == torch.float8_e4m3fn else 1
    if _C.ulysses_fp8_fused(x, gid, mode, seq, heads, k, dst, so, code):
        return (dst, so) if return_scales else dst
    return None


def _into(group, out, shape, like):
    """``out`` checked against the result's shape and ``like``'s dtype, or a new tensor."""
    if out is None:
        return like.new_empty(shape)
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or not out.is_contiguous():
        raise ValueError(
            f"[rank {group._rank}/{group._size}] all_to_all_4d: out is {tuple(out.shape)} "
            f"{out.dtype}, expected a contiguous {tuple(shape)} {like.dtype}"
        )
    return out


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


def call(group, x, mode, seq, heads, kv, out, wire, return_scales=False, grad_wire=None, gid=None):
    """UlyssesGroup.all_to_all_4d and the functional form with ``wire_dtype`` (NOTE [fp8 wire
    op]); ``out=`` runs the exchange directly (not differentiable), on the transport ``gid``
    names where given (the async form's lane: its caller set the side stream)."""
    _checked(group, x, mode, kv, out, wire, return_scales, grad_wire)
    if out is not None:
        gid = group._id if gid is None else gid
        return _exchange(group, gid, x, mode, seq, heads, kv, out, wire, False)
    got = _op(x, group._id, mode, seq, heads, kv, wire, return_scales, grad_wire)
    return tuple(got) if return_scales else got[0]
