# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Ulysses group and its functional form; ``fastcomms.ulysses`` is the public face (it
re-exports these with the ring exchange and the 2-D group). The exchange is one C++ op (NOTE
[ulysses op in c++] in python/src/ulysses_op.cpp); this module forwards to it and holds what stays
in Python: the choice of transport (the async form, its side stream and lend ring are C++'s: NOTE
[async ulysses in c++])."""

from __future__ import annotations

import functools
import os
import tempfile
import uuid

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _in_dispatch_mode

from . import _C, _comm, _torch_compat
from ._comm import TorchComm, _OpaqueBase
from ._options import _DEFAULT_TIMEOUT
from ._work import _Scoped

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

    LEND_RING = _C.UlyssesAsync.LEND_RING
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
        self._id = self._async = None  # the transport's id in the op's table; the async form
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
        self._async = _C.UlyssesAsync(self._t, self._id, self.transport_reason)

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
    # no autograd.Function in Python), and the async call is one call of the extension too (NOTE
    # [async ulysses in c++]).
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
        or use every result: torch's work registry keeps a dropped one. Not differentiable.

        ``lend=True`` (NVLink only): the output is a window of the group's ring of ``LEND_RING``
        per dtype, which peers write directly; a call whose next window still backs a live result
        raises instead of overwriting it, so every rank must release its results at the same
        point. ``kv_replicas`` (not with ``lend``) and ``wire_dtype``: as in ``all_to_all_4d``."""
        seq, heads, kv = self._args(seq_splits, head_splits, kv_replicas)
        self._live()  # checks, streams, ring and work: one call (NOTE [async ulysses in c++])
        return AsyncCollectiveTensor(
            self._async.call(x, mode, out, seq, heads, kv, lend, wire_dtype)
        )

    @property
    def _astream(self):
        """The async calls' side stream (None before the first CUDA call)."""
        s = self._async.side_stream() if self._async is not None else None
        if s is None:
            return None
        return torch.cuda.Stream(stream_id=s[0], device_index=s[1], device_type=s[2])

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
        asyn = self._async.stats() if self._async is not None else (0, 0, 0)
        return {
            "transport": self.transport,
            "device_bytes": sync[0] + asyn[0],
            "sync_bytes": sync[0],
            "async_bytes": asyn[0],
            "lend_ring_bytes": asyn[2],
            "calls": sync[1] + asyn[1],
        }

    def _tune(self, knob, value):
        """Developer benchmarks: sets a transport knob for later calls (NVLink: "engine" = auto,
        ce, sm or hybrid; FASTCOMMS_ENGINE sets it for the whole process at start)."""
        self._live().tune(knob, value)
        self._async.tune(knob, value)

    @_eager_only
    def check_errors(self):
        """Raises if a device-side barrier of an earlier call failed (a peer disagreed on the
        call, or a barrier timed out). Calls check on their own; this is for the last one."""
        self._live().check_errors()

    @_eager_only
    def destroy(self) -> None:
        """Releases the group's windows (collective on the NVLink transport: call it on every
        rank). Buffers from empty_output() stay valid while referenced; later calls raise."""
        self._release(collective=True)

    def _release(self, collective=False):
        """destroy(); not ``collective`` (its communicator is reconfigured or aborted, and a peer
        may be gone: NOTE [communicator attachments]), this process alone lets go of the
        transports, the lend ring and the side stream."""
        if self._async is not None:  # the async lane, its ring and stream
            self._async.destroy(collective)
        if self._id is not None:
            _C._ulysses_unregister(self._id)
        if self._t is not None and collective:
            self._t.destroy()
        self._t = self._id = self._async = None
        self.transport = "destroyed"


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
            if out is not None:
                return _C.ulysses_all_to_all_4d_fp8_out(x, out, *fp8[1:])
            plain = _plain_eager(x)
            got = _C.ulysses_all_to_all_4d_fp8(*fp8) if plain else _OP.fp8(*fp8)
        return tuple(got) if return_scales else got[0]
    if compiling:  # NOTE [ulysses custom op]
        return _OP(x, gid, mode, seq, heads, kv)
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
