# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms communicators as torch.distributed process groups, and DeviceMesh over them.

``_create_torchcomm_process_group(comm, group_name)`` wraps any ``TorchComm`` in a real
``torch.distributed.ProcessGroup`` registered with torch, so every ``torch.distributed`` function,
the functional collectives, DeviceMesh, DTensor, FSDP2 and DDP run on the communicator;
``init_device_mesh(comms, names)`` builds a ``DeviceMesh`` of such groups, as torchcomms' does.
How: NOTE [process group over a communicator] in docs/design.md; torch's c10d backend calls the
methods of ``_CommOps`` by torch's names.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from . import _C, _torch_compat
from ._bootstrap import rank_size_override as _rank_size_override
from ._comm import TorchComm, new_comm
from ._options import ReduceOp
from ._work import _CommWork

__all__ = ["init_device_mesh", "comm_of"]  # and torchcomms' private _flatten_with_comm

_REDUCE_OPS = tuple(n for n in _C.RedOpType.__members__ if n != "PREMUL_SUM")  # (the C++ enum's)
# torch's reduce-op kinds to ours, looked up once per call (NOTE [host cost per call])
_REDUCE_BY_KIND = {getattr(dist.ReduceOp, n): getattr(ReduceOp, n) for n in _REDUCE_OPS}


def _reduce_op(c10d_op, where):
    """Our op for torch's (a ReduceOp or its RedOpType); ``where()`` names the call in an error."""
    kind = getattr(c10d_op, "op", c10d_op)
    op = _REDUCE_BY_KIND.get(kind)
    if op is not None:
        return op
    if kind == dist.ReduceOp.PREMUL_SUM:  # its factor travels in the op's state
        _, factor = c10d_op.__getstate__()
        # a tensor factor goes as it is: read where the op runs (no host sync on CUDA)
        return ReduceOp.PREMUL_SUM(factor if isinstance(factor, torch.Tensor) else float(factor))
    raise ValueError(
        f"{where()}: reduce op {c10d_op!r} has no fastcomms equivalent over a process group "
        f"(supported: {', '.join(_REDUCE_OPS)}, PREMUL_SUM)"
    )


