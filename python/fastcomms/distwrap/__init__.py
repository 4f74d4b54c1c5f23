# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A drop-in for the torch.distributed functions (API.md §1): the same signatures, run on
fastcomms communicators. Groups are fastcomms communicators split from the default one, each a
real ``torch.distributed.ProcessGroup`` registered with torch (fastcomms.device_mesh), so torch's
own functions (``torch.distributed.get_rank(g)``, ``P2POp``, DeviceMesh, FSDP2) accept them; the
default group becomes torch's default group when the process has none. Ranks in arguments (src,
dst, ranks) are global ranks, as in torch.distributed.

As torchcomms' distwrap: ``init_process_group(..., use_torchcomms=...)`` picks the engine:
True (fastcomms' default) runs every call on fastcomms communicators; False makes torch's own
process group and every function here then calls torch.distributed's. torch.distributed's
names (``ReduceOp``, ``ProcessGroup``, ``Work``, ``group``, ``get_process_group_ranks``,
``_make_nccl_premul_sum``, ...) are here too, and the object collectives. Unlike torch, the
object collectives load with ``weights_only=True`` (tensors, containers and plain values; a
pickled class is refused)."""

from __future__ import annotations

import datetime
import functools
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


def _or_torch(fn):
    """In torch mode the function of the same name in torch.distributed runs instead."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _torch_mode:
            return getattr(_td, fn.__name__)(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


GroupMember = _td.GroupMember  # torch's: NON_GROUP_MEMBER is what new_group returns to outsiders


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
    """A process group (a plain torch ProcessGroup over the communicator, NOTE [process group
    over a communicator]) registered with torch.distributed as ``fastcomms/<communicator name>``."""
    pg = _process_group(_GroupOps(comm, ranks))
    _register(pg, f"fastcomms/{comm.get_name()}", "fastcomms", {g: i for i, g in enumerate(ranks)})
    return pg


_default = None  # the default group (a torch ProcessGroup made by _new_group)
_splits = 0


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
    use_torchcomms=True,
):
    """Creates the default group. ``backend``: "gloo", "nccl", or torch's "cpu:gloo,cuda:nccl"
    form (fastcomms picks one per default device: CUDA when ``device_id`` is a CUDA device).
    ``use_torchcomms=False``: torch.distributed's own group, and torch runs every call."""
    global _default, _torch_mode
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
    if rank < 0:
        rank = int(os.environ.get("RANK", "-1"))
    if world_size < 0:
        world_size = int(os.environ.get("WORLD_SIZE", "-1"))
    if rank < 0 or world_size < 1:
        raise ValueError("init_process_group: rank and world_size are needed (arguments or env)")
    timeout = timeout or datetime.timedelta(seconds=600)
    method = init_method or "env://"
    if store is None and method.startswith("file://"):
        store = _td.FileStore(method[len("file://") :], world_size)
    elif store is None:
        if method.startswith("tcp://"):
            host, port = method[len("tcp://") :].rsplit(":", 1)
        else:
            host = os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = os.environ.get("MASTER_PORT", "29500")
        store = _td.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
    device = torch.device(device_id) if device_id is not None else torch.device("cpu")
    name = str(backend or "gloo")
    chosen = "nccl" if device.type == "cuda" and "nccl" in name else "gloo"
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(world_size)
    comm = fastcomms.new_comm(
        chosen, device, timeout=timeout, store=store, name=group_name or "default"
    )
    _default = _new_group(comm, list(range(world_size)))
    if not _td.is_initialized():  # torch's functions then see it as the default group
        _td.distributed_c10d._update_default_pg(_default)


def is_initialized() -> bool:
    return _td.is_initialized() if _torch_mode else _default is not None


def destroy_process_group(group=None) -> None:
    global _default, _torch_mode
    if _torch_mode:
        _td.destroy_process_group(group)
        if group is None:
            _torch_mode = False
        return
    pg = _default if group is None else group
    g = _group(pg)
    g.comm.finalize()
    _unregister(pg)
    if pg is _default:
        _default = None


@_or_torch
def get_rank(group=None) -> int:
    return _group(group).rank()


@_or_torch
def get_world_size(group=None) -> int:
    return _group(group).size()


@_or_torch
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
    ranks = sorted(ranks) if ranks is not None else list(range(d.size()))
    _splits += 1
    mine = ranks if d.rank() in ranks else []  # the group this rank joins (a colour split)
    sub = d.comm.split(mine, group_desc or f"group{_splits}", timeout=timeout)
    return GroupMember.NON_GROUP_MEMBER if sub is None else _new_group(sub, ranks)


@_or_torch
def split_group(
    parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None, backend=None
):
    """Splits ``parent_pg`` into the disjoint rank lists of ``split_ranks``; returns this rank's
    group, or None when it is in none of them."""
    global _splits
    parent = _group(parent_pg)
    me = parent.ranks[parent.rank()]
    mine = next((sorted(r) for r in split_ranks if me in r), None)
    _splits += 1
    name = group_desc or f"split{_splits}"
    if mine is None:  # still a collective call for backends that split collectively
        parent.comm.split([], name, timeout=timeout)
        return None
    sub = parent.comm.split([parent.group_rank(r) for r in mine], name, timeout=timeout)
    return _new_group(sub, mine)


@_or_torch
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    return _result(_group(group).comm.all_reduce(tensor, _op(op), async_op), async_op)


@_or_torch
def broadcast(tensor, src, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.broadcast(tensor, g.group_rank(src), async_op), async_op)


@_or_torch
def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.reduce(tensor, g.group_rank(dst), _op(op), async_op), async_op)


