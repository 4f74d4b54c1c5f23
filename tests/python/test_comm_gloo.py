# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The Python communicator on gloo against torch.distributed gloo, worlds of 2 and 3 processes."""

import datetime

import fastcomms
import pytest
import torch
import torch.distributed as dist
from fastcomms import ReduceOp

WORLDS = [2, 3]


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randint(-8, 8, shape, generator=g).to(dtype)  # exact in every float type
    return torch.randint(0, 50, shape, generator=g).to(dtype)


def collectives(comm, rank, size):
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        for async_op in (False, True):
            for op, dop in (
                (ReduceOp.SUM, dist.ReduceOp.SUM),
                (ReduceOp.MAX, dist.ReduceOp.MAX),
                (ReduceOp.MIN, dist.ReduceOp.MIN),
            ):
                x = _rand((5, 7), dtype, 100 + rank)
                ref = x.clone()
                w = comm.all_reduce(x, op, async_op)
                w.wait()
                assert w.is_completed() and w.status() == fastcomms.WorkStatus.COMPLETED
                dist.all_reduce(ref, op=dop)
                assert torch.equal(x, ref), (op, dtype)
            # broadcast / reduce from the last rank
            x = _rand((9,), dtype, 200 + rank)
            ref = x.clone()
            comm.broadcast(x, size - 1, async_op).wait()
            dist.broadcast(ref, size - 1)
            assert torch.equal(x, ref)
            # all_gather (list and single) and reduce_scatter
            x = _rand((4, 3), dtype, 300 + rank)
            outs = [torch.full_like(x, -99) for _ in range(size)]
            refs = [torch.empty_like(x) for _ in range(size)]
            comm.all_gather(outs, x, async_op).wait()
            dist.all_gather(refs, x)
            assert all(torch.equal(a, b) for a, b in zip(outs, refs, strict=False))
            single = torch.full((4 * size, 3), -99, dtype=dtype)
            comm.all_gather_single(single, x, async_op).wait()
            assert torch.equal(single, torch.cat(refs))
            inp = _rand((3 * size,), dtype, 400 + rank)
            out = torch.full((3,), -99, dtype=dtype)
            comm.reduce_scatter_single(out, inp, ReduceOp.SUM, async_op).wait()
            ref = torch.empty(3, dtype=dtype)
            dist.reduce_scatter_tensor(ref, inp) if dtype != torch.bfloat16 else None
            if dtype != torch.bfloat16:
                assert torch.equal(out, ref)
            # all_to_all_single, even and uneven
            inp = _rand((2 * size, 3), dtype, 500 + rank)
            out = torch.full_like(inp, -99)
            ref = torch.empty_like(inp)
            comm.all_to_all_single(out, inp, async_op).wait()
            dist.all_to_all_single(ref, inp)
            assert torch.equal(out, ref)
            in_splits = [(rank + q) % 3 for q in range(size)]
            out_splits = [(p + rank) % 3 for p in range(size)]
            inp = _rand((sum(in_splits), 2), dtype, 600 + rank)
            out = torch.full((sum(out_splits), 2), -99, dtype=dtype)
            ref = torch.empty_like(out)
            comm.all_to_all_v_single(out, inp, out_splits, in_splits, async_op).wait()
            dist.all_to_all_single(ref, inp, out_splits, in_splits)
            assert torch.equal(out, ref)
            # scatter / gather from rank 0
            x = torch.full((6,), -99, dtype=dtype)
            ins = [_rand((6,), dtype, 700 + q) for q in range(size)] if rank == 0 else []
            comm.scatter(x, ins, 0, async_op).wait()
            assert torch.equal(x, _rand((6,), dtype, 700 + rank))
            outs = [torch.full((6,), -99, dtype=dtype) for _ in range(size)] if rank == 0 else []
            comm.gather(outs, x, 0, async_op).wait()
            if rank == 0:
                assert all(torch.equal(outs[q], _rand((6,), dtype, 700 + q)) for q in range(size))
            comm.barrier(async_op).wait()


