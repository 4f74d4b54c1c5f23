# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms.distwrap with torch.distributed's signatures, against torch.distributed itself on
the same inputs (world of 3 processes; distwrap gets its own store prefix)."""

import torch
import torch.distributed as dist
from fastcomms import distwrap as fd


def distwrap_matches(comm, rank, size):
    fd.init_process_group(
        "gloo",
        store=dist.PrefixStore("dw", _STORE[0]),
        rank=rank,
        world_size=size,
        use_torchcomms=True,
    )
    assert fd.is_initialized() and fd.get_rank() == rank and fd.get_world_size() == size
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 9, (6,), generator=g).float()
    a, b = x.clone(), x.clone()
    fd.all_reduce(a)
    dist.all_reduce(b)
    assert torch.equal(a, b)
    a, b = x.clone(), x.clone()
    fd.broadcast(a, src=size - 1)
    dist.broadcast(b, src=size - 1)
    assert torch.equal(a, b)
    outs = [torch.empty(6) for _ in range(size)]
    refs = [torch.empty(6) for _ in range(size)]
    fd.all_gather(outs, x)
    dist.all_gather(refs, x)
    assert all(torch.equal(o, r) for o, r in zip(outs, refs, strict=False))
    out, ref = torch.empty(6 * size), torch.empty(6 * size)
    fd.all_gather_into_tensor(out, x)
    dist.all_gather_into_tensor(ref, x)
    assert torch.equal(out, ref)
    big = torch.randint(0, 9, (2 * size,), generator=g).float()
    out, ref = torch.empty(2), torch.empty(2)
    fd.reduce_scatter_tensor(out, big)
    dist.reduce_scatter_tensor(ref, big)
    assert torch.equal(out, ref)
    out, ref = torch.empty_like(big), torch.empty_like(big)
    w = fd.all_to_all_single(out, big, async_op=True)
    w.wait()
    dist.all_to_all_single(ref, big)
    assert torch.equal(out, ref)
    # p2p through batch_isend_irecv with torch's own P2POp objects
    send = torch.full((3,), float(rank))
    recv = torch.empty(3)
    ops = [
        dist.P2POp(dist.isend, send, (rank + 1) % size),
        dist.P2POp(dist.irecv, recv, (rank - 1) % size),
    ]
    for w in fd.batch_isend_irecv(ops):
        w.wait()
    assert torch.equal(recv, torch.full((3,), float((rank - 1) % size)))
    # groups: a sub-group with global ranks in arguments, non-members told so
    sub = fd.new_group([0, size - 1])
    if rank in (0, size - 1):
        t = torch.tensor([float(rank)])
        fd.broadcast(t, src=size - 1, group=sub)
        assert t.item() == size - 1
        assert fd.get_world_size(sub) == 2
        # a real torch ProcessGroup: torch's own functions take it
        assert isinstance(sub, dist.ProcessGroup)
        assert dist.get_rank(sub) == (0 if rank == 0 else 1) and dist.get_world_size(sub) == 2
        assert dist.get_process_group_ranks(sub) == [0, size - 1]
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub)
        assert t.item() == size - 1
    else:
        assert sub is fd.GroupMember.NON_GROUP_MEMBER
    part = fd.split_group(split_ranks=[[0, 1], list(range(2, size))])
    t = torch.tensor([1.0])
    fd.all_reduce(t, group=part)
    assert t.item() == (2 if rank < 2 else size - 2)
    fd.barrier()
    fd.destroy_process_group()
    assert not fd.is_initialized()


_STORE = []


def test_distwrap_matches_torch_distributed(world):
    world(_entry, 3)


def _entry(comm, rank, size):
    # distwrap builds its own communicators over the store torch.distributed already uses
    # (under another prefix); the fixture's communicator is not used here.
    _STORE.append(dist.distributed_c10d._get_default_store())
    distwrap_matches(comm, rank, size)


def _alone(rank, size, path, errq):
    """distwrap in a process with no torch.distributed group: its default group becomes torch's."""
    import traceback

    try:
        fd.init_process_group(
            "gloo", init_method=f"file://{path}", rank=rank, world_size=size, use_torchcomms=True
        )
        assert dist.is_initialized() and dist.get_rank() == rank and dist.get_world_size() == size
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)  # torch's function on fastcomms' default group
        assert torch.equal(t, torch.full((2,), float(size * (size + 1) // 2)))
        got = torch.zeros(2)
        ops = [
            dist.P2POp(dist.isend, t, (rank + 1) % size),
            dist.P2POp(dist.irecv, got, (rank - 1) % size),
        ]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert torch.equal(got, t)
        fd.destroy_process_group()
        assert not dist.is_initialized()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_distwrap_default_group_is_torchs():
    from conftest import spawn

    spawn(_alone, 3)


def _extras(rank, size, path, errq, use_torchcomms):
    """torchcomms' distwrap surface: use_torchcomms picks fastcomms or torch.distributed itself;
    torch's names; the object collectives with global ranks; utils."""
    import traceback

    from fastcomms.device_mesh import comm_of
    from fastcomms.distwrap import utils

    try:
        fd.init_process_group(
            "gloo",
            init_method=f"file://{path}",
            rank=rank,
            world_size=size,
            use_torchcomms=use_torchcomms,
        )
        world = utils.get_group(None)
        comm = utils.get_torchcomms_instance(world, "cpu")
        assert (comm is not None) == use_torchcomms, comm
        if comm is not None:
            assert comm is comm_of(world) and comm.get_size() == size
        assert fd.ReduceOp is dist.ReduceOp and fd.ProcessGroupGloo is dist.ProcessGroupGloo
        t = torch.full((3,), float(rank + 1))
        fd.all_reduce(t, fd.ReduceOp.SUM)
        assert torch.equal(t, torch.full((3,), float(size * (size + 1) // 2)))
        if use_torchcomms:  # torch's PREMUL_SUM (torch's gloo has none)
            t = torch.full((3,), float(rank + 1))
            fd.all_reduce(t, fd._make_nccl_premul_sum(2.0))
            assert torch.equal(t, torch.full((3,), float(size * (size + 1))))
        got = [None] * size
        fd.all_gather_object(got, {"rank": rank, "t": torch.tensor([rank])})
        assert [g["rank"] for g in got] == list(range(size))
        objs = [f"from {rank}", rank] if rank == size - 1 else [None, None]
        fd.broadcast_object_list(objs, src=size - 1)
        assert objs == [f"from {size - 1}", size - 1]
        gathered = [None] * size if rank == 1 else None
        fd.gather_object(rank * 10, gathered, dst=1)
        if rank == 1:
            assert gathered == [q * 10 for q in range(size)]
        out = [None]
        fd.scatter_object_list(out, [q + 100 for q in range(size)] if rank == 0 else None, src=0)
        assert out == [rank + 100]
        # a subgroup: the object collectives take global ranks there too
        sub = fd.new_group([1, 2])
        if rank in (1, 2):
            objs = ["x"] if rank == 2 else [None]
            fd.broadcast_object_list(objs, src=2, group=sub)
            assert objs == ["x"]
        fd.barrier()
        fd.destroy_process_group()
        assert not fd.is_initialized()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_distwrap_torchcomms_surface():
    import pytest
    from conftest import spawn

    for use in (True, False):
        try:
            spawn(_extras, 3, use)
        except pytest.fail.Exception as e:
            raise AssertionError(f"use_torchcomms={use}") from e
