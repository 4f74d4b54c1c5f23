# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Ulysses all-to-all (API.md §2).

mode 0 (scatter heads, gather sequence): (b, s_local, n_global, d) -> (b, s_global, n_local, d);
mode 1 is the inverse. Differentiable: the backward of one mode is the other mode with the same
splits. On a TorchComm the C++ collective path runs (one pack, one all_to_all_v_single, one
unpack, mismatched calls detected on every rank); on a torch.distributed ProcessGroup the same
layout is computed with torch ops around ``all_to_all_single``.
"""

from __future__ import annotations

import torch

from . import TorchComm

__all__ = ["UlyssesGroup", "all_to_all_4d"]


def _splits(group_size, rank, x, mode, seq_splits, head_splits):
    if (seq_splits is None) != (head_splits is None):
        raise ValueError(
            f"[rank {rank}/{group_size}] all_to_all_4d: seq_splits and head_splits must be given "
            f"together, got {'seq_splits' if seq_splits is not None else 'head_splits'} only"
        )
    if seq_splits is not None:
        return list(seq_splits), list(head_splits)
    b, s, n, d = x.shape
    if mode == 0:
        if n % group_size:
            raise ValueError(
                f"[rank {rank}/{group_size}] all_to_all_4d: mode 0 scatters heads: x.size(2)={n} "
                f"is not divisible by world_size={group_size}; pass seq_splits and head_splits "
                "for uneven shards"
            )
        return [s] * group_size, [n // group_size] * group_size
    if s % group_size:
        raise ValueError(
            f"[rank {rank}/{group_size}] all_to_all_4d: mode 1 scatters the sequence: "
            f"x.size(1)={s} is not divisible by world_size={group_size}; pass seq_splits and "
            "head_splits for uneven shards"
        )
    return [s // group_size] * group_size, [n] * group_size


class _AllToAll4d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, mode, seq_splits, head_splits):
        ctx.group, ctx.mode, ctx.splits = group, mode, (seq_splits, head_splits)
        return group._exchange(x, mode, seq_splits, head_splits, None)

    @staticmethod
    def backward(ctx, grad):
        seq, heads = ctx.splits
        g = _AllToAll4d.apply(grad.contiguous(), ctx.group, 1 - ctx.mode, seq, heads)
        return g, None, None, None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        seq, heads = ctx.splits
        return ctx.group._exchange(x_t.contiguous(), ctx.mode, seq, heads, None)


class UlyssesGroup:
    """Ulysses all-to-all over a group (a TorchComm, a ProcessGroup, or None: the default)."""

    def __init__(self, group=None, device=None, *, require_nvlink=False, transport="auto"):
        if transport not in ("auto", "nvlink", "collective"):
            raise ValueError(
                f"UlyssesGroup: transport must be auto, nvlink or collective, got {transport!r}"
            )
        if transport == "nvlink" or require_nvlink:
            raise RuntimeError(
                "UlyssesGroup: the NVLink transport is not available from Python yet (it exists "
                "in C++, backends/nvlink); use transport='collective'"
            )
        self.group = group
        self.device = device
        self._comm = group if isinstance(group, TorchComm) else None
        if self._comm is None:
            import torch.distributed as dist

            self._pg = group or dist.group.WORLD
            self._rank = dist.get_rank(self._pg)
            self._size = dist.get_world_size(self._pg)
        else:
            self._rank, self._size = self._comm.get_rank(), self._comm.get_size()

    # -- the raw exchange (no autograd) ---------------------------------------------------------
    def _exchange(self, x, mode, seq_splits, head_splits, out):
        if x.dim() != 4:
            raise ValueError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d: x must be 4-D (b, s, h, d), got "
                f"{tuple(x.shape)}"
            )
        x = x.contiguous()
        if self._comm is not None:
            c = self._comm._c
            shape = c.ulysses_output_shape(x, mode, seq_splits, head_splits)
            if out is None:
                out = torch.empty(shape, dtype=x.dtype, device=x.device)
            c.ulysses_all_to_all_4d(x, out, mode, seq_splits, head_splits, False).wait()
            return out
        return self._exchange_torch(x, mode, seq_splits, head_splits, out)

    def _exchange_torch(self, x, mode, seq_splits, head_splits, out):
        import torch.distributed as dist

        seq, heads = _splits(self._size, self._rank, x, mode, seq_splits, head_splits)
        b, _, _, d = x.shape
        r = self._rank
        if mode == 0:  # (b, s_r, N, d) -> chunks (h_q, s_r, b, d)
            send = x.permute(2, 1, 0, 3).contiguous()
            in_sizes = [h * seq[r] * b * d for h in heads]
            out_sizes = [heads[r] * s * b * d for s in seq]
        else:  # (b, S, h_r, d) -> chunks (s_q, h_r, b, d)
            send = x.permute(1, 2, 0, 3).contiguous()
            in_sizes = [s * heads[r] * b * d for s in seq]
            out_sizes = [seq[r] * h * b * d for h in heads]
        recv = torch.empty(sum(out_sizes), dtype=x.dtype, device=x.device)
        dist.all_to_all_single(recv, send.reshape(-1), out_sizes, in_sizes, group=self._pg)
        parts = recv.split(out_sizes)
        if mode == 0:
            res = torch.cat(
                [
                    p.view(heads[r], s, b, d).permute(2, 1, 0, 3)
                    for p, s in zip(parts, seq, strict=False)
                ],
                dim=1,
            )
        else:
            res = torch.cat(
                [
                    p.view(seq[r], h, b, d).permute(2, 0, 1, 3)
                    for p, h in zip(parts, heads, strict=False)
                ],
                dim=2,
            )
        if out is None:
            return res.contiguous()
        out.copy_(res)
        return out

    # -- public API ------------------------------------------------------------------------------
    def all_to_all_4d(self, x, *, mode=0, out=None, seq_splits=None, head_splits=None):
        """The exchange of API.md §2; differentiable unless ``out=`` is given."""
        if mode not in (0, 1):
            raise ValueError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d: mode must be 0 or 1, got {mode}"
            )
        seq = None if seq_splits is None else [int(v) for v in seq_splits]
        heads = None if head_splits is None else [int(v) for v in head_splits]
        if out is not None:
            if torch.is_grad_enabled() and x.requires_grad:
                raise RuntimeError(
                    f"[rank {self._rank}/{self._size}] all_to_all_4d: out= is not differentiable; "
                    "x requires grad under grad mode"
                )
            return self._exchange(x, mode, seq, heads, out)
        return _AllToAll4d.apply(x, self, mode, seq, heads)

    def empty_output(self, x, *, mode=0, seq_splits=None, head_splits=None):
        """A buffer of the output's shape (on the collective path an ordinary tensor)."""
        if self._comm is not None:
            shape = self._comm._c.ulysses_output_shape(x, mode, seq_splits, head_splits)
        else:
            seq, heads = _splits(self._size, self._rank, x, mode, seq_splits, head_splits)
            b, _, _, d = x.shape
            shape = (
                (b, sum(seq), heads[self._rank], d)
                if mode == 0
                else (b, seq[self._rank], sum(heads), d)
            )
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    def destroy(self) -> None:
        """Releases the group's resources (nothing is held on the collective path)."""