def point_to_point_and_reductions(comm, rank, size):
    # ring with a batch
    send = _rand((11,), torch.float32, rank)
    recv = torch.full((11,), -99.0)
    batch = comm.batch_op_create()
    batch.send(send, (rank + 1) % size).recv(recv, (rank - 1) % size)
    batch.issue(False).wait()
    # torchcomms' spelling: P2POp(P2POpType, ...), BatchP2POptions, positional hints/timeout
    opts = fastcomms.BatchP2POptions()
    opts.timeout = datetime.timedelta(seconds=30)
    b2 = comm.batch_op_create()
    b2.send(send, (rank + 1) % size)
    b2.recv(recv, (rank - 1) % size)
    assert [op.type for op in b2.ops] == [fastcomms.P2POpType.SEND, fastcomms.P2POpType.RECV]
    w = b2.issue(True, opts)
    w.wait_blocking()
    assert w.is_completed() and comm.is_abort_supported()
    x = torch.ones(2)
    comm.all_reduce(x, ReduceOp.SUM, False, {"k": "v"}, datetime.timedelta(seconds=30))
    assert torch.equal(recv, _rand((11,), torch.float32, (rank - 1) % size))
    # AVG and PREMUL_SUM (torch's gloo has neither): against the arithmetic
    x = torch.full((4,), float(size * (rank + 1)))
    comm.all_reduce(x, ReduceOp.AVG, False)
    assert torch.equal(x, torch.full((4,), float(sum(q + 1 for q in range(size)))))
    x = torch.full((4,), float(rank))
    comm.all_reduce(x, ReduceOp.PREMUL_SUM(2.0), False)
    assert torch.equal(x, torch.full((4,), 2.0 * sum(range(size))))
    assert ReduceOp.PREMUL_SUM(2.0).type == fastcomms.RedOpType.PREMUL_SUM
    # bitwise on integers
    x = torch.tensor([1 << rank], dtype=torch.int32)
    comm.all_reduce(x, ReduceOp.BOR, False)
    assert x.item() == (1 << size) - 1


def hooks_split_and_errors(comm, rank, size):
    seen, done = [], []
    h = comm.register_pre_hook(lambda name, op_id, args: seen.append((name, op_id, args)))
    p = comm.register_post_hook(lambda op_id, args: done.append((op_id, args)))
    comm.barrier(False)
    x = torch.ones(3)
    comm.all_reduce(x, ReduceOp.SUM, False)
    h.remove()
    p.remove()
    comm.barrier(False)
    assert [n for n, _, _ in seen] == [fastcomms.OpName.barrier, fastcomms.OpName.all_reduce]
    assert isinstance(seen[0][2], fastcomms.BarrierPreHookArgs) and seen[0][2].async_op is False
    assert isinstance(seen[1][2], fastcomms.AllReducePreHookArgs) and seen[1][2].tensor is x
    assert [i for i, _ in done] == [i for _, i, _ in seen]  # post-hooks share the op ids
    assert all(isinstance(a, fastcomms.CollectivePostHookArgs) for _, a in done)
    # each operation's own post-hook class (torchcomms'), and the reduction's op in its pre args
    assert [type(a) for _, a in done] == [
        fastcomms.BarrierPostHookArgs,
        fastcomms.AllReducePostHookArgs,
    ]
    assert seen[1][2].op.type == fastcomms.RedOpType.SUM
    sub = comm.split(list(reversed(range(size))), "rev")
    assert sub is not None and sub.get_rank() == size - 1 - rank and sub.get_size() == size
    x = torch.tensor([float(rank)])
    sub.all_reduce(x, ReduceOp.SUM, False)
    assert x.item() == sum(range(size))
    solo = comm.split([0] if rank == 0 else [], "solo")  # [] joins none
    assert (solo is None) == (rank != 0)
    # a colour split: each rank names the group it joins, lists differ across groups
    pairs = comm.split([r for r in range(size) if r % 2 == rank % 2], "parity")
    assert pairs.get_size() == len(range(rank % 2, size, 2))
    y = torch.tensor([float(rank)])
    pairs.all_reduce(y, ReduceOp.SUM, False)
    assert y.item() == sum(range(rank % 2, size, 2))
    with pytest.raises(ValueError, match="does not contain this rank; pass"):
        comm.split([q for q in range(size) if q != rank], "without me")
    after = comm.split(list(range(size)), "after")  # the counter stayed aligned
    assert after.get_size() == size
    with pytest.raises(ValueError, match=r"\[rank \d/\d t send\] dst must be in \[0, \d\), got 99"):
        comm.send(torch.zeros(2), 99, False)
    with pytest.raises(TypeError, match="BAND needs an integer or bool tensor, got float32"):
        comm.all_reduce(torch.zeros(2), ReduceOp.BAND, False)
    with pytest.raises(TypeError, match="PREMUL_SUM needs a floating-point tensor, got int32"):
        comm.all_reduce(torch.zeros(2, dtype=torch.int32), ReduceOp.PREMUL_SUM(2.0), False)
    with pytest.raises(ValueError, match="must be contiguous"):
        comm.all_reduce(torch.zeros(4, 4).t(), ReduceOp.SUM, False)
    with pytest.raises(fastcomms.UnsupportedError, match="backend .gloo. has no windows"):
        comm.new_window()
    with pytest.raises(fastcomms.UnsupportedError, match="backend 'gloo' has no window memory"):
        comm.get_mem_allocator()
    with pytest.raises(RuntimeError, match="tensor_register is not implemented by backend 'gloo'"):
        comm.tensor_register(torch.zeros(4))
    assert comm.get_backend() == "gloo" and "gloo" in fastcomms.built_backends()
    assert comm.get_options().timeout == datetime.timedelta(seconds=60)


