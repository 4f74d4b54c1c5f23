# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Expert parallelism: MoE dispatch and combine (API.md §2b, docs/moe.md).

``ExpertParallelGroup`` sends each token to the ranks holding its top-k experts (``dispatch``),
grouped by local expert for a grouped GEMM, and brings the experts' rows back weighted to the
token's home (``combine``). The group checks the arguments, does the combine's arithmetic (NOTE
[moe combine order]) and carries autograd; a transport moves the rows (NOTE [moe transport seam]
in _moe_collective.py). CUDA groups over a fastcomms nvlink or nccl communicator whose ranks share
a host run the device transport (NOTE [moe device transport] in _moe_device.py: counts on the
GPU through device_alltoallv_single, no host sync, CUDA-graph capturable); every other group the
collective transport: all-to-alls on the group's backend (gloo on CPU; NCCL on CUDA and across
hosts), with one host sync per dispatch to read the routing (NOTE [moe collective host sync]).
``transport`` says which one a group runs.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from . import TorchComm
from ._fp8_wire import WIRE_DTYPES, check_value_dtype
from ._moe_collective import (
    _H_BAD,
    _H_K,
    _H_STATUS,
    _H_TOKENS,
    _H_WHERE,
    _H_WIRE,
    BAD_EXPERT,
    DUPLICATE,
    OVERFLOW,
    WIRE_CODES,
    CollectiveTransport,
    Plan,
)
from ._moe_device import DeviceTransport
from ._work import MoEWork, _Scoped

__all__ = ["DispatchHandle", "DispatchMeta", "ExpertParallelGroup", "MoEWork"]

# the dtypes a group may be built for, numbered for the construction's agreement check
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclasses.dataclass
class DispatchMeta:
    """What ``dispatch`` says about the rows it returns (``rows`` = ``recv_x.shape[0]``, the
    group's capacity for this k; rows past ``offsets[-1]`` are unspecified: zeros on the
    collective transport, not written on the device one, NaN included: docs/moe.md).

    - ``counts``: (local experts,) int32, rows per local expert;
    - ``offsets``: (local experts + 1,) int32, where each expert's rows start (``offsets[0]`` is
      0, ``offsets[-1]`` the rows in use; ``offsets[1:]`` is ``torch._grouped_mm``'s ``offs``);
    - ``weights``: (rows,) float32, the top-k weight of each row's (token, slot) (1.0 where
      dispatch got none); differentiable with respect to ``topk_weights``;
    - ``src``: (rows, 2) int64, the source rank and the token's position there;
    - ``scales``: (rows,) float32 with ``return_scales=True`` (``recv_x`` is then FP8, a row's
      values times its scale), else None.

    All on the group's device."""

    counts: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor
    src: torch.Tensor
    scales: torch.Tensor | None = None


class DispatchHandle:
    """What ``combine`` needs to bring a dispatch's rows home: the routing of both sides. Holds
    index tensors on the group's device; valid until the group is destroyed; reusable (a combine
    and its backward both read it)."""

    def __init__(self, group, plan: Plan, x_dtype, topk_weights):
        self._group, self._plan, self._x_dtype = group, plan, x_dtype
        self._topk_weights = topk_weights  # the tensor dispatch got (autograd flows to it)

    @property
    def rows(self) -> int:
        """The rows of ``recv_x`` (and of the ``y`` that combine takes)."""
        return self._plan.capacity

    @property
    def tokens(self) -> int:
        return self._plan.tokens

    @property
    def topk(self) -> int:
        return self._plan.k


# NOTE [moe combine order]: a token's output is its slots' rows times their weights summed in
# float32 (float64 for float64 rows) in slot order j = 0 .. k-1, starting from +0.0, each product
# rounded before it is added (no fused multiply-add), dropped slots adding nothing; the sum is then
# rounded once to x's dtype. The expert rows come home unreduced (one row per (token, slot)), so
# the bits depend only on the rows and weights, never on the world size or on which rank holds
# which expert: the same as one process computing sum_j w[t, j] * y[t, j] in that order. A device
# transport keeps this order (a per-rank partial sum would make the bits depend on the placement).
def _acc_dtype(*dtypes):
    acc = torch.float32
    for d in dtypes:
        acc = torch.promote_types(acc, d)
    return acc