# -- the functional form: a torch.library custom op -------------------------------------------
# NOTE [ulysses custom op]: torch.compile cannot trace a Python group object, so the op takes an
# integer handle into this registry (filled by the functional all_to_all_4d below). The fake
# kernel derives the output shape from the group's rank and size; the backward is the same op in
# the other mode with the same splits.
_groups: dict[int, UlyssesGroup] = {}
_group_ids: dict[int, int] = {}


def _group_handle(group) -> int:
    key = id(group) if group is not None else 0
    if key not in _group_ids:
        handle = len(_groups) + 1
        _groups[handle] = group if isinstance(group, UlyssesGroup) else UlyssesGroup(group)
        _group_ids[key] = handle
    return _group_ids[key]


def _out_shape(g: UlyssesGroup, shape, mode, seq_splits, head_splits):
    if (seq_splits is None) != (head_splits is None):
        raise ValueError(
            f"[rank {g._rank}/{g._size}] all_to_all_4d: seq_splits and head_splits must be given "
            "together"
        )
    b, s, n, d = shape
    if seq_splits is None:
        seq = [s] * g._size if mode == 0 else [s // g._size] * g._size
        heads = [n // g._size] * g._size if mode == 0 else [n] * g._size
    else:
        seq, heads = list(seq_splits), list(head_splits)
    if mode == 0:
        return (b, sum(seq), heads[g._rank], d)
    return (b, seq[g._rank], sum(heads), d)


@torch.library.custom_op("fastcomms::ulysses_all_to_all_4d", mutates_args=())
def _ulysses_op(
    x: torch.Tensor,
    handle: int,
    mode: int,
    seq_splits: list[int] | None,
    head_splits: list[int] | None,
) -> torch.Tensor:
    return _groups[handle]._exchange(x, mode, seq_splits, head_splits, None)


@_ulysses_op.register_fake
def _(x, handle, mode, seq_splits, head_splits):
    g = _groups[handle]
    return x.new_empty(_out_shape(g, x.shape, mode, seq_splits, head_splits))


def _setup_context(ctx, inputs, output):
    _, handle, mode, seq_splits, head_splits = inputs
    ctx.args = (handle, mode, seq_splits, head_splits)


def _backward(ctx, grad):
    handle, mode, seq_splits, head_splits = ctx.args
    return (
        _ulysses_op(grad.contiguous(), handle, 1 - mode, seq_splits, head_splits),
        None,
        None,
        None,
        None,
    )


_ulysses_op.register_autograd(_backward, setup_context=_setup_context)


def all_to_all_4d(x, group=None, *, mode=0, seq_splits=None, head_splits=None):
    """The functional form (API.md §2): a torch.library custom op that torch.compile(fullgraph=True)
    traces without a graph break. `group` is a TorchComm, a ProcessGroup, a UlyssesGroup, or None.
    """
    if mode not in (0, 1):
        raise ValueError(f"all_to_all_4d: mode must be 0 or 1, got {mode}")
    seq = None if seq_splits is None else [int(v) for v in seq_splits]
    heads = None if head_splits is None else [int(v) for v in head_splits]
    return _ulysses_op(x, _group_handle(group), mode, seq, heads)