def timeout_raises(comm, rank, size):
    # rank 0 waits for a peer that never arrives: TimeoutError, not a hang
    if rank == 0:
        with pytest.raises(TimeoutError):
            comm.all_reduce(
                torch.zeros(3), ReduceOp.SUM, False, timeout=datetime.timedelta(milliseconds=500)
            )
    dist.barrier()  # keep every rank alive until rank 0 is done


@pytest.mark.parametrize("size", WORLDS)
def test_collectives_match_torch_distributed(world, size):
    world(collectives, size)


@pytest.mark.parametrize("size", WORLDS)
def test_point_to_point_and_reductions(world, size):
    world(point_to_point_and_reductions, size)


@pytest.mark.parametrize("size", WORLDS)
def test_hooks_split_and_errors(world, size):
    world(hooks_split_and_errors, size)


def test_timeout_raises_timeout_error(world):
    world(timeout_raises, 2)


def test_import_as_torchcomms():
    import fastcomms as torchcomms

    for name in (
        "new_comm",
        "TorchComm",
        "TorchWork",
        "WorkStatus",
        "ReduceOp",
        "RedOpType",
        "CommOptions",
        "TorchCommWindow",
        "BatchSendRecv",
        "P2POp",
        "RemovableHandle",
        "register_backend",
        "TorchCommBackend",
        "is_backend_built",
        "built_backends",
    ):
        assert hasattr(torchcomms, name), name
    assert torchcomms.is_backend_built("gloo")
    assert repr(torchcomms.ReduceOp.SUM) == "ReduceOp.SUM"


def test_a_communicator_and_a_ulysses_group_do_not_import_dynamo(tmp_path):
    """A process that never compiles does not pay for importing torch._dynamo (about 2 s of CPU,
    once paid by the first new_comm): the eager-only members' Dynamo wrapper imports it at its
    first call (NOTE [eager-only members])."""
    import subprocess
    import sys

    code = f"""
import os, sys
import torch.distributed as dist
import fastcomms
from fastcomms.ulysses import UlyssesGroup
os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = "0", "1"
comm = fastcomms.new_comm("gloo", "cpu", store=dist.FileStore({str(tmp_path / "s")!r}, 1), name="d")
g = UlyssesGroup(comm)
x = __import__("torch").randn(1, 4, 2, 3)
assert __import__("torch").equal(g.all_to_all_4d(x), x)
comm.finalize()
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "no dynamo", (r.stdout, r.stderr[-2000:])