_ROW_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _weighted_sum(rows, weights, dropped, out_dtype):
    """rows (T, k, H), weights (T, k), dropped (T, k) bool -> (T, H) in out_dtype."""
    acc_dtype = _acc_dtype(rows.dtype, out_dtype)
    w = weights.to(acc_dtype).masked_fill(dropped, 0)
    T, k, H = rows.shape
    if rows.is_cuda and acc_dtype == torch.float32 and out_dtype in _ROW_KERNEL_DTYPES:
        if rows.dtype in _ROW_KERNEL_DTYPES:  # NOTE [moe row kernels]: one pass, same bits
            from . import _C

            out = torch.empty((T, H), dtype=out_dtype, device=rows.device)
            _C._moe_weighted_sum(out, rows.reshape(T * k, H), None, w.contiguous())
            return out
    acc = torch.zeros((rows.shape[0], rows.shape[2]), dtype=acc_dtype, device=rows.device)
    for j in range(rows.shape[1]):
        acc = acc + w[:, j : j + 1] * rows[:, j].to(acc_dtype)
    return acc.to(out_dtype)


class _Dispatch(torch.autograd.Function):
    """recv_x and meta.weights as functions of x and topk_weights (computed before apply); the
    backward brings the rows' gradients home: gather, then a unit-weight sum (NOTE [moe combine
    order]) for x, the per-slot values for topk_weights."""

    @staticmethod
    def forward(ctx, x, topk_weights, box, handle):
        ctx.handle, ctx.x_dtype = handle, x.dtype
        recv_x, row_w = box  # (in a list: tensors made before apply, not inputs of it)
        if topk_weights is None:
            ctx.mark_non_differentiable(row_w)
        return recv_x, row_w

    @staticmethod
    def backward(ctx, g_x, g_w):
        h = ctx.handle
        plan, t = h._plan, h._group._live("backward of dispatch")
        dropped = plan.owner < 0
        gx = gw = None
        if ctx.needs_input_grad[0]:
            if g_x is None:
                g_x = dropped.new_zeros((plan.capacity, h._group.hidden), dtype=ctx.x_dtype)
            rows = t.gather(g_x.contiguous(), plan, False).wait()
            gx = _weighted_sum(
                rows, torch.ones(dropped.shape, device=rows.device), dropped, ctx.x_dtype
            )
        if ctx.needs_input_grad[1]:
            if g_w is None:
                g_w = dropped.new_zeros(plan.capacity, dtype=torch.float32)
            gw = t.gather(g_w.float().reshape(-1, 1).contiguous(), plan, False).wait()[..., 0]
        return gx, gw, None, None


class _Combine(torch.autograd.Function):
    """combine's output as a function of y and the weights (computed before apply); the backward
    sends the output's gradient to the experts again (scatter, as a dispatch) times each row's
    weight, and gives the weights' gradient from the rows that came home."""

    @staticmethod
    def forward(ctx, y, weights, box, handle):
        out, rows = box  # (in a list: tensors made before apply, not inputs of it)
        ctx.handle, ctx.y_dtype, ctx.w = handle, y.dtype, weights
        ctx.rows = rows if ctx.needs_input_grad[1] else None
        return out

    @staticmethod
    def backward(ctx, g):
        h = ctx.handle
        plan, t = h._plan, h._group._live("backward of combine")
        acc = _acc_dtype(ctx.y_dtype, g.dtype)
        w = ctx.w.detach().masked_fill(plan.owner < 0, 0)
        gy = gw = None
        if ctx.needs_input_grad[0]:
            rows, vals = t.scatter(g.contiguous(), w, plan, False).wait()
            gy = (rows.to(acc) * vals.to(acc).unsqueeze(1)).to(ctx.y_dtype)
        if ctx.needs_input_grad[1]:
            gw = (g.to(acc).unsqueeze(1) * ctx.rows.to(acc)).sum(2).to(ctx.w.dtype)
        return gy, gw, None, None


