# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A drop-in for the torch.distributed functions (API.md §1) on fastcomms communicators, with
torchcomms' distwrap surface (docs/torchcomms.md). Groups are torch ProcessGroups over
communicators (fastcomms.device_mesh) registered with torch, so torch's own functions accept them;
the default group becomes torch's default group when the process has none. Ranks in arguments
(src, dst, ranks) are global ranks. ``init_process_group(..., use_torchcomms=False)`` makes
torch's own group instead, and every function here then calls torch.distributed's (the wrapping
at the end of this file). Unlike torch, the object collectives load with ``weights_only=True``."""

from __future__ import annotations

import datetime
import functools
import inspect
import os

import torch
import torch.distributed as _td
from torch.distributed import (  # noqa: F401  (torch.distributed's names, as torchcomms' distwrap)
    HashStore,
    ProcessGroup,
    ReduceOp,
    Store,
    Work,
    _make_nccl_premul_sum,
    get_process_group_ranks,
    is_available,
)

import fastcomms
from fastcomms import RedOpType, TorchComm, UnsupportedError
from fastcomms import ReduceOp as _FcReduceOp
from fastcomms import objcol as _objcol
from fastcomms.device_mesh import (
    _CommOps,
    _ops_of,
    _process_group,
    _reduce_op,
    _register,
    _unregister,
)

__all__ = [
    "init_process_group",
    "destroy_process_group",
    "is_initialized",
    "new_group",
    "split_group",
    "get_rank",
    "get_world_size",
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "scatter",
    "gather",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "P2POp",
    "GroupMember",
    "ReduceOp",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "new_window",
]

_torch_mode = False  # init_process_group(use_torchcomms=False): torch.distributed does it all
ProcessGroupGloo = getattr(_td, "ProcessGroupGloo", None)  # torch's, where this torch has them
ProcessGroupNCCL = getattr(_td, "ProcessGroupNCCL", None)
GroupMember = _td.GroupMember  # torch's: NON_GROUP_MEMBER is what new_group returns to outsiders
_default = None  # the default group (a torch ProcessGroup made by _new_group)
_splits = 0  # groups made so far (their default names)


class _GroupOps(_CommOps):
    """What a distwrap group knows: its communicator and the global ranks it spans."""

    def __init__(self, comm: TorchComm, ranks: list[int]) -> None:
        super().__init__(comm)
        self.ranks = ranks

    def group_rank(self, global_rank: int) -> int:
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(
                f"rank {global_rank} is not in the group (global ranks {self.ranks})"
            ) from None


def _new_group(comm: TorchComm, ranks: list[int]):
    """A process group over ``comm``, registered with torch as ``fastcomms/<comm name>``."""
    pg = _process_group(_GroupOps(comm, ranks))
    _register(pg, f"fastcomms/{comm.get_name()}", "fastcomms", {g: i for i, g in enumerate(ranks)})
    return pg


def _group(group) -> _GroupOps:
    if group is None:
        if _default is None:
            raise RuntimeError("fastcomms.distwrap: call init_process_group first")
        group = _default
    if not isinstance(group, ProcessGroup) and group == GroupMember.NON_GROUP_MEMBER:
        raise ValueError("fastcomms.distwrap: this rank is not a member of the group")
    ops = _ops_of(group)
    if not isinstance(ops, _GroupOps):
        raise TypeError(
            f"fastcomms.distwrap: expected a group made by fastcomms.distwrap, got {group!r}"
        )
    return ops


def _op(op) -> _FcReduceOp:
    if isinstance(op, _FcReduceOp):
        return op
    if isinstance(op, _td.ReduceOp):  # torch's, PREMUL_SUM's factor included
        return _reduce_op(op, lambda: "fastcomms.distwrap")
    name = getattr(op, "name", None) or str(op).split(".")[-1]
    try:
        return _FcReduceOp(RedOpType.__members__[name])
    except KeyError:
        raise ValueError(f"fastcomms.distwrap: unsupported reduce op {op!r}") from None


def _result(work, async_op):
    return work if async_op else None


def init_process_group(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    group_name="",
    pg_options=None,
    device_id=None,
    use_torchcomms=False,
):
    """Creates the default group, with torchcomms' defaults: ``backend`` must be given ("gloo",
    "nccl", or torch's "cpu:gloo,cuda:nccl" form: fastcomms picks one per default device, CUDA when
    ``device_id`` is a CUDA device); ``use_torchcomms=False`` (the default): torch.distributed's
    own group, and torch runs every call; ``use_torchcomms=True``: a fastcomms communicator runs
    them. ``pg_options`` goes to torch's group as given; over fastcomms its
    ``is_high_priority_stream`` (torch's NCCL options) becomes new_comm's (the timeout is
    ``timeout``'s, as torch sets the options' own from it)."""
    global _default, _torch_mode
    if backend is None:
        raise ValueError("backend must be specified")
    if _default is not None or _torch_mode:
        raise RuntimeError("fastcomms.distwrap: the default group is already initialized")
    if not use_torchcomms:
        _td.init_process_group(
            backend,
            init_method,
            timeout,
            world_size,
            rank,
            store,
            group_name,
            pg_options,
            device_id,
        )
        _torch_mode = True
        return
    rank = rank if rank >= 0 else int(os.environ.get("RANK", "-1"))
    world_size = world_size if world_size >= 0 else int(os.environ.get("WORLD_SIZE", "-1"))
    if rank < 0 or world_size < 1:
        raise ValueError("init_process_group: rank and world_size are needed (arguments or env)")
    high_priority = bool(getattr(pg_options, "is_high_priority_stream", False))
    timeout = timeout or datetime.timedelta(seconds=600)
    method = init_method or "env://"
    if store is None and method.startswith("file://"):
        store = _td.FileStore(method.removeprefix("file://"), world_size)
    elif store is None:
        if method.startswith("tcp://"):
            host, port = method.removeprefix("tcp://").rsplit(":", 1)
        else:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = os.environ.get("MASTER_PORT", "29500")
        store = _td.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
    device = torch.device(device_id) if device_id is not None else torch.device("cpu")
    chosen = "nccl" if device.type == "cuda" and "nccl" in str(backend or "gloo") else "gloo"
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(world_size)
    comm = fastcomms.new_comm(
        chosen,
        device,
        timeout=timeout,
        store=store,
        name=group_name or "default",
        is_high_priority_stream=high_priority or None,
    )
    _default = _new_group(comm, list(range(world_size)))
    if not _td.is_initialized():  # torch's functions then see it as the default group
        _td.distributed_c10d._update_default_pg(_default)


def is_initialized() -> bool:
    return _default is not None


def destroy_process_group(group=None) -> None:
    global _default, _torch_mode
    if _torch_mode:
        _td.destroy_process_group(group)
        _torch_mode = group is not None
        return
    pg = _default if group is None else group
    _group(pg).comm.finalize()
    _unregister(pg)
    if pg is _default:
        _default = None


def get_rank(group=None) -> int:
    return _group(group).comm.get_rank()


def get_world_size(group=None) -> int:
    return _group(group).comm.get_size()


def new_group(
    ranks=None,
    timeout=None,
    backend=None,
    pg_options=None,
    use_local_synchronization=False,
    group_desc=None,
):
    """Collective over the default group; returns NON_GROUP_MEMBER on ranks not in ``ranks``."""
    global _splits
    d = _group(None)
    ranks = sorted(ranks) if ranks is not None else list(range(d.comm.get_size()))
    _splits += 1
    mine = ranks if d.comm.get_rank() in ranks else []  # the group this rank joins (a colour split)
    sub = d.comm.split(mine, group_desc or f"group{_splits}", timeout=timeout)
    return GroupMember.NON_GROUP_MEMBER if sub is None else _new_group(sub, ranks)


def split_group(
    parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None
):
    """Splits ``parent_pg`` into the disjoint rank lists of ``split_ranks``; returns this rank's
    group, or None when it is in none of them."""
    global _splits
    parent = _group(parent_pg)
    me = parent.ranks[parent.comm.get_rank()]
    mine = next((sorted(r) for r in split_ranks if me in r), None)
    _splits += 1
    name = group_desc or f"split{_splits}"
    if mine is None:  # still a collective call for backends that split collectively
        parent.comm.split([], name, timeout=timeout)
        return None
    return _new_group(
        parent.comm.split([parent.group_rank(r) for r in mine], name, timeout=timeout), mine
    )


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return _result(_group(group).comm.all_reduce(tensor, _op(op), async_op), async_op)


def broadcast(tensor, src, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.broadcast(tensor, g.group_rank(src), async_op), async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.reduce(tensor, g.group_rank(dst), _op(op), async_op), async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    comm = _group(group).comm
    same = all(t.numel() == tensor.numel() for t in tensor_list)
    fn = comm.all_gather if same else comm.all_gather_v
    return _result(fn(tensor_list, tensor, async_op), async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    comm = _group(group).comm
    return _result(comm.all_gather_single(output_tensor, input_tensor, async_op), async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    comm = _group(group).comm
    same = all(t.numel() == output.numel() for t in input_list)
    fn = comm.reduce_scatter if same else comm.reduce_scatter_v
    return _result(fn(output, input_list, _op(op), async_op), async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
    comm = _group(group).comm
    return _result(comm.reduce_scatter_single(output, input, _op(op), async_op), async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    comm = _group(group).comm
    return _result(comm.all_to_all(output_tensor_list, input_tensor_list, async_op), async_op)


def all_to_all_single(
    output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False
):
    out_splits, in_splits = output_split_sizes or [], input_split_sizes or []
    work = _group(group).comm.all_to_all_v_single(output, input, out_splits, in_splits, async_op)
    return _result(work, async_op)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    g = _group(group)
    work = g.comm.scatter(tensor, scatter_list or [], g.group_rank(src), async_op)
    return _result(work, async_op)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.gather(gather_list or [], tensor, g.group_rank(dst), async_op), async_op)


def barrier(group=None, async_op=False, device_ids=None):
    return _result(_group(group).comm.barrier(async_op), async_op)


def _peer(g, rank, what):
    if rank is None:
        raise ValueError(f"fastcomms.distwrap: {what} from any source is not supported; pass it")
    return g.group_rank(rank)


def isend(tensor, dst, group=None, tag=0):
    g = _group(group)
    return g.comm.send(tensor, _peer(g, dst, "send"), True)


def irecv(tensor, src=None, group=None, tag=0):
    g = _group(group)
    return g.comm.recv(tensor, _peer(g, src, "recv"), True)


def send(tensor, dst, group=None, tag=0):
    isend(tensor, dst, group, tag).wait()


def recv(tensor, src=None, group=None, tag=0):
    irecv(tensor, src, group, tag).wait()
    return src


class P2POp:
    """torch.distributed.P2POp: ``op`` is isend or irecv (ours or torch's)."""

    def __init__(self, op, tensor, peer, group=None, tag=0):
        self.op, self.tensor, self.peer, self.group, self.tag = op, tensor, peer, group, tag


def batch_isend_irecv(p2p_op_list):
    """Issues the sends and receives of ``p2p_op_list`` as one batch; returns its works."""
    if not p2p_op_list:
        raise ValueError("batch_isend_irecv: the list is empty")
    if _torch_mode:  # torch's own P2POps, with torch's isend and irecv
        sends = [getattr(p.op, "__name__", "") in ("isend", "send") for p in p2p_op_list]
        return _td.batch_isend_irecv(
            [
                _td.P2POp(_td.isend if s else _td.irecv, p.tensor, p.peer, p.group, p.tag)
                for p, s in zip(p2p_op_list, sends, strict=True)
            ]
        )
    group = p2p_op_list[0].group  # a group not made here (torch's P2POp names its own): default
    g = _group(group if isinstance(_ops_of(group), _GroupOps) else None)
    batch = g.comm.batch_op_create()
    for p in p2p_op_list:
        kind = getattr(p.op, "__name__", str(p.op)).removeprefix("i")
        if kind not in ("send", "recv"):
            raise ValueError(f"batch_isend_irecv: op must be isend or irecv, got {p.op!r}")
        getattr(batch, kind)(p.tensor, g.group_rank(p.peer))
    return [batch.issue(True)]


# -- object collectives (torch.distributed's signatures; ranks are global) ----------------------
def _src(g, src, group_src, what):
    if group_src is not None:
        return group_src
    if src is None:
        raise ValueError(f"fastcomms.distwrap {what}: pass src (a global rank) or group_src")
    return g.group_rank(src)


def all_gather_object(object_list, obj, group=None):
    _objcol.all_gather_object(_group(group).comm, object_list, obj)


def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    g = _group(group)
    _objcol.broadcast_object_list(g.comm, object_list, _src(g, src, group_src, "broadcast"))


def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    g = _group(group)
    _objcol.gather_object(g.comm, obj, _src(g, dst, group_dst, "gather_object"), object_gather_list)


def scatter_object_list(
    scatter_object_output_list, scatter_object_input_list=None, src=None, group=None, group_src=None
):
    g = _group(group)
    root = _src(g, src, group_src, "scatter_object_list")
    _objcol.scatter_object_list(g.comm, root, scatter_object_output_list, scatter_object_input_list)


# -- torchcomms' distwrap extensions --------------------------------------------------------------
def new_window(group=None, backend=None):
    """A window (``TorchCommWindow``) of the group's communicator (torchcomms' distwrap
    extension; needs a backend with windows: nvlink, or nccl with every rank on one host)."""
    if _torch_mode:
        raise RuntimeError("fastcomms.distwrap new_window: needs use_torchcomms=True")
    return _group(group).comm.new_window()


def reduce_scatter_quantized(output, input, op, seed, group=None, async_op=False):  # noqa: A002
    """torchcomms' NCCLX-only reduce-scatter with stochastic quantization: not in fastcomms."""
    raise UnsupportedError(
        "fastcomms.distwrap reduce_scatter_quantized: an NCCLX operation fastcomms does not have"
    )


def get_mem_allocator(group=None, device=None):
    """The window-memory allocator of the group's backend (``fastcomms.get_mem_allocator``)."""
    if _torch_mode:
        raise RuntimeError("fastcomms.distwrap get_mem_allocator: needs use_torchcomms=True")
    return _group(group).comm.get_mem_allocator()


def register_mem_pool(group, device, pool) -> None:
    """torchcomms': over fastcomms (``use_torchcomms=True``) nothing to do, the communicators
    manage their memory; in torch mode the group's backend for ``device`` registers ``pool``
    (torch's ``register_mem_pool``; group None: the default group)."""
    if not _torch_mode:
        return
    pg = _td.group.WORLD if group is None else group
    pg._get_backend(torch.device(device)).register_mem_pool(pool)


def _or_torch(fn):
    """In torch mode the function of the same name in torch.distributed runs instead."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        return (getattr(_td, fn.__name__) if _torch_mode else fn)(*args, **kwargs)

    return run


# every public function but these four runs torch.distributed's function of its name in torch mode
_OWN = ("init_process_group", "destroy_process_group", "batch_isend_irecv", "new_window")
for _name in __all__:
    if _name not in _OWN and inspect.isfunction(globals()[_name]):
        globals()[_name] = _or_torch(globals()[_name])

group = _td.group  # torch.distributed.group (group.WORLD); bound last: parameters take the name