class _CommOps:
    """What the c10d backend of a fastcomms process group calls (NOTE [c10d backend over
    python]): torch's backend methods, by torch's names, each issuing the op with async_op=True."""

    def __init__(self, comm: TorchComm):
        self.comm = comm
        self._coalescing: list | None = None  # p2p ops held between start and end coalescing

    def _where(self, op):
        return f"[rank {self.comm.get_rank()}/{self.comm.get_size()}] fastcomms process group {op}"

    def _each(self, name, tensors, *args):
        """``comm.<name>(t, *args, True)`` for each tensor; the work holds the tensors."""
        issue = getattr(self.comm, name)
        return _CommWork([issue(t, *args, True) for t in tensors], tensors)

    def _pairs(self, name, outputs, inputs, *args):
        """``comm.<name>(o, i, *args, True)`` per (output, input); the work holds the outputs."""
        issue = getattr(self.comm, name)
        return _CommWork(
            [issue(o, i, *args, True) for o, i in zip(outputs, inputs, strict=True)], outputs
        )

    def _op(self, c10d_op, name):
        return _reduce_op(c10d_op, lambda: self._where(name))

    # -- collectives -------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = self._op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "allreduce")
        return self._each("all_reduce", tensors, op)

    allreduce_coalesced = allreduce

    def broadcast(self, tensors, opts=None):
        return self._each("broadcast", tensors, opts.rootRank if opts is not None else 0)

    def reduce(self, tensors, opts=None):
        return self._each("reduce", tensors, opts.rootRank, self._op(opts.reduceOp, "reduce"))

    def allgather(self, output_lists, inputs, opts=None):
        return self._pairs("all_gather", output_lists, inputs)

    def _allgather_base(self, output, input, opts=None):  # noqa: A002
        return self._pairs("all_gather_single", [output], [input])

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._pairs("all_gather_single", outputs, inputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = self._op(opts.reduceOp, "reduce_scatter")
        return self._pairs("reduce_scatter", outputs, input_lists, op)

    def _reduce_scatter_base(self, output, input, opts=None):  # noqa: A002
        return self.reduce_scatter_tensor_coalesced([output], [input], opts)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = self._op(opts.reduceOp, "reduce_scatter_tensor")
        return self._pairs("reduce_scatter_single", outputs, inputs, op)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):  # noqa: A002
        if not output_split_sizes and not input_split_sizes:
            return _CommWork([self.comm.all_to_all_single(output, input, True)], [output])
        n = self.comm.get_size()
        out_splits = list(output_split_sizes) or [output.shape[0] // n] * n
        in_splits = list(input_split_sizes) or [input.shape[0] // n] * n
        work = self.comm.all_to_all_v_single(output, input, out_splits, in_splits, True)
        return _CommWork([work], [output])

    def alltoall(self, outputs, inputs, opts=None):
        return _CommWork([self.comm.all_to_all(outputs, inputs, True)], outputs)

    def gather(self, output_lists, inputs, opts=None):
        root = opts.rootRank
        out = output_lists[0] if self.comm.get_rank() == root else []
        return _CommWork([self.comm.gather(out, inputs[0], root, True)], output_lists)

    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank
        inp = input_lists[0] if self.comm.get_rank() == root else []
        return _CommWork([self.comm.scatter(outputs[0], inp, root, True)], outputs)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        """torch.distributed's gloo health-checking barrier, on the communicator (CPU only).
        torch passes its unset timeout as a non-positive one: the communicator's then."""
        if timeout is not None and timeout.total_seconds() <= 0:
            timeout = None
        self.comm.monitored_barrier(timeout, wait_all_ranks)

    def barrier(self, opts=None):
        # As torch's NCCL process group: waiting on a barrier blocks the host until the current
        # stream's earlier work is done (code relies on a barrier to flush buffer clears).
        dev = self.comm.get_device()
        return _CommWork([self.comm.barrier(True)], [], dev if dev.type == "cuda" else None)

    def _p2p(self, kind, tensors, peer):
        if self._coalescing is not None:
            self._coalescing += [(kind, t, peer) for t in tensors]
            return _CommWork([], tensors)
        return self._each(kind, tensors, peer)

    def send(self, tensors, dst, tag=0):
        return self._p2p("send", tensors, dst)

    def recv(self, tensors, src, tag=0):
        return self._p2p("recv", tensors, src)

    def recv_anysource(self, tensors, tag=0):
        raise RuntimeError(
            f"{self._where('recv')}: a receive from any source is not supported; name the peer"
        )

    # NOTE [coalesced p2p]: torch's batch_isend_irecv (and _coalescing_manager) bracket a batch
    # with start/end coalescing; the p2p ops between are issued at the end as one batch (one NCCL
    # group), so a send and a receive between the same two ranks cannot block each other.
    # Collectives in between run at once.
    def _start_coalescing(self):
        if self._coalescing is not None:
            raise RuntimeError(f"{self._where('start_coalescing')}: already coalescing")
        self._coalescing = []

    def _end_coalescing(self):
        ops, self._coalescing = self._coalescing, None
        if not ops:
            return _CommWork([], [])
        batch = self.comm.batch_op_create()
        for kind, t, peer in ops:
            getattr(batch, kind)(t, peer)
        return _CommWork([batch.issue(True)], [t for _, t, _ in ops])

    def set_timeout(self, timeout):
        self.comm.set_timeout(timeout)

    def abort(self):
        self.comm.abort()

    def shutdown(self):
        pass  # the communicator belongs to its maker, who finalizes it


def _process_group(ops: _CommOps) -> dist.ProcessGroup:
    """A plain torch ProcessGroup whose backend, for the communicator's device type, forwards to
    ``ops`` (NOTE [c10d backend over a communicator])."""
    comm = ops.comm
    pg = dist.ProcessGroup(dist.HashStore(), comm.get_rank(), comm.get_size())
    backend = _C.make_backend(comm.get_rank(), comm.get_size(), ops)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    pg._register_backend(torch.device(comm.get_device().type), custom, backend)
    pg._set_default_backend(custom)
    return pg


def _ops_of(group) -> _CommOps | None:
    """The ops object behind a process group made here (None for any other group)."""
    if not isinstance(group, dist.ProcessGroup):
        return None
    for device in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(device)
        except (RuntimeError, TypeError):
            continue
        if isinstance(backend, _C.ForwardingBackend):
            return backend.impl
    return None


def _register(pg, group_name, backend_str, global_ranks_mapping):
    """Records ``pg`` in torch's process-group tables (what torch.distributed's rank queries,
    DeviceMesh and the functional collectives look up)."""
    c10d = dist.distributed_c10d
    w = c10d._world
    pg._set_group_name(group_name)
    w.pg_map[pg] = (backend_str, dist.HashStore())  # torch wants a store; the comm has its own
    w.pg_names[pg] = group_name
    w.pg_backend_config[pg] = f"{comm_of(pg).get_device().type}:{backend_str}"
    c10d._register_process_group(group_name, pg)
    w.pg_group_ranks[pg] = global_ranks_mapping
    w.pg_to_tag[pg] = tag = f"ptd:{group_name}"
    w.tags_to_pg.setdefault(tag, []).append(pg)


def _create_torchcomm_process_group(
    comm: TorchComm,
    group_name: str | None = None,
    backend_str: str = "fastcomms",
    global_ranks_mapping: dict[int, int] | None = None,
) -> dist.ProcessGroup:
    """A torch.distributed ProcessGroup whose every collective runs on ``comm``, registered with
    torch under ``group_name`` (default: the communicator's name). ``global_ranks_mapping`` maps
    each member's global rank to its rank in ``comm`` (default: the identity)."""
    if not isinstance(comm, TorchComm):
        raise TypeError(f"expected a fastcomms TorchComm, got {type(comm).__name__}")
    pg = _process_group(_CommOps(comm))
    n = comm.get_size()
    mapping = global_ranks_mapping or {i: i for i in range(n)}
    if len(mapping) != n or sorted(mapping.values()) != list(range(n)):
        raise ValueError(
            f"global_ranks_mapping must map {n} global ranks onto 0..{n - 1}, got {mapping}"
        )
    _register(pg, group_name or comm.get_name(), backend_str, dict(mapping))
    return pg


def _unregister(pg):
    """Removes ``pg`` from torch's tables (and as the default group if it is that)."""
    c10d = dist.distributed_c10d
    w = c10d._world
    for table in (w.pg_map, w.pg_names, w.pg_backend_config, w.pg_group_ranks):
        table.pop(pg, None)
    tag = w.pg_to_tag.pop(pg, None)
    if tag is not None and pg in w.tags_to_pg.get(tag, []):
        w.tags_to_pg[tag].remove(pg)
    try:
        c10d._unregister_process_group(pg.group_name)
    except (AttributeError, RuntimeError, KeyError):
        pass
    if c10d.GroupMember.WORLD is pg:
        c10d._update_default_pg(None)


def comm_of(group) -> TorchComm | None:
    """The TorchComm behind a process group made here (None for any other group)."""
    ops = _ops_of(group)
    return None if ops is None else ops.comm


# NOTE [process-group windows]: torchcomms #3492 makes ``pg.new_window(tensor=None)`` and
# ``pg.supports_window`` of a ProcessGroup over its c10d wrapper reach the communicator's window
# (torch >= 2.14 routes them to the c10d backend). fastcomms' c10d backend forwards to Python, so
# here ProcessGroup's two members are wrapped once: a group over a fastcomms communicator answers
# with ``comm.new_window(tensor)`` (a TorchCommWindow; collective; gloo raises UnsupportedError as
# ``comm.new_window`` does) and with whether its backend has windows; any other group gets
# torch's own answer (where torch has none: no windows, and new_window raises). Whether a backend
# has windows is its own answer (Backend::supports_window, C++).


def _install_process_group_windows() -> None:
    pg_cls = dist.ProcessGroup
    if getattr(pg_cls, "_fastcomms_windows", False):
        return
    torch_new_window = getattr(pg_cls, "new_window", None)
    torch_supports = getattr(pg_cls, "supports_window", None)

    def new_window(self, tensor=None, *args, **kwargs):
        comm = comm_of(self)
        if comm is not None:
            return comm.new_window(tensor)
        if torch_new_window is None:
            raise RuntimeError(
                f"ProcessGroup.new_window: this torch ({torch.__version__}) has no c10d window "
                "API; windows of process groups are those over a fastcomms communicator"
            )
        return torch_new_window(self, tensor, *args, **kwargs)

    def supports_window(self) -> bool:
        comm = comm_of(self)
        if comm is not None:
            return comm._c.supports_window()
        if isinstance(torch_supports, property):
            return bool(torch_supports.fget(self))
        return False

    new_window.__doc__ = "A window of this group's communicator (NOTE [process-group windows])."
    pg_cls.new_window = new_window
    pg_cls.supports_window = property(supports_window)
    pg_cls._fastcomms_windows = True


_install_process_group_windows()


def resolve_group(group, who: str, dim: str):
    """What a group-taking constructor (``who``) runs over: a 1-D DeviceMesh's process group
    (``dim`` names the dimension in the error's slicing hint), the TorchComm behind a process group
    made here, else ``group`` as given."""
    if hasattr(group, "get_group") and hasattr(group, "mesh"):
        if group.ndim != 1:
            raise ValueError(
                f"{who}: a DeviceMesh must be 1-D (slice it, mesh['{dim}']), got {group.ndim} "
                "dimensions"
            )
        group = group.get_group()
    return comm_of(group) or group


def group_rank_size(group, who: str):
    """(group, rank, size) of what ``resolve_group`` returned: a TorchComm as it is, else the
    ProcessGroup (None: torch.distributed's default group, which must exist)."""
    if isinstance(group, TorchComm):
        return group, group.get_rank(), group.get_size()
    pg = group or dist.group.WORLD
    if pg is None:
        raise ValueError(
            f"{who}: no group given and torch.distributed has no default group "
            "(call init_process_group, or pass a fastcomms communicator)"
        )
    return pg, dist.get_rank(pg), dist.get_world_size(pg)


def init_device_mesh(
    mesh_dim_comms: tuple[TorchComm, ...],
    mesh_dim_names: tuple[str, ...],
    _global_comm: TorchComm | None = None,
) -> dist.DeviceMesh:
    """A DeviceMesh whose dimension ``i`` runs on ``mesh_dim_comms[i]`` (each rank passes the
    communicators of the groups it belongs to, one per dimension, in row-major mesh order: the
    first dimension varies slowest). With more than one dimension ``_global_comm`` (over every
    rank) is required; it (or the one dimension's group) becomes torch's default group unless the
    process already has one (then that one stays, and must number the ranks the same way)."""
    if len(mesh_dim_comms) != len(mesh_dim_names) or not mesh_dim_comms:
        raise ValueError(
            f"init_device_mesh: {len(mesh_dim_comms)} communicators for "
            f"{len(mesh_dim_names)} dimension names"
        )
    if len(mesh_dim_comms) > 1 and _global_comm is None:
        raise ValueError(
            "init_device_mesh: a mesh of more than one dimension needs _global_comm (a "
            "communicator over every rank) to serve as the default group"
        )
    shape = tuple(c.get_size() for c in mesh_dim_comms)
    world = math.prod(shape)
    if _global_comm is not None and _global_comm.get_size() != world:
        raise ValueError(
            f"init_device_mesh: _global_comm has {_global_comm.get_size()} ranks, the mesh "
            f"{shape} has {world}"
        )
    mesh = torch.arange(world, dtype=torch.int).view(shape)
    coords = tuple(c.get_rank() for c in mesh_dim_comms)
    rank = int(mesh[coords].item())
    if _global_comm is not None and _global_comm.get_rank() != rank:
        raise ValueError(
            f"init_device_mesh: this rank sits at {coords} of the mesh (global rank {rank}) but "
            f"is rank {_global_comm.get_rank()} of _global_comm; order the communicators' ranks "
            "row-major"
        )
    default = None
    if _global_comm is not None:
        default = _create_torchcomm_process_group(_global_comm, _global_comm.get_name())
    for dim, (comm, name) in enumerate(zip(mesh_dim_comms, mesh_dim_names, strict=True)):
        # the global ranks of this rank's group along `dim`, in group-rank order
        members = mesh[(*coords[:dim], slice(None), *coords[dim + 1 :])].tolist()
        pg = _create_torchcomm_process_group(
            comm, name, global_ranks_mapping={g: i for i, g in enumerate(members)}
        )
        default = default or pg
    if not dist.is_initialized():  # torch's default group: ours unless the process has one
        dist.distributed_c10d.GroupMember.WORLD = default
    dm = dist.DeviceMesh(
        device_type=mesh_dim_comms[0].get_device().type,
        mesh=mesh,
        mesh_dim_names=tuple(mesh_dim_names),
        _init_backend=False,
        _rank=rank,
    )
    dm._dim_group_names = list(mesh_dim_names)
    return dm


def _flatten_with_comm(mesh, mesh_dim_name: str, comm: TorchComm, global_ranks, layout):
    """Makes ``mesh_dim_name`` a flattened dimension of ``mesh``'s root mesh that runs on
    ``comm``: ``layout`` (a ``torch.distributed._mesh_layout._MeshLayout``) describes the mesh
    dimensions it merges, ``global_ranks`` lists the members in ``comm``'s rank order. Returns
    the flattened 1-D DeviceMesh; ``root[mesh_dim_name]`` finds it afterwards (as torchcomms'
    function of that name)."""
    members = list(global_ranks)
    if len(members) != comm.get_size():
        raise ValueError(
            f"_flatten_with_comm: {len(members)} global ranks for a communicator of "
            f"{comm.get_size()}"
        )
    _create_torchcomm_process_group(
        comm, mesh_dim_name, global_ranks_mapping={g: i for i, g in enumerate(members)}
    )
    flat = _torch_compat.flat_mesh_layout(layout)  # one dimension, as torch's _flatten makes it
    root = mesh._get_root_mesh()
    dm = dist.DeviceMesh(
        root.device_type,
        _layout=flat,
        _rank_map=root._rank_map,
        mesh_dim_names=(mesh_dim_name,),
        _root_mesh=root,
        _init_backend=False,
    )
    dm._dim_group_names = [mesh_dim_name]
    root._flatten_mapping[mesh_dim_name] = dm
    return dm


# NOTE [nvlink as a torch.distributed backend]: `import fastcomms` registers "nvlink" with torch
# (Backend.register_backend, CUDA only), so `init_process_group("nvlink")` and
# `new_group(backend="nvlink")` make process groups over fastcomms nvlink communicators, with or
# without torch's torchcomms switch. The group owns its communicator: torch's shutdown finalizes
# it. Where torch imports fastcomms while torch.distributed is itself being imported, the name is
# registered at the first import after (fastcomms/_alias.py, register_with_torch).
class _OwnedCommOps(_CommOps):
    """The ops of a group torch made through the registered name: it owns its communicator."""

    def shutdown(self):
        self.comm.finalize()  # a no-op once finalized or aborted


def _create_for_torch(backend: str, opts):
    """The c10d backend torch asks the registered name ``backend`` for (its extended creator
    arguments ``opts``; NOTE [nvlink as a torch.distributed backend])."""
    # The default group: cuda:(rank % device count) as torchcomms resolves `cuda`; a later group
    # of some ranks: the device this process already runs on.
    device = torch.device("cuda", torch.cuda.current_device() if dist.is_initialized() else None)
    token = _rank_size_override.set((int(opts.group_rank), int(opts.group_size)))
    try:
        comm = new_comm(backend, device, str(opts.group_id), store=opts.store, timeout=opts.timeout)
    finally:
        _rank_size_override.reset(token)
    return _C.make_backend(comm.get_rank(), comm.get_size(), _OwnedCommOps(comm))
