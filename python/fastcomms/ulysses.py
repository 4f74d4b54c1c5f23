# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Ulysses all-to-all (API.md §2).

mode 0 (scatter heads, gather sequence): (b, s_local, n_global, d) -> (b, s_global, n_local, d);
mode 1 is the inverse. Differentiable: the backward of one mode is the other mode with the same
splits. On a TorchComm the C++ collective path runs (one pack, one all_to_all_v_single, one
unpack, mismatched calls detected on every rank); on a torch.distributed ProcessGroup the same
layout is computed with torch ops around ``all_to_all_single``.
"""

from __future__ import annotations

import datetime
import itertools
import math
import os
import socket

import torch

from . import _C, TorchComm, UnsupportedError

__all__ = ["UlyssesGroup", "UlyssesWork", "all_to_all_4d"]

_DEFAULT_TIMEOUT = datetime.timedelta(seconds=600)


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


class PrefixedStore:
    """A key space inside any store with torch.distributed.Store's methods."""

    def __init__(self, prefix, store):
        self._p, self._s = prefix + "/", store

    def set(self, key, value):
        return self._s.set(self._p + key, value)

    def get(self, key):
        return self._s.get(self._p + key)

    def add(self, key, delta):
        return self._s.add(self._p + key, delta)

    def check(self, keys):
        return self._s.check([self._p + k for k in keys])

    def wait(self, keys, *args):
        return self._s.wait([self._p + k for k in keys], *args)

    def delete_key(self, key):
        return self._s.delete_key(self._p + key)


def nvlink_decision(who, nvlink_matrix):
    """(usable, why) from every rank's "host|device" entry and an NVML query
    ``nvlink_matrix(devices) -> (matrix or None, why)``: usable when there is one host and every
    pair of distinct GPUs is NVLink-joined (ranks sharing a GPU count as joined); NVML's
    "unknown" is never taken for yes. Every rank computes it from the same entries."""
    pairs = [w.rsplit("|", 1) for w in who]
    hosts = {h for h, _ in pairs}
    if len(hosts) != 1:
        return False, f"the ranks span {len(hosts)} hosts"
    devices = sorted({int(d) for _, d in pairs})
    if len(devices) == 1:
        return True, f"all {len(who)} ranks share GPU {devices[0]} of one host"
    matrix, why = nvlink_matrix(devices)
    if matrix is None:
        return False, f"NVML cannot say whether GPUs {devices} are NVLink-joined ({why})"
    missing = [(a, b) for a in devices for b in devices if a < b and not matrix.get((a, b), False)]
    if missing:
        return False, f"GPU pairs {missing} are not NVLink-joined"
    return True, f"GPUs {devices} of one host, every pair NVLink-joined (NVML)"