def _choose_transport(group, rank, size, device, max_output_bytes):
    """(transport, why): the one place a group's transport is chosen (NOTE [moe transport
    seam]). CUDA groups over a fastcomms nvlink or nccl communicator whose ranks share a host take
    the device transport (NOTE [moe device transport]: counts on the GPU, no host sync); the
    communicator's device all-to-all-v buffers are sized here (collective, eager), and where that
    setup refuses (ranks on several hosts: every rank alike) the group keeps the collective one."""
    if isinstance(group, TorchComm):
        backend = f"fastcomms {group.get_backend()}"
    else:
        import torch.distributed as dist

        backend = f"torch.distributed {dist.get_backend(group)}"
    if device.type != "cuda":
        why = f"{device.type} tensors over a {backend} group: the collective path (all-to-alls)"
        return CollectiveTransport(group, rank, size, device), why
    ours = isinstance(group, TorchComm) and group.get_backend().startswith(("nvlink", "nccl"))
    if ours and os.environ.get("FASTCOMMS_MOE_DEVICE", "1") == "0":
        # NOTE [moe device transport opt-out]: the device transport is the default where it can
        # serve; FASTCOMMS_MOE_DEVICE=0 keeps the collective one (to compare, or to bisect)
        why = (
            f"CUDA tensors over a {backend} group: the collective path (NCCL all-to-alls, one host "
            "sync per dispatch), chosen by FASTCOMMS_MOE_DEVICE=0"
        )
        return CollectiveTransport(group, rank, size, device), why
    if ours:
        from ._C import UnsupportedError

        try:
            # only grows (every rank builds the same groups in the same order, so every rank
            # decides alike): a smaller group on the same communicator keeps the larger buffers
            if max_output_bytes > getattr(group, "_moe_a2av_bytes", 0):
                group.device_alltoallv_prepare(max_output_bytes)
                group._moe_a2av_bytes = max_output_bytes
        except UnsupportedError as e:
            why = (
                f"CUDA tensors over a {backend} group whose device all-to-all-v refused ({e}): "
                "the collective path (NCCL all-to-alls, one host sync per dispatch)"
            )
            return CollectiveTransport(group, rank, size, device), why
        why = (
            f"CUDA tensors over a {backend} group with every rank on one host: the device path "
            "(device_alltoallv_single, counts on the GPU, no host sync, CUDA-graph capturable)"
        )
        return DeviceTransport(group, rank, size, device), why
    why = (
        f"CUDA tensors over a {backend} group: the collective path (NCCL all-to-alls, one host "
        "sync per dispatch); the device path needs a fastcomms nvlink or nccl communicator"
    )
    return CollectiveTransport(group, rank, size, device), why


def _device_bytes(size, max_tokens, hidden, dtype, num_experts):
    """The largest output of the device transport's exchanges for top-k up to min(E, 8) and
    rows of the group's dtype: a dispatch's P * M rows of hidden values plus 8 + 8k bytes of
    metadata, and a combine's M * k rows coming home."""
    k = min(num_experts, 8)
    es = torch.empty((), dtype=dtype).element_size()
    return max(size * max_tokens * (hidden * es + 8 + 8 * k), max_tokens * k * hidden * es, 64)


