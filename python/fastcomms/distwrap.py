# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""A drop-in for the torch.distributed functions (API.md §1): the same signatures, run on
fastcomms communicators. Groups are fastcomms communicators split from the default one, each a
real ``torch.distributed.ProcessGroup`` registered with torch (fastcomms.device_mesh), so torch's
own functions (``torch.distributed.get_rank(g)``, ``P2POp``, DeviceMesh, FSDP2) accept them; the
default group becomes torch's default group when the process has none. Ranks in arguments (src,
dst, ranks) are global ranks, as in torch.distributed."""

from __future__ import annotations

import datetime
import os

import torch

import fastcomms
from fastcomms import RedOpType, ReduceOp, TorchComm
from fastcomms.device_mesh import _CommOps, _ops_of, _process_group, _register, _unregister

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
]


class _NonMember:
    def __repr__(self) -> str:
        return "GroupMember.NON_GROUP_MEMBER"


class GroupMember:
    NON_GROUP_MEMBER = _NonMember()


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
    if group is GroupMember.NON_GROUP_MEMBER:
        raise ValueError("fastcomms.distwrap: this rank is not a member of the group")
    ops = _ops_of(group)
    if not isinstance(ops, _GroupOps):
        raise TypeError(
            f"fastcomms.distwrap: expected a group made by fastcomms.distwrap, got {group!r}"
        )
    return ops


def _op(op) -> ReduceOp:
    if isinstance(op, ReduceOp):
        return op
    name = getattr(op, "name", None) or str(op).split(".")[-1]
    try:
        return ReduceOp(RedOpType.__members__[name])
    except KeyError:
        raise ValueError(f"fastcomms.distwrap: unsupported reduce op {op!r}") from None


def _result(work, async_op):
    if async_op:
        return work
    return None


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
):
    """Creates the default group. ``backend``: "gloo", "nccl", or torch's "cpu:gloo,cuda:nccl"
    form (fastcomms picks one per default device: CUDA when ``device_id`` is a CUDA device)."""
    global _default
    if _default is not None:
        raise RuntimeError("fastcomms.distwrap: the default group is already initialized")
    if rank < 0:
        rank = int(os.environ.get("RANK", "-1"))
    if world_size < 0:
        world_size = int(os.environ.get("WORLD_SIZE", "-1"))
    if rank < 0 or world_size < 1:
        raise ValueError("init_process_group: rank and world_size are needed (arguments or env)")
    timeout = timeout or datetime.timedelta(seconds=600)
    if store is None:
        import torch.distributed as dist

        method = init_method or "env://"
        if method.startswith("file://"):
            store = dist.FileStore(method[len("file://") :], world_size)
        elif method.startswith("tcp://"):
            host, port = method[len("tcp://") :].rsplit(":", 1)
            store = dist.TCPStore(host, int(port), world_size, rank == 0, timeout=timeout)
        else:
            store = dist.TCPStore(
                os.environ.get("MASTER_ADDR", "127.0.0.1"),
                int(os.environ.get("MASTER_PORT", "29500")),
                world_size,
                rank == 0,
                timeout=timeout,
            )
    device = torch.device(device_id) if device_id is not None else torch.device("cpu")
    name = str(backend or "gloo")
    chosen = "nccl" if device.type == "cuda" and "nccl" in name else "gloo"
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(world_size)
    comm = fastcomms.new_comm(
        chosen, device, timeout=timeout, store=store, name=group_name or "default"
    )
    _default = _new_group(comm, list(range(world_size)))
    import torch.distributed as dist

    if not dist.is_initialized():  # torch's functions then see it as the default group
        dist.distributed_c10d._update_default_pg(_default)


def is_initialized() -> bool:
    return _default is not None


def destroy_process_group(group=None) -> None:
    global _default
    pg = _default if group is None else group
    g = _group(pg)
    g.comm.finalize()
    _unregister(pg)
    if pg is _default:
        _default = None


def get_rank(group=None) -> int:
    return _group(group).rank()


def get_world_size(group=None) -> int:
    return _group(group).size()


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


def split_group(parent_pg=None, split_ranks=None, timeout=None, pg_options=None, group_desc=None):
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


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.all_reduce(tensor, _op(op), async_op), async_op)


def broadcast(tensor, src, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.broadcast(tensor, g.group_rank(src), async_op), async_op)


def reduce(tensor, dst, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.reduce(tensor, g.group_rank(dst), _op(op), async_op), async_op)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    g = _group(group)
    same = all(t.numel() == tensor.numel() for t in tensor_list)
    fn = g.comm.all_gather if same else g.comm.all_gather_v
    return _result(fn(tensor_list, tensor, async_op), async_op)


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.all_gather_single(output_tensor, input_tensor, async_op), async_op)


def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    g = _group(group)
    same = all(t.numel() == output.numel() for t in input_list)
    fn = g.comm.reduce_scatter if same else g.comm.reduce_scatter_v
    return _result(fn(output, input_list, _op(op), async_op), async_op)


def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):  # noqa: A002
    g = _group(group)
    return _result(g.comm.reduce_scatter_single(output, input, _op(op), async_op), async_op)


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.all_to_all(output_tensor_list, input_tensor_list, async_op), async_op)


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


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    g = _group(group)
    return _result(
        g.comm.scatter(tensor, scatter_list or [], g.group_rank(src), async_op), async_op
    )


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    g = _group(group)
    return _result(g.comm.gather(gather_list or [], tensor, g.group_rank(dst), async_op), async_op)


def barrier(group=None, async_op=False, device_ids=None):
    g = _group(group)
    return _result(g.comm.barrier(async_op), async_op)


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
