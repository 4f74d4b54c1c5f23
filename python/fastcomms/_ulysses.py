# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Ulysses group and its functional form; ``fastcomms.ulysses`` is the public face (it
re-exports these with the ring exchange and the 2-D group). The exchange is one C++ op (NOTE
[ulysses op in c++] in python/src/ulysses_op.cpp); this module forwards to it and holds what stays
in Python: the choice of transport and the async form's streams and lend ring (its checks are
C++'s: NOTE [async ulysses checks])."""

from __future__ import annotations

import collections
import functools
import math
import os
import tempfile
import uuid

import torch
from torch._C._distributed_c10d import _register_work  # an AsyncCollectiveTensor's waited work
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _in_dispatch_mode

from . import _C, _comm, _torch_compat
from ._comm import TorchComm, _OpaqueBase
from ._options import _DEFAULT_TIMEOUT
from ._work import UlyssesWork, _RegisteredWork, _Scoped

# The op, looked up once: a compiled call then guards on this one name instead of on torch.ops'
# attribute chain.
_OP = torch.ops.fastcomms.ulysses_all_to_all_4d


# NOTE [eager-only members]: torch.compile reaches only the members registered with the opaque
# UlyssesGroup (an unregistered one stops Dynamo with an internal error, even without fullgraph),
# so the members that cannot be traced (these and out=) are registered and run eagerly with the
# real group: a graph break there. Outside a trace the check costs one call of is_compiling().
# torch._disable_dynamo is torch.compiler.disable with Dynamo imported at the first call instead
# of here: importing Dynamo costs about 2 s of CPU, which a process that never compiles (the first
# new_comm reaches this module) should not pay.


def _eager_only_member(fn, *args, **kwargs):
    """Runs an eager-only member of UlyssesGroup outside the compiled graph (under fullgraph=True,
    where no graph may break, Dynamo refuses the call naming this function)."""
    return fn(*args, **kwargs)


_run_eager = torch._disable_dynamo(_eager_only_member)
_EAGER_ONLY = []  # their names, for the registration