class UlyssesGroup:
    """Ulysses all-to-all over a group (a TorchComm, a ProcessGroup, or None: the default).

    CUDA tensors take the NVLink peer-to-peer transport when ``transport`` allows it and every
    rank of the group sits on one host with every pair of its GPUs NVLink-joined (NVML's answer;
    "unknown" is never taken for yes); otherwise the collective path of the group's backend.
    Constructing a group on CUDA is collective (the ranks exchange host and device through the
    store, so all of them take the same decision). ``self.transport`` says what was chosen and
    ``self.transport_reason`` why.
    """

    _count = itertools.count()  # per-process group names: ranks create groups in the same order

    def __init__(self, group=None, device=None, *, require_nvlink=False, transport="auto"):
        if transport not in ("auto", "nvlink", "collective"):
            raise ValueError(
                f"UlyssesGroup: transport must be auto, nvlink or collective, got {transport!r}"
            )
        if require_nvlink and transport == "collective":
            raise ValueError("UlyssesGroup: require_nvlink=True contradicts transport='collective'")
        self.group = group
        self._comm = group if isinstance(group, TorchComm) else None
        self._pg = None
        if self._comm is None:
            import torch.distributed as dist

            self._pg = group or dist.group.WORLD
            self._rank = dist.get_rank(self._pg)
            self._size = dist.get_world_size(self._pg)
        else:
            self._rank, self._size = self._comm.get_rank(), self._comm.get_size()
        self.device = self._resolve_device(device)
        self._nvl = None  # the NVLink group of sync calls
        self._nvl_async = None  # a second one for async calls: its own windows and barriers
        self._ring = []  # lent async outputs: [tensor or None] * _RING
        self._ring_next = 0
        self._astream = None
        self._name = f"fastcomms_ulysses/{next(UlyssesGroup._count)}"
        self.transport, self.transport_reason = "collective", "transport='collective' was asked"
        if transport != "collective":
            ok, why = self._nvlink_usable()
            if ok:
                self._nvl = self._new_nvlink("sync")
                self.transport, self.transport_reason = "nvlink", why
            elif transport == "nvlink" or require_nvlink:
                raise RuntimeError(
                    f"[rank {self._rank}/{self._size}] UlyssesGroup: the NVLink transport is not "
                    f"available: {why}"
                )
            else:
                self.transport_reason = why

    # -- transport selection -----------------------------------------------------------------------
    def _resolve_device(self, device):
        if device is not None:
            device = torch.device(device)
        elif self._comm is not None:
            device = self._comm.get_device()
        else:
            import torch.distributed as dist

            backend = str(dist.get_backend(self._pg)).lower()
            cuda = "nccl" in backend and torch.cuda.is_available()
            device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _store(self):
        import torch.distributed as dist

        if self._comm is not None:
            base = getattr(self._comm, "_store", None)
        else:
            base = dist.distributed_c10d._get_default_store()
            if self._pg is not dist.group.WORLD:  # a subgroup: its ranks' own key space
                ranks = dist.get_process_group_ranks(self._pg)
                base = PrefixedStore("g" + "_".join(map(str, ranks)), base)
        return None if base is None else PrefixedStore(self._name, base)

    def _nvlink_usable(self):
        """(usable, why), the same on every rank: decided from what every rank published."""
        if self.device is None or self.device.type != "cuda":
            return False, f"the group's device is {self.device or 'cpu'}, not a CUDA device"
        if not hasattr(_C, "NvlinkGroup"):
            return False, "this build of fastcomms has no CUDA layer"
        store = self._store()
        if store is None:
            return False, "the communicator has no store to exchange IPC handles through"
        self._store_obj = store
        store.set(f"who/{self._rank}", f"{socket.gethostname()}|{self.device.index}")
        keys = [f"who/{r}" for r in range(self._size)]
        store.wait(keys)
        who = [store.get(k).decode() for k in keys]
        return nvlink_decision(who, _C.nvlink_matrix)

    def _new_nvlink(self, role):
        timeout = self._comm._c.timeout() if self._comm is not None else _DEFAULT_TIMEOUT
        return _C.NvlinkGroup(
            self._rank,
            self._size,
            self.device.index,
            self._store_obj,
            role,
            timeout,
        )

    # -- the raw exchange (no autograd) ---------------------------------------------------------
    def _check_x(self, x):
        if x.dim() != 4:
            raise ValueError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d: x must be 4-D (b, s, h, d), got "
                f"{tuple(x.shape)}"
            )
        if self._nvl is not None and x.device != self.device:
            raise ValueError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d: x is on {x.device}, the group "
                f"on {self.device}"
            )
        return x.contiguous()

    def _nvlink_call(self, nvl, x, mode, seq_splits, head_splits, out):
        if out is None:  # a given out is validated by the call itself
            shape = nvl.output_shape(x, mode, seq_splits, head_splits)
            out = torch.empty(shape, dtype=x.dtype, device=x.device)
        nvl.all_to_all_4d(x, out, mode, seq_splits, head_splits, _ENGINES[_engine()])
        return out

    def _exchange(self, x, mode, seq_splits, head_splits, out):
        x = self._check_x(x)
        if self._nvl is not None:
            return self._nvlink_call(self._nvl, x, mode, seq_splits, head_splits, out)
        if self._comm is not None:
            c = self._comm._c
            shape = c.ulysses_output_shape(x, mode, seq_splits, head_splits)
            if out is None:
                out = torch.empty(shape, dtype=x.dtype, device=x.device)
            if x.is_cuda:
                if not c.ulysses_cuda_all_to_all_4d(x, out, mode, seq_splits, head_splits):
                    raise UnsupportedError(
                        f"[rank {self._rank}/{self._size}] all_to_all_4d: this build has no CUDA "
                        "collective path (built without NCCL)"
                    )
                return out
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
        seq, heads = self._args(mode, seq_splits, head_splits)
        if out is not None:
            if torch.is_grad_enabled() and x.requires_grad:
                raise RuntimeError(
                    f"[rank {self._rank}/{self._size}] all_to_all_4d: out= is not differentiable; "
                    "x requires grad under grad mode"
                )
            return self._exchange(x, mode, seq, heads, out)
        return _AllToAll4d.apply(x, self, mode, seq, heads)

    def all_to_all_4d_async(
        self, x, *, mode=0, out=None, seq_splits=None, head_splits=None, lend=False
    ):
        """Starts the exchange and returns a UlyssesWork; its ``wait()`` returns the output and
        orders the caller's current stream after the transfer without blocking the host (CPU
        tensors: it blocks until the exchange is done). Not differentiable.

        ``lend=True`` (NVLink transport only): the output is a buffer of the group's own ring of
        ``LEND_RING`` windows that peers write directly (no copy-out). It stays valid until the
        ``LEND_RING``-th next lent call is issued; work the caller enqueued on its current stream
        before that call is ordered before the buffer is written again."""
        seq, heads = self._args(mode, seq_splits, head_splits)
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d_async: the async form is not "
                "differentiable; x requires grad under grad mode"
            )
        if lend and out is not None:
            raise ValueError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d_async: lend=True returns a buffer "
                "of the group's ring; out= cannot be given with it"
            )
        if lend and self._nvl is None:
            raise ValueError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d_async: lend=True needs the NVLink "
                f"transport; this group uses {self.transport} ({self.transport_reason})"
            )
        x = self._check_x(x)
        if self._nvl is not None or (x.is_cuda and self._comm is not None):
            if self._astream is None:
                # high priority: the async call's small barrier kernels get the next free SM
                # ahead of a compute kernel's remaining blocks (the overlap it exists for)
                self._astream = torch.cuda.Stream(device=x.device, priority=-1)
            if self._nvl is not None and self._nvl_async is None:
                self._nvl_async = self._new_nvlink("async")
            caller = torch.cuda.current_stream(x.device)
            if self._nvl is not None:
                shape = self._nvl_async.output_shape(x, mode, seq, heads)
                if lend:
                    out = self._lent(x, shape, mode, seq, heads)
            else:
                shape = self._comm._c.ulysses_output_shape(x, mode, seq, heads)
            if out is None:
                out = torch.empty(shape, dtype=x.dtype, device=x.device)
            s = self._astream
            s.wait_stream(caller)
            x.record_stream(s)
            out.record_stream(s)
            with torch.cuda.stream(s):
                if self._nvl is not None:
                    self._nvlink_call(self._nvl_async, x, mode, seq, heads, out)
                else:
                    self._exchange(x, mode, seq, heads, out)
                done = torch.cuda.Event()
                done.record(s)
            return UlyssesWork(out, event=done)
        if self._comm is not None:  # CPU: the core's async collective path
            c = self._comm._c
            if out is None:
                shape = c.ulysses_output_shape(x, mode, seq, heads)
                out = torch.empty(shape, dtype=x.dtype, device=x.device)
            return UlyssesWork(out, work=c.ulysses_all_to_all_4d(x, out, mode, seq, heads, True))
        return UlyssesWork(self._exchange_torch(x, mode, seq, heads, out))

    LEND_RING = 2

    def _lent(self, x, shape, mode, seq, heads):
        if not self._ring:
            self._ring = [None] * self.LEND_RING
        need = self._max_out_bytes(x, mode, seq, heads)
        k = self._ring_next
        self._ring_next = (k + 1) % self.LEND_RING
        buf = self._ring[k]
        if buf is None or buf.numel() < need:  # grow-only; every rank grows at the same call
            buf = self._nvl_async.empty_output([need], need, torch.empty(0, dtype=torch.uint8))
            self._ring[k] = buf
        return buf.view(x.dtype)[: math.prod(shape)].view(shape)

    def _max_out_bytes(self, x, mode, seq, heads):
        seq, heads = _splits(self._size, self._rank, x, mode, seq, heads)
        b, _, _, d = x.shape
        per = [sum(seq) * h for h in heads] if mode == 0 else [s * sum(heads) for s in seq]
        return max(16, max(per) * b * d * x.element_size())

    def _args(self, mode, seq_splits, head_splits):
        if mode not in (0, 1):
            raise ValueError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d: mode must be 0 or 1, got {mode}"
            )
        seq = None if seq_splits is None else [int(v) for v in seq_splits]
        heads = None if head_splits is None else [int(v) for v in head_splits]
        return seq, heads

    def empty_output(self, x, *, mode=0, seq_splits=None, head_splits=None):
        """A buffer of the output's shape. On the NVLink transport peers write it directly when it
        is passed as ``out=`` (zero copy); collective there (every rank calls it, in the same
        order). Elsewhere an ordinary tensor."""
        seq, heads = self._args(mode, seq_splits, head_splits)
        if self._nvl is not None:
            shape = self._nvl.output_shape(x, mode, seq, heads)
            need = self._max_out_bytes(x, mode, seq, heads)
            return self._nvl.empty_output(list(shape), need, x)
        if self._comm is not None:
            shape = self._comm._c.ulysses_output_shape(x, mode, seq, heads)
        else:
            seq, heads = _splits(self._size, self._rank, x, mode, seq, heads)
            b, _, _, d = x.shape
            shape = (
                (b, sum(seq), heads[self._rank], d)
                if mode == 0
                else (b, seq[self._rank], sum(heads), d)
            )
        return torch.empty(shape, dtype=x.dtype, device=x.device)

    def memory_stats(self):
        """What the group holds: device bytes of the NVLink windows, signal pads and buffers
        (sync and async groups), the lent ring's bytes, and the calls issued."""
        nvl = self._nvl.memory_bytes() if self._nvl is not None else 0
        nva = self._nvl_async.memory_bytes() if self._nvl_async is not None else 0
        return {
            "transport": self.transport,
            "device_bytes": nvl + nva,
            "sync_bytes": nvl,
            "async_bytes": nva,
            "lend_ring_bytes": sum(b.numel() for b in self._ring if b is not None),
            "calls": (self._nvl.epoch() if self._nvl is not None else 0)
            + (self._nvl_async.epoch() if self._nvl_async is not None else 0),
        }

    def check_errors(self):
        """Raises if a device-side barrier of an earlier call failed (a peer disagreed on the
        call, or a barrier timed out). Calls check on their own; this is for the last one."""
        for g in (self._nvl, self._nvl_async):
            if g is not None:
                g.check_errors()

    def destroy(self) -> None:
        """Releases the group's windows (collective on the NVLink transport: call it on every
        rank). Buffers from empty_output() stay valid while referenced."""
        for g in (self._nvl, self._nvl_async):
            if g is not None:
                g.destroy()
        self._nvl = self._nvl_async = None
        self._ring = []
        self.transport = "destroyed"


_ENGINES = {"auto": 0, "ce": 1, "sm": 2, "hybrid": 3}


def _engine() -> str:
    e = os.environ.get("FASTCOMMS_ENGINE", "auto")
    if e not in _ENGINES:
        raise ValueError(f"FASTCOMMS_ENGINE must be one of {sorted(_ENGINES)}, got {e!r}")
    return e


class UlyssesWork:
    """The handle of all_to_all_4d_async: ``wait()`` returns the output."""

    def __init__(self, out, *, event=None, work=None):
        self._out, self._event, self._work = out, event, work

    def wait(self):
        if self._event is not None:
            torch.cuda.current_stream(self._out.device).wait_event(self._event)
        if self._work is not None:
            self._work.wait()
        return self._out

    def is_completed(self) -> bool:
        if self._event is not None:
            return self._event.query()
        return self._work.is_completed() if self._work is not None else True


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
