# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The ring exchange of ring attention (API.md §2) and the zig-zag layout of a causal sequence
(docs/sequence_parallel.md)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from operator import itemgetter

import torch

from ._comm import TorchComm
from ._work import RingWork, _Scoped

__all__ = ["RingGroup", "RingWork", "zigzag_indices", "zigzag_shard", "zigzag_unshard"]

_ALIGN = 256  # bytes: every tensor of a window slot starts on this boundary (any dtype's view)


# Zig-zag: with contiguous pieces, causal attention leaves rank 0 almost idle and the last rank
# the most work. Rank r holding chunks r and 2 * world - 1 - r of 2 * world evens the work, and
# every ring step's block is the diagonal or exactly half of a full block (usp_attention.py).
def _zigzag_check(length, world, rank, what):
    if not isinstance(world, int) or world < 1:
        raise ValueError(f"{what}: world must be an int >= 1, got {world!r}")
    if rank is not None and not 0 <= rank < world:
        raise ValueError(f"{what}: rank must be in [0, {world}), got {rank}")
    if length % (2 * world):
        raise ValueError(
            f"{what}: the sequence ({length}) must divide into 2 * world = {2 * world} equal "
            f"chunks (pad it to a multiple of {2 * world})"
        )


def zigzag_indices(seq_len: int, world: int, rank: int) -> torch.Tensor:
    """The global positions of rank ``rank``'s zig-zag tokens (e.g. for rotary embeddings)."""
    _zigzag_check(seq_len, world, rank, "zigzag_indices")
    c = seq_len // (2 * world)
    first = torch.arange(rank * c, (rank + 1) * c)
    return torch.cat([first, first + (2 * world - 1 - 2 * rank) * c])