def _eager_only(fn):
    """NOTE [eager-only members]."""
    _EAGER_ONLY.append(fn.__name__)

    @functools.wraps(fn)
    def member(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _run_eager(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    return member


def _kv_replicas(kv_replicas, group):
    """kv_replicas as an int >= 1 (None: 1); the C++ op takes an int, so a float, a bool or a
    string is refused here (the message is formatted only for a bad value: NOTE [host cost per
    call])."""
    if kv_replicas is None:
        return 1
    if isinstance(kv_replicas, bool) or not isinstance(kv_replicas, int) or kv_replicas < 1:
        raise ValueError(
            f"[rank {group._rank}/{group._size}] all_to_all_4d: kv_replicas must be an int >= 1 "
            f"(virtual heads per K/V head), got {kv_replicas!r}"
        )
    return kv_replicas


def _splits(splits):
    return None if splits is None else [int(v) for v in splits]


def nvlink_decision(who, probe):
    """(usable, why) from every rank's "host|device" entry and a probe
    ``probe(devices) -> (matrix or None, why)``; the decision lives in the Ulysses layer (C++)."""
    return _C.nvlink_decision(list(who), probe)


class UlyssesGroup(_OpaqueBase, _Scoped):
    """Ulysses all-to-all over a group (a TorchComm, a ProcessGroup, a 1-D DeviceMesh, or None:
    the default group).

    The group holds one transport (API.md §2): NVLink peer-to-peer when every rank sits on one
    host with every pair of its GPUs NVLink-joined (NVML's answer; "unknown" is never taken for
    yes); "hierarchical" when the ranks span hosts and each host's GPUs are NVLink-joined (on CPU
    only when asked for, over a TorchComm); else the collective path of the group's backend.
    ``transport`` is "auto", "nvlink", "hierarchical" or "collective"; ``self.transport`` says
    what was chosen and ``self.transport_reason`` why. Constructing a group on CUDA is collective.
    Calls from one thread at a time, in the same order on every rank."""

    LEND_RING = 4
    __module__ = "fastcomms.ulysses"  # its public home, the name torch.compile records

    def __init__(
        self, group=None, device=None, *, require_nvlink=False, transport="auto", process_group=None
    ):
        if process_group is not None:
            if group is not None and group is not process_group:
                raise ValueError("UlyssesGroup: pass the group once (group= or process_group=)")
            group = process_group
        from .device_mesh import resolve_group  # on first use: its import cost (NOTE in ulysses)

        self.group = group = resolve_group(group, "UlyssesGroup", "sp")
        self._ring = {}  # dtype -> the lent windows (NOTE in _lent)
        self._astream = None
        self._lane = None  # the async calls' transport (own windows and barriers on NVLink)
        self._id = self._lane_id = None  # the transports' ids in the op's table
        if isinstance(group, TorchComm):
            self._rank, self._size = group.get_rank(), group.get_size()
            self.device = self._resolve_device(device, group.get_device())
            self._t, kind, self.transport_reason = group.ulysses_transport(
                transport, require_nvlink=require_nvlink
            )
        else:
            self._t, kind, self.transport_reason = self._over_process_group(
                group, device, transport, require_nvlink
            )
        self.transport = kind if kind in ("nvlink", "hierarchical") else "collective"
        self._id = _C._ulysses_register(self._t)  # NOTE [ulysses op in c++]

    @staticmethod
    def _resolve_device(device, default):
        device = torch.device(device) if device is not None else default
        if device is not None and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _over_process_group(self, group, device, transport, require_nvlink):
        import torch.distributed as dist

        pg = group or dist.group.WORLD
        self._rank, self._size = dist.get_rank(pg), dist.get_world_size(pg)
        cuda = "nccl" in str(dist.get_backend(pg)).lower() and torch.cuda.is_available()
        self.device = self._resolve_device(device, torch.device("cuda") if cuda else None)
        index = self.device.index if self.device is not None and self.device.type == "cuda" else -1
        who, store, gather, exchange = [], None, None, None
        if transport != "collective" and index >= 0:
            # Every rank's host and GPU (the decision's input), then a store shared by the ranks
            # of each host for the NVLink setup (NOTE [hierarchical choice]: several hosts also
            # need an all-gather of their verdicts and the group for the exchange between them).
            who = [None] * self._size
            dist.all_gather_object(who, f"{_C.host_name()}|{index}", group=pg)
            host = [w.rsplit("|", 1)[0] for w in who]
            hosts, mine = list(dict.fromkeys(host)), host[self._rank]
            # A fresh file name (one per host); FileStore deletes the file when the last rank lets
            # go of it (removing it earlier would leave a peer's FileStore retrying to open it).
            fresh = os.path.join(tempfile.gettempdir(), f"fastcomms_ulysses_{uuid.uuid4().hex}")
            path = [fresh if self._rank == 0 else None]
            dist.broadcast_object_list(path, src=dist.get_global_rank(pg, 0), group=pg)
            store = dist.FileStore(f"{path[0]}_{hosts.index(mine)}", host.count(mine))
            if len(hosts) > 1:

                def gather(value):
                    out = [None] * self._size
                    dist.all_gather_object(out, value, group=pg)
                    return out

                exchange = pg
        t, kind, why = _C.select_transport(
            self._rank,
            self._size,
            index,
            store,
            "ulysses",
            _DEFAULT_TIMEOUT,
            transport,
            bool(require_nvlink),
            who,
            gather,
            exchange,
        )
        if t is None:  # the collective path over the group itself (NOTE [ulysses op in c++])
            t = _C.process_group_transport(pg, self._rank, self._size, index)
        return t, kind, why

    # NOTE [host cost per call]: at small shapes a call is bound by its host time. A plain eager
    # call reaches the op through one typed dispatcher call of the extension (no torch.ops lookup,
    # no autograd.Function in Python), and the async CUDA call orders the side stream, records the
    # tensors' use, runs and registers its completion in one call of the extension.
    def _live(self):
        if self._t is None:
            raise ValueError(
                f"[rank {self._rank}/{self._size}] UlyssesGroup: the group was destroyed"
            )
        return self._t

    def _args(self, seq_splits, head_splits, kv_replicas):
        return _splits(seq_splits), _splits(head_splits), _kv_replicas(kv_replicas, self)

    def _shapes(self, gid, x, mode, seq, heads, kv=1):
        """(the exchange's shape, the result's shape) from the plan (C++): they differ for mode 1
        with kv replicas, whose result sums each head's replicas."""
        return _C.ulysses_shapes(gid, list(x.shape), x.element_size(), mode, seq, heads, kv)

    @staticmethod
    def _out_bytes(t, x, mode, seq, heads, kv):
        return max(16, t.max_out_bytes(list(x.shape), x.element_size(), mode, seq, heads, kv))

    # -- public API ------------------------------------------------------------------------------
    def all_to_all_4d(
        self,
        x,
        *,
        mode=0,
        out=None,
        seq_splits=None,
        head_splits=None,
        kv_replicas=None,
        wire_dtype=None,
        return_scales=False,
        grad_wire_dtype=None,
    ):
        """The exchange of API.md §2; differentiable unless ``out=`` is given.

        ``kv_replicas=R`` (grouped-query / multi-query attention; docs/design.md): x's h heads
        stand for ``h * R`` virtual heads laid out as ``x.repeat_interleave(R, dim=2)``, which
        ``head_splits`` and the result count; with h KV heads on P ranks pass ``P // h``. Mode 0
        is the exchange of the repeat without materialising it; mode 1 (its backward) returns
        ``(b, s_local, h, d)``, each head the sum of its R replicas. No rank may receive two
        copies of one head; uneven ``head_splits`` carry KV heads not divisible by the ranks.

        ``wire_dtype`` (``torch.float8_e4m3fn`` or ``float8_e5m2``, for float16/bfloat16/float32
        x): the rows travel as FP8 with one float32 scale per (token, head) row, dequantized into
        x's dtype on receipt (NOTE [fp8 wire exchange]); ``return_scales=True`` returns ``(fp8
        rows, scales)`` instead. The backward sends the gradient in its own dtype, or as
        ``grad_wire_dtype``."""
        return _call(
            self,
            x,
            mode,
            out,
            seq_splits,
            head_splits,
            kv_replicas,
            wire_dtype,
            return_scales,
            grad_wire_dtype,
        )

    @_eager_only
    def all_to_all_4d_async(
        self,
        x,
        *,
        mode=0,
        out=None,
        seq_splits=None,
        head_splits=None,
        lend=False,
        kv_replicas=None,
        wire_dtype=None,
    ):
        """Starts the exchange and returns its output as an ``AsyncCollectiveTensor``:
        ``.wait()`` (or the first use by any aten op) orders the caller's stream after the
        transfer without blocking the host (CPU: it blocks until the exchange is done). Wait on
        or use every result: torch's work registry keeps a dropped one. Where torch lacks the
        registry a ``UlyssesWork`` is returned instead. Not differentiable.

        ``lend=True`` (NVLink only): the output is a window of the group's ring of ``LEND_RING``
        per dtype, which peers write directly; a call whose next window still backs a live result
        raises instead of overwriting it, so every rank must release its results at the same
        point. ``kv_replicas`` (not with ``lend``) and ``wire_dtype``: as in ``all_to_all_4d``."""
        seq, heads, kv = self._args(seq_splits, head_splits, kv_replicas)
        summed = mode == 1 and kv > 1
        t = self._live()  # NOTE [async ulysses checks] (C++): grad, lend, vmap, shape, meta
        _C.ulysses_async_check(self._id, x, mode, kv, lend, out is not None, self.transport_reason)
        x = x.contiguous()
        if not x.is_cuda:  # CPU: the transport's own async path
            if _pending:
                _finish_done()
            if summed or wire_dtype is not None:  # run it, then hand back a done result
                res = _call(self, x, mode, out, seq, heads, kv, wire_dtype, False, None)
                return _async_result(res)
            if out is None:
                out = torch.empty(self._shapes(self._id, x, mode, seq, heads, kv)[1], dtype=x.dtype)
            return _async_result(out, t.all_to_all_4d(x, out, mode, seq, heads, True, kv))
        if self._lane is None:
            self._lane = t.async_lane()
            self._lane_id = _C._ulysses_register(self._lane)
        if self._astream is None:
            # high priority: the async call's small barrier kernels get the next free SM
            # ahead of a compute kernel's remaining blocks (the overlap it exists for)
            self._astream = torch.cuda.Stream(device=x.device, priority=-1)
        lane, s = self._lane, self._astream
        shape, result = self._shapes(self._lane_id, x, mode, seq, heads, kv)
        if lend:
            out = self._lent(lane, x, shape, mode, seq, heads, kv)
        elif out is None:
            out = x.new_empty(result)
        if not summed and wire_dtype is None and hasattr(lane, "all_to_all_4d_on"):
            # NOTE [host cost per call]: ordering, record_stream, the call on the side stream and
            # the completion work (NOTE [async result waits]) in one call of the extension
            lane.all_to_all_4d_on(x, out, s, mode, seq, heads, kv)
            return AsyncCollectiveTensor(out)
        s.wait_stream(torch.cuda.current_stream(x.device))
        x.record_stream(s)
        out.record_stream(s)
        with torch.cuda.stream(s):  # the op's own call on the side stream (the replicas' sum too)
            if wire_dtype is not None:  # NOTE [fp8 wire exchange]
                _C.ulysses_all_to_all_4d_fp8_out(
                    x, out, self._lane_id, mode, seq, heads, kv, wire_dtype
                )
            else:
                _C.ulysses_all_to_all_4d_out(x, out, self._lane_id, mode, seq, heads, kv)
        if hasattr(_C, "_register_stream_completion"):  # (a build with CUDA)
            # NOTE [async result waits]: a C++ work, so torch's wait on any path orders the
            # caller's stream after the call
            _C._register_stream_completion(out, s)
            return AsyncCollectiveTensor(out)
        done = torch.cuda.Event()
        done.record(s)
        return UlyssesWork(out, event=done)

    @staticmethod
    def _storage_uses(t):
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata)

    def _lent(self, lane, x, shape, mode, seq, heads, kv=1):
        # One ring per dtype: [buffers, the storage use count of each with no result alive, next]
        ring = self._ring.setdefault(x.dtype, [[None] * self.LEND_RING, [0] * self.LEND_RING, 0])
        bufs, idle, k = ring
        need = self._out_bytes(lane, x, mode, seq, heads, kv)
        buf = bufs[k]
        if buf is not None and self._storage_uses(buf) > idle[k]:
            raise RuntimeError(
                f"[rank {self._rank}/{self._size}] all_to_all_4d_async(lend=True): the ring's "
                f"{self.LEND_RING} {x.dtype} windows all back live results (the next one, "
                f"window {k}, is still referenced or was never waited on); release a lent result "
                "(drop it after using it) before lending another, or pass out="
            )
        ring[2] = (k + 1) % self.LEND_RING
        if buf is None or buf.numel() < need:  # grow-only; every rank grows at the same call
            bufs[k] = None
            buf = bufs[k] = lane.empty_output([need], need, torch.empty(0, dtype=torch.uint8))
            idle[k] = self._storage_uses(buf)
        return buf.view(x.dtype)[: math.prod(shape)].view(shape)

    @_eager_only
    def empty_output(self, x, *, mode=0, seq_splits=None, head_splits=None, kv_replicas=None):
        """A buffer of the output's shape. On the NVLink transport peers write it directly when it
        is passed as ``out=`` (zero copy); collective there (every rank calls it, in the same
        order). Elsewhere (and for mode 1 with kv_replicas, whose result is a sum) an ordinary
        tensor."""
        seq, heads, kv = self._args(seq_splits, head_splits, kv_replicas)
        t = self._live()
        shape = self._shapes(self._id, x, mode, seq, heads, kv)[1]
        if not x.is_meta and not (mode == 1 and kv > 1):
            need = self._out_bytes(t, x, mode, seq, heads, kv)
            buf = t.empty_output(list(shape), need, x)
            if buf is not None:
                return buf
        return x.new_empty(shape)

    @_eager_only
    def memory_stats(self):
        """What the group holds: device bytes of the transport's windows, signal pads and
        buffers (sync and async lanes), the lent ring's bytes, and the calls issued."""
        sync = self._t.memory_stats() if self._t is not None else (0, 0)
        lane = self._lane
        asyn = lane.memory_stats() if lane is not None and lane is not self._t else (0, 0)
        return {
            "transport": self.transport,
            "device_bytes": sync[0] + asyn[0],
            "sync_bytes": sync[0],
            "async_bytes": asyn[0],
            "lend_ring_bytes": sum(
                b.numel() for ring in self._ring.values() for b in ring[0] if b is not None
            ),
            "calls": sync[1] + asyn[1],
        }

    def _tune(self, knob, value):
        """Developer benchmarks: sets a transport knob for later calls (NVLink: "engine" = auto,
        ce, sm or hybrid; FASTCOMMS_ENGINE sets it for the whole process at start)."""
        for t in (self._live(), self._lane):
            if t is not None:
                t.tune(knob, value)

    @_eager_only
    def check_errors(self):
        """Raises if a device-side barrier of an earlier call failed (a peer disagreed on the
        call, or a barrier timed out). Calls check on their own; this is for the last one."""
        self._live().check_errors()

    @_eager_only
    def destroy(self) -> None:
        """Releases the group's windows (collective on the NVLink transport: call it on every
        rank). Buffers from empty_output() stay valid while referenced; later calls raise."""
        for gid in (self._id, self._lane_id):
            if gid is not None:
                _C._ulysses_unregister(gid)
        if self._lane is not None and self._lane is not self._t:
            self._lane.destroy()
        if self._t is not None:
            self._t.destroy()
        self._t = self._lane = self._id = self._lane_id = None
        self._ring = {}
        self.transport = "destroyed"


# NOTE [dropped async results]: torch's work registry keeps the work of an AsyncCollectiveTensor
# until a wait on it, forever for a result dropped unwaited, and a CPU call's work holds its
# buffers (NOTE [work keeps its buffers]; the unpack into the output runs in wait()). So every CPU
# async call's work is queued here, and each later CPU call finishes those whose exchange is over
# (in call order: the unpack, then the release), leaving a small registry entry as torch's own
# functional collectives do (docs/reliability.md). A kept result reads the same; its wait raises
# the call's error. CUDA calls register a work holding an event alone.
_pending = collections.deque()


def _async_result(out, work=None):
    """CPU results: a Python work whose wait() waits for the exchange."""
    rw = _RegisteredWork(out, None, work)
    _register_work(out, rw)
    if work is not None:
        _pending.append(rw)  # NOTE [dropped async results]
    return AsyncCollectiveTensor(out)


def _finish_done():
    while _pending and (_pending[0]._work is None or _pending[0]._work._tensors_released()):
        _pending.popleft()._finish()


# -- the functional form ----------------------------------------------------------------------
# NOTE [ulysses custom op]: the op is C++'s (NOTE [ulysses op in c++]) and takes the group's id in
# the op's table, an int Dynamo carries as a constant and guards on. torch.compile passes the
# UlyssesGroup through as an opaque reference type and reads `_id` on the real object; a TorchComm
# (or a process group over one) reaches its group through its `_ulysses_group` member, evaluated
# on the real object too. So compiling needs no eager call first; the fake kernel is the op's Meta
# kernel (the plan's shapes).
_comm.ATTACHMENTS["ulysses"] = UlyssesGroup  # a TorchComm's (NOTE [communicator attachments])
# A torch.distributed group's (a ProcessGroup, a DeviceMesh, None: the default group), keyed by
# that object, which holds no attributes of ours.
_by_group: dict[object, UlyssesGroup] = {}


def _ulysses_group_of(group) -> UlyssesGroup:
    g = _by_group.get(group)
    if g is None:
        g = _by_group[group] = UlyssesGroup(group)
    return g


MemberType = _torch_compat.member_type()
_torch_compat.register_symbolic_class(
    UlyssesGroup,
    {
        # read as constants where a compiled function asks (`transport` is "destroyed" after
        # destroy(), which a compiled function only sees if it is compiled again); `_rank` and
        # `_size` for error messages
        **dict.fromkeys(
            ("_id", "_rank", "_size", "transport", "transport_reason", "device", "LEND_RING"),
            MemberType.USE_REAL,
        ),
        **dict.fromkeys(["all_to_all_4d", *_EAGER_ONLY], MemberType.INLINED),
    },
)


def _resolve(group) -> UlyssesGroup:
    if isinstance(group, UlyssesGroup):
        return group
    if isinstance(group, TorchComm):
        return group._ulysses_group
    from .device_mesh import comm_of  # on first use: its import cost (NOTE in ulysses)

    comm = comm_of(group)
    return comm._ulysses_group if comm is not None else _ulysses_group_of(group)


def all_to_all_4d(
    x,
    group=None,
    *,
    mode=0,
    seq_splits=None,
    head_splits=None,
    kv_replicas=None,
    wire_dtype=None,
    return_scales=False,
    grad_wire_dtype=None,
):
    """The functional form (API.md §2): the op `torch.ops.fastcomms.ulysses_all_to_all_4d`, which
    torch.compile(fullgraph=True) traces without a graph break and without an eager call first.
    ``group`` is a UlyssesGroup, a TorchComm, a process group (a ProcessGroup from
    fastcomms.device_mesh compiles; torch's own process groups run eagerly), or None (torch's
    default group, eager)."""
    return _call(
        _resolve(group),
        x,
        mode,
        None,
        seq_splits,
        head_splits,
        kv_replicas,
        wire_dtype,
        return_scales,
        grad_wire_dtype,
    )


def _call(g, x, mode, out, seq, heads, kv, wire, return_scales, grad_wire):
    """UlyssesGroup.all_to_all_4d and the functional form: the mode, the splits' sums and the
    shapes are the op's to check (C++)."""
    compiling = torch.compiler.is_compiling()
    if out is not None and compiling:  # NOTE [eager-only members]
        return _run_eager(_call, g, x, mode, out, seq, heads, kv, wire, return_scales, grad_wire)
    seq, heads, kv = _splits(seq), _splits(heads), _kv_replicas(kv, g)
    gid = g._id
    if gid is None:
        g._live()
    if wire is not None or return_scales or grad_wire is not None:
        # NOTE [fp8 wire exchange] (C++): the op's .fp8 / .fp8_out overloads
        fp8 = (x, gid, mode, seq, heads, kv, wire, return_scales, grad_wire)
        if compiling:
            got = _OP.fp8(*fp8)
        else:
            if _pending:
                _finish_done()
            if out is not None:
                return _C.ulysses_all_to_all_4d_fp8_out(x, out, *fp8[1:])
            plain = _plain_eager(x)
            got = _C.ulysses_all_to_all_4d_fp8(*fp8) if plain else _OP.fp8(*fp8)
        return tuple(got) if return_scales else got[0]
    if compiling:  # NOTE [ulysses custom op]
        return _OP(x, gid, mode, seq, heads, kv)
    if _pending:
        _finish_done()
    if out is not None:  # the op's .out overload, through the dispatcher
        return _C.ulysses_all_to_all_4d_out(x, out, gid, mode, seq, heads, kv)
    if _plain_eager(x):  # NOTE [host cost per call]
        return _C.ulysses_all_to_all_4d(x, gid, mode, seq, heads, kv)
    return _OP(x, gid, mode, seq, heads, kv)


def _plain_eager(x) -> bool:
    """A plain tensor in plain eager mode (the caller has ruled out compiling): nothing traces,
    transforms or intercepts the call (no dispatch or function mode, no functorch transform), so
    the extension's typed dispatcher call runs the op, with the same result and autograd as
    torch.ops and less host time."""
    return (
        type(x) is torch.Tensor
        and not _in_dispatch_mode()
        and not torch._C._is_torch_function_mode_enabled()
        and torch._C._functorch.peek_interpreter_stack() is None
    )