class ExpertParallelGroup(_Scoped):
    """MoE dispatch and combine over a group (a ``TorchComm``, a ProcessGroup, a 1-D DeviceMesh,
    or None: torch.distributed's default group), API.md §2b. ``num_experts`` split evenly: rank r
    holds experts ``[r * E / P, (r + 1) * E / P)`` (``local_experts``). ``hidden`` and ``dtype``
    are x's width and dtype; ``max_tokens_per_rank`` bounds the tokens one rank dispatches per
    call, and with it the receive buffers: ``recv_x`` has ``max_recv_rows(k)`` =
    ``P * max_tokens_per_rank * min(k, local experts)`` rows, enough for any routing (each token
    reaches a rank once and fills at most one row per local expert).

    Construction is collective (the ranks check they agree on the sizes); so is every call, in the
    same order on every rank, from one thread at a time. ``transport`` says how rows move
    ("device" or "collective"; NOTE [moe transport seam]) and ``transport_reason`` why. On the
    device transport a refused dispatch is flagged, not raised: ``check_errors()``. Tensors returned
    are the caller's; the group keeps none of them past a call (async calls keep theirs until
    ``wait()``). ``destroy()`` (or leaving ``with``) ends the group; later calls raise."""

    def __init__(self, group, num_experts, hidden, *, max_tokens_per_rank, dtype, device=None):
        from .device_mesh import group_rank_size, resolve_group

        who = "ExpertParallelGroup"
        for name, v in (
            ("num_experts", num_experts),
            ("hidden", hidden),
            ("max_tokens_per_rank", max_tokens_per_rank),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{who}: {name} must be an int >= 1, got {v!r}")
        if dtype not in _DTYPES:
            raise TypeError(
                f"{who}: dtype must be float16, bfloat16, float32 or float64, got {dtype!r}"
            )
        group, self.rank, self.size = group_rank_size(resolve_group(group, who, "ep"), who)
        self.group = group
        if device is None and isinstance(group, TorchComm):
            device = group.get_device()
        elif device is None:
            import torch.distributed as dist

            nccl = "nccl" in str(dist.get_backend(group)).lower() and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if nccl else "cpu"
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_experts, self.hidden, self.dtype = num_experts, hidden, dtype
        self.max_tokens_per_rank = max_tokens_per_rank
        self._where = f"[rank {self.rank}/{self.size}] {who}"
        self._transport, self.transport_reason = _choose_transport(
            group,
            self.rank,
            self.size,
            self.device,
            _device_bytes(self.size, max_tokens_per_rank, hidden, dtype, num_experts),
        )
        self.transport = self._transport.name
        # every rank's sizes, exchanged before any check that could differ between ranks, so a
        # disagreement raises on every rank instead of hanging one of them in a later call
        mine = torch.tensor(
            [num_experts, hidden, max_tokens_per_rank, _DTYPES.index(dtype), 0, 0, 0]
        )
        got = self._transport.exchange_header(mine.repeat(self.size, 1))
        for r in range(self.size):
            if not torch.equal(got[r], mine):
                e, h, m, d = got[r, :4].tolist()
                raise ValueError(
                    f"{self._where}: rank {r} was built with num_experts={e}, hidden={h}, "
                    f"max_tokens_per_rank={m}, dtype={_DTYPES[d]}; this rank with "
                    f"{num_experts}, {hidden}, {max_tokens_per_rank}, {dtype}: every rank "
                    "passes the same"
                )
        if num_experts % self.size:
            raise ValueError(
                f"{self._where}: num_experts ({num_experts}) must divide evenly over the "
                f"{self.size} ranks"
            )
        self.num_local_experts = num_experts // self.size
        self.local_experts = range(
            self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts
        )

    def max_recv_rows(self, k: int) -> int:
        """The rows of ``recv_x`` for top-``k`` routing (the capacity no routing can exceed)."""
        return self.size * self.max_tokens_per_rank * min(k, self.num_local_experts)

    # -- dispatch ---------------------------------------------------------------------------------
    def dispatch(
        self,
        x,
        topk_idx,
        topk_weights=None,
        *,
        wire_dtype=None,
        return_scales=False,
        async_op=False,
    ):
        """Sends each token of ``x`` (tokens, hidden) to the ranks holding its experts
        ``topk_idx`` (tokens, k) int64 (-1 drops a slot), once per rank, and returns
        ``(recv_x, meta, handle)``: this rank's rows grouped by local expert, contiguous (within
        an expert by source rank, source position, then slot), ``meta`` a DispatchMeta, and the
        handle ``combine`` takes. ``topk_weights`` (tokens, k) float32 travel with the tokens
        (``meta.weights``). ``wire_dtype=torch.float8_e4m3fn`` (or ``float8_e5m2``) sends FP8
        rows with one float32 scale per token, dequantized into x's dtype on receipt, or kept
        FP8 with ``return_scales=True`` (``meta.scales``; not differentiable). Differentiable in
        x and topk_weights (the backward is a combine of the gradients, in their dtype).
        ``async_op=True`` returns a MoEWork whose ``wait()`` gives the result (the routing is
        exchanged before this returns: NOTE [moe collective host sync])."""
        where = f"{self._where}.dispatch"
        self._check_alive(where)
        x, topk_idx, topk_weights = self._check_dispatch(
            where, x, topk_idx, topk_weights, wire_dtype, return_scales
        )
        T, k = topk_idx.shape
        t = self._transport
        if t.name == "device":  # NOTE [moe device transport]: no header read on the host
            pending = t.dispatch(
                x.detach(),
                topk_idx,
                None if topk_weights is None else topk_weights.detach(),
                wire_dtype,
                return_scales,
                P=self.size,
                L=self.num_local_experts,
                num_experts=self.num_experts,
                max_tokens=self.max_tokens_per_rank,
                capacity=self.max_recv_rows(k),
            )
            return self._finish_dispatch(pending, x, topk_weights, return_scales, async_op)
        head, owner, local, mask = t.header(
            topk_idx, self.num_experts, self.max_tokens_per_rank, wire_dtype, k
        )
        got = t.exchange_header(head)
        self._check_header(where, got, k, wire_dtype)
        capacity = self.max_recv_rows(k)
        pending = t.dispatch(
            x.detach(),
            topk_idx,
            None if topk_weights is None else topk_weights.detach(),
            wire_dtype,
            return_scales,
            owner,
            local,
            mask,
            got,
            capacity,
            self.num_local_experts,
            async_op,
        )
        return self._finish_dispatch(pending, x, topk_weights, return_scales, async_op)

    def _finish_dispatch(self, pending, x, topk_weights, return_scales, async_op):
        x_dtype, L = x.dtype, self.num_local_experts

        def finish(result):
            recv_x, counts, row_w, src, scales, plan = result
            offsets = torch.zeros(L + 1, dtype=torch.int32, device=counts.device)
            offsets[1:] = counts.cumsum(0)
            handle = DispatchHandle(self, plan, x_dtype, topk_weights)
            wants = x.requires_grad or (topk_weights is not None and topk_weights.requires_grad)
            if wants and torch.is_grad_enabled() and not return_scales:
                recv_x, row_w = _Dispatch.apply(x, topk_weights, [recv_x, row_w], handle)
            meta = DispatchMeta(counts, offsets, row_w, src, scales)
            return recv_x, meta, handle

        work = MoEWork(pending, finish)
        return work if async_op else work.wait()

    def _check_dispatch(self, where, x, idx, w, wire, return_scales):
        """Checks of the call that every rank can make alone (its own tensors' types and
        shapes); the checks of the values travel in the header (_check_header)."""
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"{where}: x must be (tokens, {self.hidden}), got {got}")
        if x.dtype != self.dtype:
            raise TypeError(
                f"{where}: x is {x.dtype}, the group was built for {self.dtype} (dtype=)"
            )
        if x.device != self.device:
            raise ValueError(f"{where}: x is on {x.device}, the group on {self.device}")
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.dim() != 2:
            got = f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else idx
            raise TypeError(f"{where}: topk_idx must be an int64 (tokens, k) tensor, got {got}")
        if idx.shape[0] != x.shape[0] or idx.shape[1] < 1:
            raise ValueError(
                f"{where}: topk_idx is {tuple(idx.shape)}, expected ({x.shape[0]}, k >= 1) for "
                f"x's {x.shape[0]} tokens"
            )
        if idx.device != x.device:
            raise ValueError(f"{where}: topk_idx is on {idx.device}, x on {x.device}")
        if w is not None:
            if not isinstance(w, torch.Tensor) or w.dtype != torch.float32:
                got = w.dtype if isinstance(w, torch.Tensor) else type(w).__name__
                raise TypeError(f"{where}: topk_weights must be float32, got {got}")
            if w.shape != idx.shape or w.device != x.device:
                raise ValueError(
                    f"{where}: topk_weights is {tuple(w.shape)} on {w.device}, expected "
                    f"topk_idx's {tuple(idx.shape)} on {x.device}"
                )
        if wire is not None:
            if wire not in WIRE_DTYPES:
                raise TypeError(
                    f"{where}: wire_dtype must be None, torch.float8_e4m3fn or "
                    f"torch.float8_e5m2, got {wire!r}"
                )
            check_value_dtype(x.dtype, f"{where}: x's dtype with wire_dtype")
        elif return_scales:
            raise ValueError(f"{where}: return_scales=True needs an FP8 wire_dtype")
        if (
            return_scales
            and torch.is_grad_enabled()
            and (x.requires_grad or (w is not None and w.requires_grad))
        ):
            raise RuntimeError(
                f"{where}: return_scales=True is not differentiable (FP8 rows); x or "
                "topk_weights requires grad under grad mode"
            )
        return x.contiguous(), idx.contiguous(), None if w is None else w.contiguous()

    def _refuse(self, where, r, status, n, bad, at, k, done):
        """Raises rank r's refusal (status bits of _moe_collective), if any."""
        if status & OVERFLOW:
            # Refused rather than silently wrong: the receive buffers (and recv_x's rows) are
            # sized from max_tokens_per_rank; more tokens could route past them.
            at_k = f" (recv_x holds {self.max_recv_rows(k)} rows at k={k})" if k else ""
            raise ValueError(
                f"{where}: rank {r} dispatches {n} tokens, more than max_tokens_per_rank="
                f"{self.max_tokens_per_rank} that the buffers were sized for{at_k}; {done}"
            )
        if status & BAD_EXPERT:
            raise ValueError(
                f"{where}: rank {r}'s topk_idx names expert {bad} (token {at}), outside "
                f"[-1, {self.num_experts}); {done}"
            )
        if status & DUPLICATE:
            raise ValueError(
                f"{where}: rank {r}'s token {at} names expert {bad} twice in its top-k; {done}"
            )

    def check_errors(self) -> None:
        """The device transport's refusals (NOTE [moe device refusals]): a dispatch that any
        rank refused (more tokens than max_tokens_per_rank, an expert id out of range, an expert
        twice in a token's top-k) sent nothing on every rank and was recorded on the GPU; this
        reads the record (one host sync, outside graph capture) and raises the first refusal
        since the last check, the same on every rank, then clears it. The collective transport
        raises at the call itself; here it does nothing."""
        where = f"{self._where}.check_errors"
        self._check_alive(where)
        t = self._transport
        if t.name != "device":
            return
        status, r, n, bad, at = (int(v) for v in t.flags.tolist())
        if status:
            t.flags.zero_()
            self._refuse(
                f"{self._where}.dispatch",
                r,
                status,
                n,
                bad,
                at,
                0,
                "that dispatch sent nothing (an empty dispatch on every rank)",
            )

    def _check_header(self, where, got, k, wire):
        """Every rank's verdict on its own call, as the header exchange brought it: the same
        error on every rank (NOTE [moe collective host sync])."""
        for r in range(self.size):
            status = int(got[r, _H_STATUS])
            n, bad, at = (int(got[r, f]) for f in (_H_TOKENS, _H_BAD, _H_WHERE))
            self._refuse(where, r, status, n, bad, at, k, "nothing was sent")
        ks, wires = got[:, _H_K].tolist(), got[:, _H_WIRE].tolist()
        if any(v != k for v in ks) or any(v != WIRE_CODES[wire] for v in wires):
            names = {v: str(d).removeprefix("torch.") for d, v in WIRE_CODES.items()}
            raise ValueError(
                f"{where}: every rank dispatches with the same k and wire_dtype; ranks sent "
                f"k={ks} and wire_dtype={[names[v] for v in wires]}"
            )

    # -- combine ----------------------------------------------------------------------------------
    def combine(self, y, handle, *, weights=None, async_op=False):
        """Brings the expert rows ``y`` (recv_x's rows, hidden) home and returns (tokens,
        hidden) in x's dtype: each token the sum of its slots' rows times their weights
        (NOTE [moe combine order]: float32, slot order, deterministic). ``weights`` (tokens, k)
        float32, None: dispatch's ``topk_weights`` (1.0 each where none were given).
        Differentiable in y and the weights. ``async_op=True`` returns a MoEWork."""
        where = f"{self._where}.combine"
        self._check_alive(where)
        if not isinstance(handle, DispatchHandle) or handle._group is not self:
            raise TypeError(f"{where}: handle must be a DispatchHandle from this group's dispatch")
        plan = handle._plan
        if (
            not isinstance(y, torch.Tensor)
            or y.dim() != 2
            or tuple(y.shape) != (plan.capacity, self.hidden)
        ):
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(
                f"{where}: y must be ({plan.capacity}, {self.hidden}) (recv_x's rows), got {got}"
            )
        if not y.is_floating_point() or y.dtype in WIRE_DTYPES or y.device != self.device:
            raise TypeError(
                f"{where}: y must be a float16/bfloat16/float32/float64 tensor on {self.device}, "
                f"got {y.dtype} on {y.device}"
            )
        if weights is None:
            weights = handle._topk_weights
        elif not isinstance(weights, torch.Tensor) or weights.dtype != torch.float32:
            got = weights.dtype if isinstance(weights, torch.Tensor) else type(weights).__name__
            raise TypeError(f"{where}: weights must be float32, got {got}")
        elif tuple(weights.shape) != (plan.tokens, plan.k) or weights.device != self.device:
            raise ValueError(
                f"{where}: weights is {tuple(weights.shape)} on {weights.device}, expected "
                f"({plan.tokens}, {plan.k}) on {self.device}"
            )
        if weights is None:
            weights = torch.ones((plan.tokens, plan.k), device=self.device)
        x_dtype = handle._x_dtype
        t = self._transport
        grad = torch.is_grad_enabled()  # the call's, not the wait's (an async combine)
        if (
            t.name == "device"
            and y.is_cuda
            and not (grad and weights.requires_grad)
            and y.dtype in _ROW_KERNEL_DTYPES
            and x_dtype in _ROW_KERNEL_DTYPES
        ):
            # NOTE [moe row kernels]: the sum reads the rows where they arrived, through the
            # index; the (T, k, hidden) rows are only made for the weights' gradient
            pending = t.gather_home(y.detach().contiguous(), plan, async_op)

            def finish_indexed(res):
                from . import _C

                recv, slot_src = res
                w = weights.detach().float().masked_fill(plan.owner < 0, 0).contiguous()
                out = torch.empty((plan.tokens, self.hidden), dtype=x_dtype, device=self.device)
                _C._moe_weighted_sum(out, recv, slot_src, w)
                if grad and y.requires_grad:  # (the weights' gradient: not on this path)
                    out = _Combine.apply(y, weights.detach(), [out, None], handle)
                return out

            work = MoEWork(pending, finish_indexed)
            return work if async_op else work.wait()
        pending = t.gather(y.detach().contiguous(), plan, async_op)

        def finish(rows):
            with torch.no_grad():
                out = _weighted_sum(rows, weights.detach(), plan.owner < 0, x_dtype)
            if torch.is_grad_enabled() and (y.requires_grad or weights.requires_grad):
                out = _Combine.apply(y, weights, [out, rows], handle)
            return out

        work = MoEWork(pending, finish)
        return work if async_op else work.wait()

    # -- lifetime ---------------------------------------------------------------------------------
    def _check_alive(self, where):
        if self.transport == "destroyed":
            raise ValueError(f"{where}: the group was destroyed")

    def _live(self, what):
        """The transport, for a backward (which may run after the group's ``with`` block)."""
        self._check_alive(f"{self._where}: {what}")
        return self._transport

    def destroy(self) -> None:
        """Ends the group (collective: call it on every rank). Handles and tensors returned
        earlier stay valid; later calls raise."""
        self._transport = None
        self.transport = "destroyed"
