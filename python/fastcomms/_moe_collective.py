# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The collective transport of ``fastcomms.moe`` (docs/moe.md): MoE dispatch and combine as
all-to-alls on the group's backend (gloo on CPU, NCCL on CUDA and across hosts), the routing
planned with torch ops. Pure Python over a ``TorchComm`` or a ``torch.distributed`` ProcessGroup.

NOTE [moe transport seam]: ``ExpertParallelGroup`` (moe.py) checks the arguments, does the
arithmetic of the combine (NOTE [moe combine order]) and carries autograd; a transport moves rows.
It provides ``dispatch`` (the routed tokens into this rank's expert-grouped rows, a token crossing
once per rank), ``gather`` (expert rows back to their tokens' home, one row per (token, slot)) and
``scatter`` (per-token rows out to the expert ranks again, expanded like a dispatch: the backward
of ``gather``), each returning a ``_Pending`` whose ``wait()`` finishes the move. The device
transport (_moe_device.py: counts exchanged on the GPU through device_alltoallv_single, no host
sync) is a second class with these three methods and the same results, chosen in
ExpertParallelGroup's constructor (``_choose_transport``); its dispatch takes the routing whole
(no host header). This one stays for gloo, torch.distributed groups and multi-host groups.

NOTE [moe collective host sync]: this transport reads the routing on the host: one small
all-to-all of a fixed-size header per peer (token counts, k, the wire format and any rank's
refusal) followed by ``.tolist()`` of it, then one all_to_all_v of the packed rows. On CUDA that
is a device-to-host sync per dispatch (not per combine: the combine reuses the dispatch's plan),
so this path does not capture in a CUDA graph. The header carries each rank's verdict on its own
arguments, so a refusal (overflow, an expert id out of range) raises on every rank at the same
call instead of leaving the others waiting in the data exchange.
"""

from __future__ import annotations

import dataclasses

import torch

from . import TorchComm

# header fields, one int64 each, per (sender, receiver) pair
_H_STATUS, _H_TOKENS, _H_K, _H_WIRE, _H_BAD, _H_WHERE, _H_SEND = range(7)
_HEADER = 7
# status bits
OVERFLOW, BAD_EXPERT, DUPLICATE = 1, 2, 4
WIRE_CODES = {None: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def _pick(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """t[i] along dim 0 for a 0-dim index tensor, without indexing by a tensor scalar (which
    may be read on the host)."""
    return t.index_select(0, i.reshape(1)).squeeze(0)


def verdict(idx, num_experts, max_tokens):
    """(status, bad, where) as 0-dim int64 tensors on idx's device, read by neither transport on
    the host here (the collective reads them with its header; the device transport sends them in
    its counts): OVERFLOW for more than max_tokens tokens; BAD_EXPERT for an id out of range
    (bad: the first in flat order, where: its token); else DUPLICATE for a token naming an expert
    twice (where: the first such token, bad: its smallest such expert; two drops are none)."""
    T, k = idx.shape
    dev = idx.device
    zero = torch.zeros((), dtype=torch.int64, device=dev)
    status = zero + (OVERFLOW if T > max_tokens else 0)  # a shape: no sync
    if T == 0:
        return status, zero, zero - 1
    out = ((idx < -1) | (idx >= num_experts)).flatten()
    any_bad = out.any()
    first = out.to(torch.int32).argmax().long()  # the first True (argmax: first maximum)
    bad = torch.where(any_bad, _pick(idx.flatten(), first), zero)
    where = torch.where(any_bad, first // k, zero - 1)
    status = status | torch.where(any_bad, BAD_EXPERT, 0)
    if k > 1:
        s = idx.sort(dim=1).values
        eq = (s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0)  # two drops (-1) are no duplicate
        dup = eq.any(1)
        any_dup = dup.any() & ~any_bad
        t = dup.to(torch.int32).argmax().long()
        i = _pick(eq, t).to(torch.int32).argmax().long()
        status = status | torch.where(any_dup, DUPLICATE, 0)
        bad = torch.where(any_dup, _pick(_pick(s, t)[1:], i), bad)
        where = torch.where(any_dup, t, where)
    return status, bad, where


@dataclasses.dataclass
class Plan:
    """Where every row goes, both ways (the dispatch handle's contents on this transport).
    Home side: the tokens this rank sent; expert side: the rows it received."""

    tokens: int  # T: this rank's tokens
    k: int
    capacity: int  # rows of recv_x
    # home side
    send_tok: torch.Tensor  # (n_send,) int64: this rank's token of each sent row, by peer
    send_dest: torch.Tensor  # (n_send,) int64: the peer of each sent row
    send_splits: list[int]  # tokens sent to each peer
    slot_order: torch.Tensor  # flat slots t * k + j in the order gather's rows come back
    back_splits: list[int]  # rows gather receives from each peer
    owner: torch.Tensor  # (T, k) int64: the rank of each slot's expert, -1 dropped
    # expert side
    recv_splits: list[int]  # tokens received from each peer
    row_tok: torch.Tensor  # (rows,) int64: the received token of each expert-grouped row
    row_slot: torch.Tensor  # (rows,) int64: its slot at home
    flat_rows: torch.Tensor  # grouped rows in (source rank, source token, slot) order
    rows_from: list[int]  # grouped rows per source rank (gather's send splits)
    total: int  # rows in use (sum of the counts)


class _Pending:
    """An issued move: ``wait()`` finishes it and returns its result (once; later calls return
    the same result)."""

    def __init__(self, works, finish):
        self._works, self._finish, self._result, self._done = works, finish, None, False
        self._keep = None

    def wait(self):
        if not self._done:
            for w in self._works:
                w.wait()
            self._result, self._done = self._finish(), True
            self._works = self._finish = self._keep = None
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(w.is_completed() for w in self._works)


def row_meta(send_tok, dest, owner, local, scales, weights, k):
    """The metadata travelling with each sent row (both transports: their bytes must agree),
    (rows, 2 + 2k) int32: source position, scale bits, k local expert ids (-1: not the
    destination's), k weight bits. ``dest`` is each sent row's peer."""
    loc = torch.where(owner[send_tok] == dest.unsqueeze(1), local[send_tok], -1)
    if weights is None:
        weights = torch.ones((owner.shape[0], k), device=owner.device)
    return torch.cat(
        [
            send_tok.to(torch.int32).unsqueeze(1),
            scales[send_tok].view(torch.int32).unsqueeze(1),
            loc.to(torch.int32),
            weights.float()[send_tok].contiguous().view(torch.int32),
        ],
        dim=1,
    )


class CollectiveTransport:
    """Dispatch and combine moves as all-to-alls (NOTE [moe transport seam])."""

    name = "collective"

    def __init__(self, group, rank: int, size: int, device: torch.device):
        self.group, self.rank, self.size, self.device = group, rank, size, device
        if not isinstance(group, TorchComm):
            import torch.distributed as dist

            self._pg = group or dist.group.WORLD

    # -- the two exchanges ------------------------------------------------------------------------
    def _a2a_v(self, out, inp, out_splits, in_splits, async_op):
        if isinstance(self.group, TorchComm):
            return self.group.all_to_all_v_single(out, inp, out_splits, in_splits, async_op)
        import torch.distributed as dist

        return dist.all_to_all_single(
            out, inp, out_splits, in_splits, group=self._pg, async_op=async_op
        )

    def exchange_header(self, rows: torch.Tensor) -> torch.Tensor:
        """(size, n) int64 per peer -> (size, n) from each peer, on the host (a sync on CUDA)."""
        rows = rows.to(self.device).contiguous()
        out = torch.empty_like(rows)
        splits = [1] * self.size
        self._a2a_v(out.view(self.size, -1), rows, splits, splits, False)
        return out.cpu()

    def _move(self, send: torch.Tensor, send_splits, recv_splits, async_op, finish):
        """One all_to_all_v of (rows, width) uint8; finish(received) runs at wait()."""
        recv = send.new_empty((sum(recv_splits), send.shape[1]))
        work = self._a2a_v(recv, send, recv_splits, send_splits, async_op)
        works = [work] if async_op and work is not None else []
        pending = _Pending(works, lambda: finish(recv))
        pending._keep = send  # read by the transfer until it completes
        return pending

    # -- dispatch ---------------------------------------------------------------------------------
    def header(self, idx, num_experts, max_tokens, wire, k):
        """This rank's header rows and its routing: (header (size, 7), owner (T, k), local (T, k),
        send mask (size, T)). The verdict on idx travels in the header (NOTE above)."""
        P, L = self.size, num_experts // self.size
        T = idx.shape[0]
        status, bad, where = torch.stack(verdict(idx, num_experts, max_tokens)).tolist()
        valid = idx >= 0
        owner = torch.where(valid, idx.div(L, rounding_mode="floor"), -1)
        local = torch.where(valid, idx.remainder(L), -1)
        if status:  # nothing is sent; every rank raises after the header exchange
            mask = torch.zeros((P, T), dtype=torch.bool, device=idx.device)
        else:
            mask = (owner.unsqueeze(0) == torch.arange(P, device=idx.device).view(P, 1, 1)).any(2)
        head = torch.zeros((P, _HEADER), dtype=torch.int64)
        head[:, _H_STATUS], head[:, _H_TOKENS], head[:, _H_K] = status, T, k
        head[:, _H_WIRE], head[:, _H_BAD], head[:, _H_WHERE] = WIRE_CODES[wire], bad, where
        head[:, _H_SEND] = mask.sum(1).cpu()
        return head, owner, local, mask

    def dispatch(
        self,
        x,
        idx,
        weights,
        wire,
        return_scales,
        owner,
        local,
        mask,
        got,
        capacity,
        num_local,
        async_op,
    ):
        """The routed rows (``got``: the header rows received, already checked by the caller).
        The result at ``wait()``: (recv_x, counts, row weights, src, row scales or None, plan)."""
        T, k = idx.shape
        P, H, value_dtype = self.size, x.shape[1], x.dtype
        send_splits = [int(v) for v in mask.sum(1).tolist()]
        recv_splits = [int(v) for v in got[:, _H_SEND].tolist()]
        dest, send_tok = mask.nonzero(as_tuple=True)  # by peer, then token: row-major
        n = len(send_tok)
        scales = torch.zeros(T, dtype=torch.float32, device=x.device)
        if wire is not None:
            from . import _C

            q = torch.empty(x.shape, dtype=wire, device=x.device)
            _C._fp8_quantize(x, q, scales)  # NOTE [fp8 wire]: the Ulysses wire's rows and scales
            x = q
        row_bytes = H * x.element_size()
        data = x.index_select(0, send_tok).view(torch.uint8).reshape(n, row_bytes)
        meta = row_meta(send_tok, dest, owner, local, scales, weights, k)
        send = torch.cat([data, meta.view(torch.uint8)], dim=1)
        # gather's rows come back by owner rank, then by flat slot t * k + j
        back = torch.where(owner >= 0, owner, P).flatten()
        slot_order = back.argsort(stable=True)[: int((owner >= 0).sum())]
        back_splits = [int(v) for v in torch.bincount(back, minlength=P + 1)[:P].tolist()]

        def finish(recv):
            dev = recv.device
            m = recv[:, row_bytes:].contiguous().view(torch.int32)
            pos, sc, rloc = m[:, 0].long(), m[:, 1].view(torch.float32), m[:, 2 : 2 + k]
            rw = m[:, 2 + k :].view(torch.float32)
            # NOTE [moe row order]: rows grouped by local expert; within an expert by source
            # rank, then source position, then slot (a stable sort of the (token, slot) pairs,
            # which arrive in that order, by expert)
            flat = (rloc >= 0).flatten().nonzero().squeeze(1)
            experts = rloc.flatten()[flat].long()
            perm = experts.argsort(stable=True)
            grouped = flat[perm]
            total = len(grouped)
            row_tok, row_slot = grouped // k, grouped % k
            flat_rows = torch.empty_like(perm)
            flat_rows[perm] = torch.arange(total, device=dev)
            src_rank = torch.repeat_interleave(
                torch.arange(P, device=dev), torch.tensor(recv_splits, device=dev)
            )
            rows_from = torch.zeros(P, dtype=torch.int64, device=dev)
            rows_from.index_add_(0, src_rank, (rloc >= 0).sum(1))
            counts = torch.bincount(experts, minlength=num_local).to(torch.int32)
            plan = Plan(
                tokens=T,
                k=k,
                capacity=capacity,
                send_tok=send_tok,
                send_dest=dest,
                send_splits=send_splits,
                slot_order=slot_order,
                back_splits=back_splits,
                owner=owner,
                recv_splits=recv_splits,
                row_tok=row_tok,
                row_slot=row_slot,
                flat_rows=flat_rows,
                rows_from=[int(v) for v in rows_from.tolist()],
                total=total,
            )
            tok = recv[:, :row_bytes].contiguous().view(x.dtype)  # (N, H) as sent
            if wire is not None and not return_scales:
                from . import _C

                deq = torch.empty(tok.shape, dtype=value_dtype, device=dev)
                _C._fp8_dequantize(tok, sc.contiguous(), deq)
                tok = deq
            recv_x = torch.empty((capacity, H), dtype=tok.dtype, device=dev)
            recv_x[:total] = tok[row_tok]
            recv_x[total:].view(torch.uint8).zero_()
            row_w = torch.zeros(capacity, dtype=torch.float32, device=dev)
            row_w[:total] = rw[row_tok, row_slot]
            src = torch.full((capacity, 2), -1, dtype=torch.int64, device=dev)
            src[:total, 0] = src_rank[row_tok]
            src[:total, 1] = pos[row_tok]
            row_scales = None
            if wire is not None and return_scales:
                row_scales = torch.zeros(capacity, dtype=torch.float32, device=dev)
                row_scales[:total] = sc[row_tok]
            return recv_x, counts, row_w, src, row_scales, plan

        return self._move(send, send_splits, recv_splits, async_op, finish)

    # -- combine moves ----------------------------------------------------------------------------
    def gather(self, y, plan: Plan, async_op):
        """Expert rows y (capacity, C) -> (T, k, C) at their tokens' home, in y's dtype, zeros in
        dropped slots."""
        C = y.shape[1]
        width = C * y.element_size()
        send = y[: plan.total].index_select(0, plan.flat_rows).contiguous()
        send = send.view(torch.uint8).reshape(plan.total, width)

        def finish(recv):
            full = y.new_zeros((plan.tokens * plan.k, C))
            full[plan.slot_order] = recv.view(y.dtype)
            return full.view(plan.tokens, plan.k, C)

        return self._move(send, plan.rows_from, plan.back_splits, async_op, finish)

    def scatter(self, z, values, plan: Plan, async_op):
        """Per-token rows z (T, C) and per-slot values (T, k) -> this rank's expanded rows
        (capacity, C) in z's dtype and values (capacity,) float32, zeros past the rows in use."""
        C, n = z.shape[1], len(plan.send_tok)
        width = C * z.element_size()
        rows = z.index_select(0, plan.send_tok).contiguous().view(torch.uint8).reshape(n, width)
        vals = values.float().index_select(0, plan.send_tok).contiguous().view(torch.uint8)
        send = torch.cat([rows, vals.reshape(n, 4 * plan.k)], dim=1)

        def finish(recv):
            out = z.new_zeros((plan.capacity, C))
            out[: plan.total] = recv[:, :width].contiguous().view(z.dtype)[plan.row_tok]
            v = recv[:, width:].contiguous().view(torch.float32)
            row_v = torch.zeros(plan.capacity, dtype=torch.float32, device=z.device)
            row_v[: plan.total] = v[plan.row_tok, plan.row_slot]
            return out, row_v

        return self._move(send, plan.send_splits, plan.recv_splits, async_op, finish)
