# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The ring exchange of ring attention (API.md §2), and the zig-zag layout of a causal sequence.

``RingGroup(group).exchange(tensors)`` sends this rank's tensors to rank + 1 and receives rank
- 1's (``reverse=True``: to rank - 1, from rank + 1), asynchronously: the transfer of step k+1
runs while the caller computes on step k's blocks. Receive buffers are double-buffered: step k
writes buffer set k % 2, so the results of the last two steps stay intact and step k+2 reuses
step k's memory (NOTE [ring double buffer]).

Two transports, chosen once at construction:

- ``collective``: one batched send + receive per step on the group's own backend (a fastcomms
  ``TorchComm`` batch, or ``torch.distributed.batch_isend_irecv`` on a ProcessGroup): gloo on
  CPU, NCCL across hosts.
- ``window``: an "nvlink" communicator on CUDA: the tensors are ``put`` straight into the next
  rank's window (CUDA IPC over NVLink, copy engines) on a side stream, ordered by window
  signals; no NCCL call per step (NOTE [ring window protocol]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import TorchComm
from ._work import _Scoped

__all__ = [
    "RingGroup",
    "RingWork",
    "zigzag_indices",
    "zigzag_shard",
    "zigzag_unshard",
]

_ALIGN = 256  # bytes: every tensor of a window slot starts on this boundary (any dtype's view)


# -- zig-zag layout --------------------------------------------------------------------------------
# Causal attention over a sequence cut into `world` contiguous pieces leaves rank 0 almost idle
# (its queries see only its own keys) and the last rank with the most work. Cutting it into
# 2 * world chunks and giving rank r chunks r and 2 * world - 1 - r pairs an early chunk with a
# late one, so every rank's causal work is the same, and every ring step's block is either the
# diagonal (rank's own chunks, causal) or exactly half of a full block (see usp_attention.py).
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
    """The global positions of rank ``rank``'s tokens in the zig-zag layout (chunks ``rank`` and
    ``2 * world - 1 - rank`` of ``2 * world``), e.g. for rotary embeddings."""
    _zigzag_check(seq_len, world, rank, "zigzag_indices")
    c = seq_len // (2 * world)
    first = torch.arange(rank * c, (rank + 1) * c)
    return torch.cat([first, first + (2 * world - 1 - 2 * rank) * c])


def zigzag_shard(x: torch.Tensor, world: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s part of the whole sequence ``x`` (along ``dim``): chunks ``rank`` and
    ``2 * world - 1 - rank`` of ``2 * world``, concatenated (a new tensor; no communication)."""
    _zigzag_check(x.shape[dim], world, rank, "zigzag_shard")
    chunks = x.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def zigzag_unshard(parts: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's part (``parts[r]`` is rank r's ``zigzag_shard``), the
    inverse of ``zigzag_shard`` (no communication: gather the parts first)."""
    world = len(parts)
    if world == 0:
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
    order = [halves[r][0] for r in range(world)] + [halves[r][1] for r in reversed(range(world))]
    return torch.cat(order, dim=dim)


# -- the exchange ----------------------------------------------------------------------------------
# NOTE [ring double buffer]: a ring-attention step computes on the K/V block it received last
# while the next block is in flight, and sends the block it computes on: step k sends step k-1's
# result and receives into other memory. So a group keeps two sets of receive buffers (two slots
# of one window on the window transport) and step k receives into set k % 2: the results of the
# last two steps are intact, and step k+2 overwrites step k's. No allocation per step once the
# shapes repeat (a new shape or dtype in a slot gets new buffers; tensors handed out earlier keep
# theirs). A caller that must keep a result longer copies it. The backward of ring attention runs
# two rings at once (K/V and their gradients): each needs its own RingGroup, since one group's
# steps share one pair of buffer sets.
class RingWork:
    """The handle of one ``RingGroup.exchange``. ``wait()`` returns the received tensors (the
    structure that was sent: one tensor, a list or a tuple); on CUDA it orders the caller's
    current stream after the transfer without blocking the host, on CPU it blocks until the
    receive is done. The tensors are the group's buffers for this step: valid until the
    exchange two steps later reuses them. Waiting twice returns the same tensors."""

    def __init__(self, group, slot, out, pack, wait_fn, done_fn):
        self._group, self._slot, self._out, self._pack = group, slot, out, pack
        self._wait_fn, self._done_fn = wait_fn, done_fn
        self._waited = False

    def wait(self):
        if not self._waited:
            self._wait_fn()
            self._waited = True
            self._wait_fn = None
        return self._pack(self._out)

    def is_completed(self) -> bool:
        return self._waited or self._done_fn()


def _resolve_group(group):
    """A TorchComm, or a torch.distributed ProcessGroup (its communicator when it runs on one)."""
    if hasattr(group, "get_group") and hasattr(group, "mesh"):  # a DeviceMesh
        if group.ndim != 1:
            raise ValueError(
                f"RingGroup: a DeviceMesh must be 1-D (slice it, mesh['ring']), got {group.ndim} "
                "dimensions"
            )
        group = group.get_group()
    from .device_mesh import comm_of  # a process group over a communicator: use the comm

    return comm_of(group) or group


class RingGroup(_Scoped):
    """The ring exchange of ring attention over a group: a fastcomms ``TorchComm``, a
    ``torch.distributed`` ProcessGroup, a 1-D DeviceMesh, or None (torch.distributed's default
    group). ``exchange(tensors)`` sends to group rank + 1 and receives from group rank - 1
    (``reverse=True``: the other way). Every rank passes tensors of the same shapes and dtypes,
    in the same order, and calls ``exchange`` the same number of times with the same ``reverse``
    (a point-to-point exchange pairs calls by order).

    ``transport`` is "window" (an "nvlink" communicator on CUDA: puts into the next rank's window,
    no NCCL call per step) or "collective" (one batched send + receive per step on the group's
    backend); ``transport_reason`` says why. Construction is collective on the window transport.

    Buffers: NOTE [ring double buffer]. Calls from one thread; the group owns its receive buffers
    (and the window); ``destroy()`` (collective) releases them."""

    def __init__(self, group=None, device=None):
        group = _resolve_group(group)
        self.group = group
        self._step = 0
        self._slots = [None, None]  # per slot: the receive buffers (collective transport)
        self._inflight = [None, None]  # per slot: the RingWork not yet waited on
        self._win = None
        self._win_bytes = 0
        self._side = None
        # tests/python/test_ring_gpu.py's armed control: no waits for the peers' signals (the
        # result must then read the poison a late put has not yet overwritten)
        self._armed_unordered = False
        if isinstance(group, TorchComm):
            self.rank, self.size = group.get_rank(), group.get_size()
            self.device = torch.device(device) if device is not None else group.get_device()
            self._pg = None
            backend = group.get_backend()
            if backend == "nvlink" and self.device.type == "cuda" and self.size > 1:
                self.transport = "window"
                self.transport_reason = (
                    "an nvlink communicator on CUDA: puts into the next rank's window"
                )
                self._win = group.new_window()  # collective
            else:
                self.transport = "collective"
                self.transport_reason = (
                    f"a {backend} communicator on {self.device.type}: one batched send/recv a step"
                )
        else:
            import torch.distributed as dist

            pg = group or dist.group.WORLD
            if pg is None:
                raise ValueError(
                    "RingGroup: no group given and torch.distributed has no default group "
                    "(call init_process_group, or pass a fastcomms communicator)"
                )
            self._pg = pg
            self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)
            self._global = [dist.get_global_rank(pg, r) for r in range(self.size)]
            self.device = torch.device(device) if device is not None else None
            self.transport = "collective"
            self.transport_reason = (
                f"a torch.distributed {dist.get_backend(pg)} group: batch_isend_irecv a step"
            )

    # -- public API --------------------------------------------------------------------------------
    @property
    def next_rank(self) -> int:
        """The group rank a forward exchange sends to (rank + 1)."""
        return (self.rank + 1) % self.size

    @property
    def prev_rank(self) -> int:
        """The group rank a forward exchange receives from (rank - 1)."""
        return (self.rank - 1) % self.size

    def exchange(self, tensors, *, reverse: bool = False) -> RingWork:
        """Sends ``tensors`` (one tensor, or a list/tuple of them) to rank + 1 and receives as
        many of the same shapes and dtypes from rank - 1 (``reverse=True``: to rank - 1, from
        rank + 1). Returns at once; ``RingWork.wait()`` gives the received tensors. Do not
        write the sent tensors before that wait. At most two exchanges are in flight: the
        third raises unless the first was waited on (its buffers are the ones reused)."""
        if self.transport == "destroyed":
            raise ValueError(f"[rank {self.rank}/{self.size}] RingGroup: the group was destroyed")
        single = isinstance(tensors, torch.Tensor)
        seq = [tensors] if single else list(tensors)
        if not seq or not all(isinstance(t, torch.Tensor) for t in seq):
            raise TypeError(
                f"[rank {self.rank}/{self.size}] RingGroup.exchange: needs a tensor or a "
                "non-empty list/tuple of tensors"
            )
        seq = [t.contiguous() for t in seq]
        if single:
            pack = _first
        elif isinstance(tensors, tuple):
            pack = tuple
        else:
            pack = list
        slot = self._step % 2
        pending = self._inflight[slot]
        if pending is not None and not pending._waited:
            # Refused rather than silently wrong: the receive would land in buffers whose own
            # receive (two steps ago) has not been waited on, so that result would read this one.
            raise RuntimeError(
                f"[rank {self.rank}/{self.size}] RingGroup.exchange: step {self._step - 2}'s "
                "exchange was never waited on, and its buffers are this step's (double "
                "buffer); wait() on it first"
            )
        dst = self.prev_rank if reverse else self.next_rank
        src = self.next_rank if reverse else self.prev_rank
        if self.transport == "window":
            work = self._exchange_window(seq, slot, dst, src, pack)
        else:
            work = self._exchange_collective(seq, slot, dst, src, pack)
        self._inflight[slot] = work
        self._step += 1
        return work

    def destroy(self) -> None:
        """Releases the receive buffers and the window (collective on the window transport).
        Tensors returned earlier stay valid while referenced; later exchanges raise."""
        if self._win is not None:
            if self._win_bytes:
                torch.cuda.current_stream(self.device).wait_stream(self._side)
                self._win.tensor_deregister()  # collective: every rank's puts are done first
            self._win = None
        self._slots = [None, None]
        self._inflight = [None, None]
        self.transport = "destroyed"

    # -- collective transport ----------------------------------------------------------------------
    def _buffers(self, seq, slot):
        """This slot's receive buffers, reused while the tensors' shapes and dtypes repeat."""
        key = [(t.shape, t.dtype, t.device) for t in seq]
        held = self._slots[slot]
        if held is None or held[0] != key:
            held = (key, [torch.empty_like(t) for t in seq])
            self._slots[slot] = held
        return held[1]

    def _exchange_collective(self, seq, slot, dst, src, pack):
        out = self._buffers(seq, slot)
        if self.size == 1:  # sent to itself
            for o, t in zip(out, seq, strict=True):
                o.copy_(t)
            return RingWork(self, slot, out, pack, _nothing, _yes)
        if self._pg is None:
            batch = self.group.batch_op_create()
            for t in seq:
                batch.send(t, dst)
            for o in out:
                batch.recv(o, src)
            w = batch.issue(True)
            return RingWork(self, slot, out, pack, w.wait, w.is_completed)
        import torch.distributed as dist

        gdst, gsrc = self._global[dst], self._global[src]
        ops = [dist.P2POp(dist.isend, t, gdst, self._pg) for t in seq]
        ops += [dist.P2POp(dist.irecv, o, gsrc, self._pg) for o in out]
        works = dist.batch_isend_irecv(ops)
        keep = seq  # the sends read these until the works finish

        def wait():
            for w in works:
                w.wait()
            keep.clear()

        return RingWork(self, slot, out, pack, wait, lambda: all(w.is_completed() for w in works))

    # -- window transport --------------------------------------------------------------------------
    # NOTE [ring window protocol]: each rank registers one window buffer of two slots (the double
    # buffer); step k's tensors go into slot k % 2 of the destination's buffer. On the group's
    # side stream, after it waited for the caller's stream (the sent tensors are written, and
    # every read of this rank's slot k % 2 from step k-2 the caller enqueued is ordered before):
    #   1. signal(src): "my slot k % 2 is free" (a credit to the rank that writes into it);
    #   2. wait_signal(dst): dst's credit for its slot k % 2;
    #   3. put each tensor into dst's slot k % 2 (copy engines over NVLink);
    #   4. signal(dst): "your slot k % 2 holds step k" (stream order puts the signal after the
    #      copies; the window's signal is a release after a system fence);
    #   5. wait_signal(src): src's data for this rank's slot; then an event the caller waits on.
    # Signal counts are per (sender, receiver) pair and a wait takes the next count, so each
    # signal must meet its own wait: from a given peer this rank receives per step exactly one
    # credit or one data signal (world > 2), or with world 2 (the peer is both src and dst) a
    # credit then a data signal, awaited in that order; forward and reverse steps keep the pairing
    # because every rank runs the same sequence of steps. No cycle: every credit is sent before
    # any wait.
    def _exchange_window(self, seq, slot, dst, src, pack):
        for t in seq:
            if t.device != self.device:
                raise ValueError(
                    f"[rank {self.rank}/{self.size}] RingGroup.exchange: tensors must be on "
                    f"{self.device} (the communicator's device), got {t.device}"
                )
        offsets, slot_bytes = [], 0
        for t in seq:
            offsets.append(slot_bytes)
            slot_bytes += _round_up(t.numel() * t.element_size(), _ALIGN)
        slot_bytes = max(slot_bytes, _ALIGN)
        cur = torch.cuda.current_stream(self.device)
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        if 2 * slot_bytes > self._win_bytes:
            self._grow(2 * slot_bytes, cur)
        buf = self._win.get_tensor()
        base = slot * (self._win_bytes // 2)
        out = [
            buf[base + o : base + o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, o in zip(seq, offsets, strict=True)
        ]
        side, win = self._side, self._win
        side.wait_stream(cur)
        ordered = not self._armed_unordered
        with torch.cuda.stream(side):
            win.signal(src)
            if ordered:
                win.wait_signal(dst)
            for t, o in zip(seq, offsets, strict=True):
                if t.numel():
                    win.put(t.reshape(-1).view(torch.uint8), dst, base + o)
            win.signal(dst)
            if ordered:
                win.wait_signal(src)
            done = torch.cuda.Event()
            done.record(side)
        for t in seq:
            t.record_stream(side)  # the caller may drop them before the puts ran

        def wait():
            torch.cuda.current_stream(self.device).wait_event(done)
            win.check_errors()

        return RingWork(self, slot, out, pack, wait, done.query)

    def _grow(self, need, cur):
        """A larger window buffer, registered on every rank at the same step (grow-only; every
        rank sends the same shapes, so every rank grows here). Results that view the old buffer
        keep it alive; every peer's puts into it are done before it is let go."""
        size = _round_up(max(need, 2 * self._win_bytes), 2 * _ALIGN)
        if self._win_bytes:
            cur.wait_stream(self._side)
            self._win.tensor_deregister()  # collective: drains every rank first
        self._win.tensor_register(torch.empty(size, dtype=torch.uint8, device=self.device))
        self._win_bytes = size


def _round_up(n, k):
    return max(k, math.ceil(n / k) * k)


def _first(out):
    return out[0]


def _nothing():
    pass


def _yes():
    return True
