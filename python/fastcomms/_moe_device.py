# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The device transport of ``fastcomms.moe`` (docs/moe.md): MoE dispatch and combine with the
routing planned on the GPU and every count exchanged on the GPU through
``device_alltoallv_single`` (issue 52). No host sync in dispatch, combine or their backwards;
every tensor has a shape fixed by (tokens, k, the group's sizes), so both calls capture in a CUDA
graph and replay with new routing written into the same ``topk_idx``.

NOTE [moe device transport]: the same three moves as the collective transport (NOTE [moe
transport seam]) with the same results bit for bit (rows, their order, meta, the combine's
operands), computed without reading a value on the host:
- home side: a token's destination ranks as a (P, T) mask; the rows to send are packed by
  destination then token (the collective's ``mask.nonzero()`` order) with a prefix sum and a
  scatter into a send buffer of the fixed size T * min(k, P); per-row metadata (source position,
  FP8 scale, k local expert ids, k weights) travels in the row's bytes, as on the collective path;
- counts: one all-to-all of a fixed (P, 5) int64 header (count, status, tokens, bad expert, token)
  through ``device_alltoallv_single`` with constant splits of one row each (the equal-split
  all-to-all, capturable); every rank thus sees every rank's verdict on its own routing;
- rows: ``device_alltoallv_single`` of the packed rows into a receive buffer of P *
  max_tokens_per_rank rows (a token reaches a rank at most once);
- expert side: the received (token, slot) pairs, keyed by local expert (L for none), stably
  sorted: the first ``capacity`` entries are the rows grouped by expert, within an expert by
  source rank, source position, slot (NOTE [moe row order]); counts are a scatter_add of ones;
- combine: the reverse path, the rows sent back in arrival order and put into their home slots by
  the permutation the collective's ``slot_order`` is.
The plan is three steps of kernels on CUDA (NOTE [moe plan kernels]: home, send, expert; a
handful of launches where the torch plan was some 700 ops on the host) and the torch functions
``home_torch``, ``send_torch`` and ``expert_torch`` on CPU and past the kernels' sizes, with the
same results (test_moe_device_gpu compares them on random routing). Rows are moved by the row
kernels (NOTE [moe row kernels]): a gather bounded by a count the
GPU holds, so a dispatch reads the rows it has, not the rows its worst case could have; rows of
recv_x past the ones in use are not written on CUDA (NOTE [moe recv_x tail]: API.md leaves them
unspecified; their meta is zeros, src -1), and FP8 rows are dequantized as they are gathered.

NOTE [moe device refusals]: a refusal (more tokens than max_tokens_per_rank, an expert id out of
range, an expert twice in a token's top-k) cannot raise at the call without reading the routing
on the host. Instead the rank's verdict travels in the counts header; if any rank refused, every
rank sends and receives nothing in that call (the result is an empty dispatch, a combine of
zeros) and records the first refusal in ``flags`` (on the GPU, the same on every rank).
``ExpertParallelGroup.check_errors()`` reads it (one host sync, where the caller chooses) and
raises the collective transport's message on every rank. The token count is a shape, so the
overflow verdict is made on the host without a sync, but it travels the same way so that no rank
raises alone while its peers wait in the exchange.

The routing math below is a set of pure functions over an injected ``a2av(out, inp, out_splits,
in_splits)``: the GPU path passes ``device_alltoallv_single``; the CPU test passes an
all_to_all_single that reads the splits on the host (tests only).
"""

from __future__ import annotations

import dataclasses

import torch

from ._moe_collective import BAD_EXPERT, DUPLICATE, OVERFLOW, _Pending, _pick, row_meta, verdict

# counts header fields, one int64 each, per (sender, receiver)
_D_COUNT, _D_STATUS, _D_TOKENS, _D_BAD, _D_WHERE = range(5)
_DHEADER = 5
# flags: status, the refusing rank, its tokens, the bad expert, the token
FLAGS = 5


def _arange(n, device):
    return torch.arange(n, device=device)


def _bytes2d(t: torch.Tensor, rows: int) -> torch.Tensor:
    """A contiguous t as (rows, bytes per row) uint8."""
    return t.view(torch.uint8).reshape(rows, t.numel() * t.element_size() // max(rows, 1))


def _gather(dst, src, index, count=None, zero_rest=True):
    """dst[i] = src[index[i]] (uint8 rows) for i < count, a zero row for index < 0; rows from count
    on zeroed (zero_rest) or left as they are. ``count`` a (1,) int64 tensor or None (all rows).
    CUDA: the row kernel (NOTE [moe row kernels]: the count is read on the GPU, rows past it cost
    no read); CPU: torch ops (tests), rows from count on zeroed either way."""
    n = dst.shape[0]
    if n == 0 or dst.shape[1] == 0:
        return dst
    if dst.is_cuda:
        from . import _C

        _C._moe_gather_rows(dst, src, index, count, zero_rest)
        return dst
    keep = (index >= 0) & (index < src.shape[0])
    if count is not None:
        keep &= _arange(n, dst.device) < count
    if src.shape[0] == 0:
        return dst.zero_()
    rows = src.index_select(0, index.clamp(0, src.shape[0] - 1))
    return dst.copy_(rows * keep.to(torch.uint8).unsqueeze(1))


@dataclasses.dataclass
class DevicePlan:
    """The device transport's routing, every field a tensor of a fixed shape (the dispatch
    handle's contents). ``tokens``, ``k``, ``capacity`` and ``owner`` are what the group reads."""

    tokens: int
    k: int
    capacity: int
    recv_rows: int  # R = P * max_tokens_per_rank
    owner: torch.Tensor  # (T, k) rank of each slot's expert, -1 dropped (or nothing sent)
    # home side
    send_tok: torch.Tensor  # (S,) token of each packed row (S = T * min(k, P))
    send_splits: torch.Tensor  # (P,) int64 rows sent to each peer
    back_splits: torch.Tensor  # (P,) rows gather receives from each peer
    slot_src: torch.Tensor  # (T * k,) row of gather's receive buffer of each flat slot, or -1
    # expert side
    recv_splits: torch.Tensor  # (P,) tokens received from each peer
    row_tok: torch.Tensor  # (capacity,) received token of each grouped row
    row_slot: torch.Tensor  # (capacity,) its slot at home
    row_keep: torch.Tensor  # (capacity,) bool: rows in use
    back_rows: torch.Tensor  # (capacity,) grouped rows in arrival order (gather's send)
    rows_from: torch.Tensor  # (P,) grouped rows per source rank (gather's send splits)
    send_total: torch.Tensor  # (1,) rows sent (send_splits' sum)
    row_total: torch.Tensor  # (1,) grouped rows in use (rows_from's sum)


def plan_home(idx, P, L, num_experts):
    """Home side of a dispatch: (owner, local, send_tok (S,), send_dest (S,), send_counts (P,))."""
    T, k = idx.shape
    dev = idx.device
    valid = (idx >= 0) & (idx < num_experts)
    owner = torch.where(valid, idx.div(L, rounding_mode="floor"), -1)
    local = torch.where(valid, idx.remainder(L), -1)
    mask = (owner.unsqueeze(0) == _arange(P, dev).view(P, 1, 1)).any(2)  # (P, T)
    send_counts = mask.sum(1)
    S = T * min(k, P)
    flat = mask.flatten()
    pos = torch.where(flat, flat.cumsum(0) - 1, S)  # packed position, or the discard row S
    ids = _arange(P * T, dev)
    send_tok = torch.zeros(S + 1, dtype=torch.int64, device=dev).scatter_(0, pos, ids % max(T, 1))
    send_dest = torch.zeros(S + 1, dtype=torch.int64, device=dev).scatter_(0, pos, ids // max(T, 1))
    return owner, local, send_tok[:S], send_dest[:S], send_counts


def exchange_counts(a2av, head):
    """(P, n) int64 per peer -> (P, n) from each peer: equal splits of one row."""
    P = head.shape[0]
    ones = torch.ones(P, dtype=torch.int64, device=head.device)
    out = torch.empty_like(head)
    a2av(out, head.contiguous(), ones, ones)
    return out


def home_torch(idx, P, L, num_experts, max_tokens):
    """The home side in torch (the CPU path, and the GPU's past the plan kernels' sizes):
    (head (P, 5), owner (T, k), local (T, k), send_tok (S,), send_dest (S,)), the results of
    ``_C._moe_plan_home`` (NOTE [moe plan kernels])."""
    T = idx.shape[0]
    status, bad, where = verdict(idx, num_experts, max_tokens)
    owner, local, send_tok, send_dest, send_counts = plan_home(idx, P, L, num_experts)
    head = torch.stack(
        [
            send_counts,
            status.expand(P),
            torch.full_like(send_counts, T),
            bad.expand(P),
            where.expand(P),
        ],
        dim=1,
    )
    return head, owner, local, send_tok, send_dest


def send_torch(
    got, head, owner, local, send_tok, send_dest, scales, weights, flags, send, row_bytes
):
    """After the header exchange, in torch: (send_splits, recv_splits, back_splits, slot_src,
    send_total), ``flags`` and ``owner`` updated in place and each sent row's metadata written
    into ``send[:, row_bytes:]``: the results of ``_C._moe_plan_send``."""
    P = head.shape[0]
    T, k = owner.shape
    dev = owner.device
    refused = got[:, _D_STATUS] != 0
    ok = ~refused.any()
    r = refused.to(torch.int32).argmax().long()
    row = _pick(got, r)
    new = torch.stack([row[_D_STATUS], r, row[_D_TOKENS], row[_D_BAD], row[_D_WHERE]])
    flags.copy_(torch.where(flags[0] != 0, flags, torch.where(ok, flags, new)))
    send_splits = head[:, _D_COUNT] * ok
    recv_splits = got[:, _D_COUNT] * ok
    owner.copy_(torch.where(ok, owner, -1))
    # the way back: by owner rank, then flat slot t * k + j
    back = torch.where(owner >= 0, owner, P).flatten()
    slot_order = back.argsort(stable=True)
    back_all = torch.zeros(P + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, back, torch.ones_like(back)
    )
    back_splits = back_all[:P]
    back_pos = torch.empty_like(slot_order).scatter_(0, slot_order, _arange(T * k, dev))
    slot_src = torch.where(back_pos < back_splits.sum(), back_pos, -1)
    if scales is None:
        scales = torch.zeros(T, dtype=torch.float32, device=dev)
    meta = row_meta(send_tok, send_dest, owner, local, scales, weights, k).view(torch.uint8)
    send[:, row_bytes : row_bytes + meta.shape[1]].copy_(meta)
    return send_splits, recv_splits, back_splits, slot_src, send_splits.sum().reshape(1)


def expert_torch(recv, row_bytes, recv_splits, k, L, capacity, want_scales):
    """The expert side in torch, from the received metadata: (counts, row_tok, row_slot,
    row_keep, back_rows, rows_from, row_total, row_w, src, row_scales or None), the results of
    ``_C._moe_plan_expert``."""
    R = recv.shape[0]
    P = recv_splits.shape[0]
    dev = recv.device
    row_ok = _arange(R, dev) < recv_splits.sum()
    src_rank = torch.searchsorted(recv_splits.cumsum(0), _arange(R, dev), right=True)
    src_rank = src_rank.clamp(max=P - 1)
    m = recv[:, row_bytes : row_bytes + 4 * (2 + 2 * k)].contiguous().view(torch.int32)
    pos, sc, rloc = m[:, 0].long(), m[:, 1].view(torch.float32), m[:, 2 : 2 + k]
    rw = m[:, 2 + k :].view(torch.float32)
    pair_ok = (rloc >= 0) & (rloc < L) & row_ok.unsqueeze(1)
    key = torch.where(pair_ok, rloc.long(), L).flatten()  # (R * k)
    perm = key.argsort(stable=True)  # NOTE [moe row order]
    grouped = perm[:capacity]
    per_expert = torch.zeros(L + 1, dtype=torch.int64, device=dev).scatter_add_(
        0, key, torch.ones_like(key)
    )
    counts = per_expert[:L].to(torch.int32)
    total = per_expert[:L].sum()
    row_keep = _arange(capacity, dev) < total
    row_tok = torch.where(row_keep, grouped // k, 0)
    row_slot = torch.where(row_keep, grouped % k, 0)
    inv = torch.empty_like(perm).scatter_(0, perm, _arange(perm.shape[0], dev))
    arrival = (~pair_ok).flatten().to(torch.int8).argsort(stable=True)[:capacity]
    back_rows = torch.where(row_keep, inv[arrival], 0)
    rows_from = torch.zeros(P, dtype=torch.int64, device=dev).scatter_add_(
        0, src_rank, pair_ok.sum(1)
    )
    row_w = torch.where(row_keep, rw[row_tok, row_slot], 0.0)
    src = torch.stack([src_rank[row_tok], pos[row_tok]], 1)
    src = torch.where(row_keep.unsqueeze(1), src, -1)
    row_scales = torch.where(row_keep, sc[row_tok], 0.0) if want_scales else None
    return (
        counts,
        row_tok,
        row_slot,
        row_keep,
        back_rows,
        rows_from,
        total.reshape(1),
        row_w,
        src,
        row_scales,
    )


def plan_kernels(device, P, L) -> bool:
    """Whether the plan runs as the three kernels (NOTE [moe plan kernels]): CUDA, a build with
    them, at most their keys; else the torch functions above."""
    if device.type != "cuda":
        return False
    from . import _C

    return _C._moe_has_row_kernels() and _C._moe_plan_fits(P, L)


def dispatch(
    a2av,
    x,
    idx,
    weights,
    wire,
    return_scales,
    *,
    P,
    L,
    num_experts,
    max_tokens,
    capacity,
    flags=None,
    kernels=None,
    zero_tail=False,
):
    """The whole dispatch on the device: (recv_x, counts, row weights, src, row scales or None,
    plan). ``flags`` (FLAGS,) int64, updated in place with the first refusal (NOTE [moe device
    refusals]). ``kernels``: the plan kernels or torch (default: plan_kernels). ``zero_tail``:
    NOTE [moe recv_x tail]."""
    T, k = idx.shape
    dev, H, value_dtype = x.device, x.shape[1], x.dtype
    R = P * max_tokens
    if kernels is None:
        kernels = plan_kernels(dev, P, L)
    if flags is None:
        flags = torch.zeros(FLAGS, dtype=torch.int64, device=dev)
    if weights is not None:
        weights = weights.float().contiguous()
    from . import _C

    if kernels:
        home = _C._moe_plan_home(
            idx.contiguous(), P, L, num_experts, max_tokens, OVERFLOW, BAD_EXPERT, DUPLICATE
        )
    else:
        home = home_torch(idx, P, L, num_experts, max_tokens)
    head, owner, local, send_tok, send_dest = home
    got = exchange_counts(a2av, head)
    scales = None
    if wire is not None:
        scales = torch.zeros(T, dtype=torch.float32, device=dev)
        q = torch.empty(x.shape, dtype=wire, device=dev)
        _C._fp8_quantize(x, q, scales)  # NOTE [fp8 wire]
        x = q
    row_bytes = H * x.element_size()
    S = send_tok.shape[0]
    send = torch.empty((S, row_bytes + 4 * (2 + 2 * k)), dtype=torch.uint8, device=dev)
    plan_send = _C._moe_plan_send if kernels else send_torch
    send_splits, recv_splits, back_splits, slot_src, send_total = plan_send(
        got, head, owner, local, send_tok, send_dest, scales, weights, flags, send, row_bytes
    )
    _gather(send[:, :row_bytes], _bytes2d(x.contiguous(), T), send_tok, send_total, False)
    recv = torch.empty((R, send.shape[1]), dtype=torch.uint8, device=dev)
    a2av(recv, send, recv_splits, send_splits)
    plan_expert = _C._moe_plan_expert if kernels else expert_torch
    (counts, row_tok, row_slot, row_keep, back_rows, rows_from, row_total, row_w, src, scl) = (
        plan_expert(recv, row_bytes, recv_splits, k, L, capacity, wire is not None)
    )
    plan = DevicePlan(
        tokens=T,
        k=k,
        capacity=capacity,
        recv_rows=R,
        owner=owner,
        send_tok=send_tok,
        send_splits=send_splits,
        back_splits=back_splits,
        slot_src=slot_src,
        recv_splits=recv_splits,
        row_tok=row_tok,
        row_slot=row_slot,
        row_keep=row_keep,
        back_rows=back_rows,
        rows_from=rows_from,
        send_total=send_total,
        row_total=row_total,
    )
    rows = recv[:, :row_bytes]  # (R, H) as sent, as bytes
    # NOTE [moe recv_x tail]: on CUDA only the rows in use are written (rows past the counts are
    # unspecified, API.md); zero_tail=True zeroes them and dequantizes FP8 rows over the whole
    # buffer, as before 2026-12-07 (a benchmark's baseline). On CPU the rows past are zeros.
    fill = zero_tail or dev.type != "cuda"
    if wire is not None and not return_scales:
        recv_x = torch.empty((capacity, H), dtype=value_dtype, device=dev)
        if not fill:  # the grouped FP8 rows dequantized as they are gathered, rows in use only
            _C._moe_gather_dequant(recv_x, rows.view(x.dtype), scl, row_tok, row_total)
            return recv_x, counts, row_w, src, None, plan
        # the grouped FP8 rows, then dequantized with their scales (zero rows, scale 0: zeros)
        q = torch.empty((capacity, H), dtype=x.dtype, device=dev)
        _gather(_bytes2d(q, capacity), rows, row_tok, row_total)
        _C._fp8_dequantize(q, scl, recv_x)
        return recv_x, counts, row_w, src, None, plan
    recv_x = torch.empty((capacity, H), dtype=x.dtype, device=dev)
    _gather(_bytes2d(recv_x, capacity), rows, row_tok, row_total, fill)
    return recv_x, counts, row_w, src, scl, plan


def gather_home(a2av, y, plan: DevicePlan, a2av_index=None):
    """Expert rows y (capacity, C) -> their receive buffer at home, (T * k, C) in y's dtype, row
    ``plan.slot_src[t * k + j]`` for slot (t, j) (-1: dropped, no row). ``a2av_index(out, inp,
    index, out_splits, in_splits)``: an all-to-all-v that reads its rows through an index (NOTE
    [indexed push]: y's rows go in arrival order without a packed copy); None: pack, then a2av."""
    C = y.shape[1]
    width = C * y.element_size()
    dev = y.device
    rows = _bytes2d(y.contiguous(), y.shape[0])
    n = plan.tokens * plan.k
    recv = torch.empty((n, width), dtype=torch.uint8, device=dev)
    if a2av_index is not None and width > 0:
        a2av_index(recv, rows, plan.back_rows, plan.back_splits, plan.rows_from)
        return recv.view(y.dtype).view(n, C)
    send = torch.empty((plan.capacity, width), dtype=torch.uint8, device=dev)
    _gather(send, rows, plan.back_rows, plan.row_total, False)
    a2av(recv, send, plan.back_splits, plan.rows_from)
    return recv.view(y.dtype).view(n, C)


def gather(a2av, y, plan: DevicePlan, a2av_index=None):
    """Expert rows y (capacity, C) -> (T, k, C) at home, zeros in dropped slots."""
    recv = gather_home(a2av, y, plan, a2av_index)
    n, C = recv.shape
    full = torch.empty((n, C * y.element_size()), dtype=torch.uint8, device=y.device)
    _gather(full, _bytes2d(recv, n), plan.slot_src)  # every slot: its row, or zeros (dropped)
    return full.view(y.dtype).view(plan.tokens, plan.k, C)


def scatter(a2av, z, values, plan: DevicePlan):
    """Per-token rows z (T, C) and per-slot values (T, k) -> (capacity, C) rows in z's dtype and
    (capacity,) float32 values, zeros past the rows in use."""
    C = z.shape[1]
    width = C * z.element_size()
    S = plan.send_tok.shape[0]
    dev = z.device
    vals = values.float().index_select(0, plan.send_tok).contiguous().view(torch.uint8)
    send = torch.empty((S, width + 4 * plan.k), dtype=torch.uint8, device=dev)
    _gather(
        send[:, :width], _bytes2d(z.contiguous(), z.shape[0]), plan.send_tok, plan.send_total, False
    )
    send[:, width:].copy_(vals.reshape(S, 4 * plan.k))
    recv = torch.empty((plan.recv_rows, send.shape[1]), dtype=torch.uint8, device=dev)
    a2av(recv, send, plan.recv_splits, plan.send_splits)
    out = torch.empty((plan.capacity, C), dtype=z.dtype, device=dev)
    _gather(_bytes2d(out, plan.capacity), recv[:, :width], plan.row_tok, plan.row_total)
    v = recv[:, width:].contiguous().view(torch.float32)
    row_v = torch.where(plan.row_keep, v[plan.row_tok, plan.row_slot], 0.0)
    return out, row_v


class DeviceTransport:
    """The transport seam's device class (NOTE [moe device transport]): ``a2av`` moves rows
    (default: the communicator's ``device_alltoallv_single``, synchronous on the caller's
    stream)."""

    name = "device"

    def __init__(self, group, rank, size, device, a2av=None):
        self.group, self.rank, self.size, self.device = group, rank, size, device
        self.a2av_index = None  # NOTE [indexed push]: only over the communicator's own exchange
        if a2av is None:
            from . import _device_a2av

            def a2av(out, inp, out_splits, in_splits):
                group.device_alltoallv_single(out, inp, out_splits, in_splits, False)

            def a2av_index(out, inp, index, out_splits, in_splits):
                _device_a2av.issue(group._c, out, inp, out_splits, in_splits, False, None, index)

            self.a2av_index = a2av_index
        self.a2av = a2av
        self.flags = torch.zeros(FLAGS, dtype=torch.int64, device=device)
        self.plan_kernels = None  # None: plan_kernels() decides (once); False: torch (benches)
        self.zero_tail = False  # True: NOTE [moe recv_x tail]'s baseline (benches)
        self.pack_rows = False  # True: the combine packs y's rows before the exchange (benches)
        self._auto_kernels = None

    def exchange_header(self, rows: torch.Tensor) -> torch.Tensor:
        """The construction's agreement check (eager, host read allowed)."""
        return exchange_counts(self.a2av, rows.to(self.device)).cpu()

    def _index(self):
        """The indexed exchange, unless a benchmark asked for the packed one (``pack_rows``)."""
        return None if self.pack_rows else self.a2av_index

    def _kernels(self, device, P, L) -> bool:
        if self.plan_kernels is not None:
            return self.plan_kernels
        if self._auto_kernels is None:  # a group's device and sizes do not change
            self._auto_kernels = plan_kernels(device, P, L)
        return self._auto_kernels

    def dispatch(self, x, idx, weights, wire, return_scales, **sizes):
        result = dispatch(
            self.a2av,
            x,
            idx,
            weights,
            wire,
            return_scales,
            flags=self.flags,
            kernels=self._kernels(x.device, sizes["P"], sizes["L"]),
            zero_tail=self.zero_tail,
            **sizes,
        )
        return _Pending([], lambda: result)

    def gather(self, y, plan, async_op):
        rows = gather(self.a2av, y, plan, self._index())
        return _Pending([], lambda: rows)

    def gather_home(self, y, plan, async_op):
        """(receive buffer (T * k, C), its row per slot): what the combine's weighted sum reads
        through the index, without the (T, k, C) copy ``gather`` makes."""
        rows = gather_home(self.a2av, y, plan, self._index())
        return _Pending([], lambda: (rows, plan.slot_src))

    def scatter(self, z, values, plan, async_op):
        result = scatter(self.a2av, z, values, plan)
        return _Pending([], lambda: result)