@_or_torch
def all_gather(tensor_list, tensor, group=None, async_op=False):
    g = _group(group)
    same = all(t.numel() == tensor.numel() for t in tensor_list)
    fn = g.comm.all_gather if same else g.comm.all_gather_v
    return _result(fn(tensor_list, tensor, async_op), async_op)


@_or_torch
def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.all_gather_single(output_tensor, input_tensor, async_op), async_op)


@_or_torch
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    same = all(t.numel() == output.numel() for t in input_list)
    fn = g.comm.reduce_scatter if same else g.comm.reduce_scatter_v
    return _result(fn(output, input_list, _op(op), async_op), async_op)


@_or_torch
def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
    g = _group(group)
    return _result(g.comm.reduce_scatter_single(output, input, _op(op), async_op), async_op)


@_or_torch
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.all_to_all(output_tensor_list, input_tensor_list, async_op), async_op)


@_or_torch
def all_to_all_single(
    output,
    input,
    output_split_sizes=None,
    input_split_sizes=None,  # noqa: A002
    group=None,
    async_op=False,
):
    g = _group(group)
    work = g.comm.all_to_all_v_single(
        output, input, output_split_sizes or [], input_split_sizes or [], async_op
    )
    return _result(work, async_op)


@_or_torch
def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    g = _group(group)
    return _result(
        g.comm.scatter(tensor, scatter_list or [], g.group_rank(src), async_op), async_op
    )


@_or_torch
def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.gather(gather_list or [], tensor, g.group_rank(dst), async_op), async_op)


@_or_torch
def barrier(group=None, async_op=False, device_ids=None):
    return _result(_group(group).comm.barrier(async_op), async_op)


def _peer(g, rank, what):
    if rank is None:
        raise ValueError(f"fastcomms.distwrap: {what} from any source is not supported; pass it")
    return g.group_rank(rank)


@_or_torch
def isend(tensor, dst, group=None, tag=0):
    g = _group(group)
    return g.comm.send(tensor, _peer(g, dst, "send"), True)


@_or_torch
def irecv(tensor, src=None, group=None, tag=0):
    g = _group(group)
    return g.comm.recv(tensor, _peer(g, src, "recv"), True)


@_or_torch
def send(tensor, dst, group=None, tag=0):
    isend(tensor, dst, group, tag).wait()


@_or_torch
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
        return _td.batch_isend_irecv(
            [
                _td.P2POp(
                    _td.isend if getattr(p.op, "__name__", "") in ("isend", "send") else _td.irecv,
                    p.tensor,
                    p.peer,
                    p.group,
                    p.tag,
                )
                for p in p2p_op_list
            ]
        )
    group = p2p_op_list[0].group
    # torch's P2POp names its own group
    g = _group(group if isinstance(_ops_of(group), _GroupOps) else None)
    batch = g.comm.batch_op_create()
    for p in p2p_op_list:
        name = getattr(p.op, "__name__", str(p.op))
        if name in ("isend", "send"):
            batch.send(p.tensor, g.group_rank(p.peer))
        elif name in ("irecv", "recv"):
            batch.recv(p.tensor, g.group_rank(p.peer))
        else:
            raise ValueError(f"batch_isend_irecv: op must be isend or irecv, got {p.op!r}")
    return [batch.issue(True)]


# -- object collectives (torch.distributed's signatures; ranks are global) ----------------------
def _src(g, src, group_src, what):
    if group_src is not None:
        return group_src
    if src is None:
        raise ValueError(f"fastcomms.distwrap {what}: pass src (a global rank) or group_src")
    return g.group_rank(src)


@_or_torch
def all_gather_object(object_list, obj, group=None):
    _objcol.all_gather_object(_group(group).comm, object_list, obj)


@_or_torch
def broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    g = _group(group)
    _objcol.broadcast_object_list(g.comm, object_list, _src(g, src, group_src, "broadcast"))


@_or_torch
def gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    g = _group(group)
    _objcol.gather_object(g.comm, obj, _src(g, dst, group_dst, "gather_object"), object_gather_list)


@_or_torch
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


def register_mem_pool(group=None, device=None, pool=None):
    """torchcomms' NCCLX memory-pool registration: not in fastcomms."""
    raise UnsupportedError("fastcomms.distwrap register_mem_pool: an NCCLX feature (memory pools)")


group = _td.group  # torch.distributed.group (group.WORLD); bound last: parameters take the name