def zigzag_shard(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s zig-zag part of the whole sequence ``x`` along ``dim`` (a new tensor)."""
    _zigzag_check(x.shape[dim], world, rank, "zigzag_shard")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's ``zigzag_shard`` (``parts[r]`` is rank r's)."""
    if len(parts) == 0:
        raise ValueError("zigzag_unshard: no parts")
    for r, p in enumerate(parts):
        if p.shape != parts[0].shape:
            raise ValueError(
                f"zigzag_unshard: part {r} is {tuple(p.shape)}, part 0 {tuple(parts[0].shape)}; "
                "every rank's part has the same shape"
            )
    if parts[0].shape[dim] % 2:
        raise ValueError(
            f"zigzag_unshard: a part holds two equal chunks; its length {parts[0].shape[dim]} "
            "is odd"
        )
    halves = [p.chunk(2, dim=dim) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=dim)


# NOTE [ring double buffer]: a ring-attention step sends the block it computes on (step k-1's
# result) while the next is in flight, so step k receives into buffer set k % 2 (a window slot on
# the window transport): the last two results stay intact, step k+2 overwrites step k's, and no
# allocation is made once shapes repeat (a new shape or dtype gets new buffers; tensors handed out
# keep theirs). Two rings at once (the backward's K/V and gradients) need two RingGroups.
class RingGroup(_Scoped):
    """The ring exchange over a ``TorchComm``, a ProcessGroup, a 1-D DeviceMesh or None (the
    default group); ``transport``: "window" (an "nvlink" communicator on CUDA) or "collective",
    ``transport_reason`` says why. Every rank exchanges the same shapes, dtypes and ``reverse`` in
    the same order (calls pair by order), from one thread. Construction and ``destroy()`` are
    collective on the window transport."""

    def __init__(self, group=None, device=None):
        from .device_mesh import resolve_group  # on first use: its import cost (NOTE in ulysses)

        self.group = group = resolve_group(group, "RingGroup", "ring")
        self._step = 0
        self._slots = [None, None]  # per slot: (key, receive buffers) (collective transport)
        self._inflight = [None, None]  # per slot: its last RingWork
        self._win, self._win_bytes, self._side = None, 0, None
        # tests/python/test_ring_gpu.py's armed control: no waits for the peers' signals (the
        # result must then read the poison a late put has not yet overwritten)
        self._armed_unordered = False
        self.device = torch.device(device) if device is not None else None
        self.transport = "collective"
        if isinstance(group, TorchComm):
            self.rank, self.size, self._pg = group.get_rank(), group.get_size(), None
            if device is None:
                self.device = group.get_device()
            backend = group.get_backend()
            self.transport_reason = (
                f"a {backend} communicator on {self.device.type}: one batched send/recv a step"
            )
            if backend == "nvlink" and self.device.type == "cuda" and self.size > 1:
                self.transport = "window"
                self.transport_reason = (
                    "an nvlink communicator on CUDA: puts into the next rank's window"
                )
                self._win = group.new_window()  # collective
                self._side = torch.cuda.Stream(device=self.device)
            return
        import torch.distributed as dist

        from .device_mesh import group_rank_size

        pg, self.rank, self.size = group_rank_size(group, "RingGroup")
        self._pg = pg
        self._global = [dist.get_global_rank(pg, r) for r in range(self.size)]
        self.transport_reason = (
            f"a torch.distributed {dist.get_backend(pg)} group: batch_isend_irecv a step"
        )

    @property
    def next_rank(self) -> int:
        """The group rank a forward exchange sends to (rank + 1)."""
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        """The group rank a forward exchange receives from (rank - 1)."""
        return (self.rank - 1) % self.size

    def exchange(self, tensors, *, reverse: bool = False) -> RingWork:
        """Sends ``tensors`` (a tensor, or a list/tuple of them) to rank + 1 and receives as many
        of the same shapes and dtypes from rank - 1 (``reverse=True``: the other way); returns at
        once. Do not write the sent tensors before ``wait()``. At most two exchanges are in
        flight: the third raises unless the first was waited on (its buffers are reused)."""
        where = f"[rank {self.rank}/{self.size}] RingGroup"
        if self.transport == "destroyed":
            raise ValueError(f"{where}: the group was destroyed")
        single = isinstance(tensors, torch.Tensor)
        seq = [tensors] if single else list(tensors)
        if not seq or not all(isinstance(t, torch.Tensor) for t in seq):
            raise TypeError(
                f"{where}.exchange: needs a tensor or a non-empty list/tuple of tensors"
            )
        seq = [t.contiguous() for t in seq]
        slot = self._step % 2
        pending = self._inflight[slot]
        if pending is not None and not pending._waited:
            # Refused rather than silently wrong: the receive would land in buffers whose own
            # receive (two steps ago) has not been waited on, so that result would read this one.
            raise RuntimeError(
                f"{where}.exchange: step {self._step - 2}'s exchange was never waited on, and its "
                "buffers are this step's (double buffer); wait() on it first"
            )
        dst, src = (self.prev_rank, self.next_rank) if reverse else (self.next_rank, self.prev_rank)
        run = self._exchange_window if self.transport == "window" else self._exchange_collective
        pack = itemgetter(0) if single else (tuple if isinstance(tensors, tuple) else list)
        work = self._inflight[slot] = RingWork(*run(seq, slot, dst, src), pack=pack)
        self._step += 1
        return work

    def destroy(self) -> None:
        """Releases the receive buffers and the window (collective on the window transport).
        Tensors returned earlier stay valid while referenced; later exchanges raise."""
        if self._win is not None:
            self._release_window()
        self._win, self._slots, self._inflight = None, [None, None], [None, None]
        self.transport = "destroyed"

    def _exchange_collective(self, seq, slot, dst, src):
        key = [(t.shape, t.dtype, t.device) for t in seq]
        if self._slots[slot] is None or self._slots[slot][0] != key:  # reused while shapes repeat
            self._slots[slot] = (key, [torch.empty_like(t) for t in seq])
        out = self._slots[slot][1]
        if self.size == 1:  # sent to itself
            for o, t in zip(out, seq, strict=True):
                o.copy_(t)
            works = []
        elif self._pg is None:
            batch = self.group.batch_op_create()
            for t in seq:
                batch.send(t, dst)
            for o in out:
                batch.recv(o, src)
            works = [batch.issue(True)]
        else:
            import torch.distributed as dist

            ops = [dist.P2POp(dist.isend, t, self._global[dst], self._pg) for t in seq]
            ops += [dist.P2POp(dist.irecv, o, self._global[src], self._pg) for o in out]
            works = dist.batch_isend_irecv(ops)

        def wait():
            for w in works:
                w.wait()
            seq.clear()  # the sends read these until the works finish

        return out, wait, lambda: all(w.is_completed() for w in works)

    # NOTE [ring window protocol]: one window buffer of two slots per rank (the double buffer);
    # step k puts into slot k % 2 of dst's. On the side stream, after the caller's stream (the sent
    # tensors are written; the caller's reads of this rank's slot from step k-2 come before):
    # 1. signal(src): a credit, "my slot is free"; 2. wait_signal(dst): dst's credit; 3. put each
    # tensor (copy engines over NVLink); 4. signal(dst): "your slot holds step k" (after the copies
    # in stream order; a release after a system fence); 5. wait_signal(src): src's data landed;
    # then an event the caller waits on. Signal counts are per (sender, receiver) pair and a wait
    # takes the next count, so each signal must meet its own wait: per step a peer sends this rank
    # one credit or one data signal (world > 2), or with world 2 a credit then a data signal,
    # awaited in that order; every rank runs the same steps (forward and reverse). No cycle: every
    # credit is sent before any wait.
    def _exchange_window(self, seq, slot, dst, src):
        for t in seq:
            if t.device != self.device:
                raise ValueError(
                    f"[rank {self.rank}/{self.size}] RingGroup.exchange: tensors must be on "
                    f"{self.device} (the communicator's device), got {t.device}"
                )
        *offsets, slot_bytes = accumulate((_round_up(t.nbytes, _ALIGN) for t in seq), initial=0)
        if 2 * slot_bytes > self._win_bytes:
            # Grow-only, on every rank at the same step (every rank sends the same shapes).
            # Results that view the old buffer keep it alive.
            size = _round_up(max(2 * slot_bytes, 2 * self._win_bytes), 2 * _ALIGN)
            self._release_window()
            self._win.tensor_register(torch.empty(size, dtype=torch.uint8, device=self.device))
            self._win_bytes = size
        buf, base = self._win.get_tensor(), slot * (self._win_bytes // 2)
        out = [
            buf[base + o : base + o + t.nbytes].view(t.dtype).view(t.shape)
            for t, o in zip(seq, offsets, strict=True)
        ]
        side, win, ordered = self._side, self._win, not self._armed_unordered
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            win.signal(src)
            if ordered:
                win.wait_signal(dst)
            for t, o in zip(seq, offsets, strict=True):
                t.record_stream(side)  # the caller may drop them before the puts ran
                if t.numel():
                    win.put(t.reshape(-1).view(torch.uint8), dst, base + o)
            win.signal(dst)
            if ordered:
                win.wait_signal(src)
        done = side.record_event()

        def wait():
            torch.cuda.current_stream(self.device).wait_event(done)
            win.check_errors()

        return out, wait, done.query

    def _release_window(self):
        """Deregisters the window's buffer (collective: every rank's puts into it finish first)."""
        if self._win_bytes:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
            self._win.tensor_deregister()


def _round_up(n, k):
    return max(k, -(-n // k) * k)
