# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' "fake" backend (one rank, every op done at once, tensors untouched), the names
torchcomms' native module holds (fastcomms._comms), and copying a communicator (the same object
back, as torchcomms does). One process, no store."""

import copy

import pytest
import torch


def test_fake_backend_ops_hooks_and_copies():
    import fastcomms
    from fastcomms._comms import AllReducePreHookArgs, OpName, ReduceOp, RemovableHandle
    from fastcomms.hooks import FlightRecorderHook, NanCheckHook

    comm = fastcomms.new_comm("fake", torch.device("cpu"), "fake_test")
    assert (comm.get_rank(), comm.get_size(), comm.get_backend()) == (0, 1, "fake")
    seen = []
    handle = comm.register_pre_hook(lambda name, op_id, args: seen.append((name, args)))
    assert isinstance(handle, RemovableHandle)
    x = torch.arange(6.0)
    before = x.clone()
    work = comm.all_reduce(x, ReduceOp.SUM, True)
    work.wait()
    assert work.is_completed() and torch.equal(x, before)  # done at once, nothing moved
    out = torch.full((6,), -1.0)
    comm.all_gather_single(out, x, False)
    assert torch.equal(out, torch.full((6,), -1.0))
    batch = comm.batch_op_create()
    batch.send(x, 0)
    batch.recv(out, 0)
    batch.issue(False)
    comm.barrier(False)
    assert [n for n, _ in seen] == [
        OpName.all_reduce,
        OpName.all_gather_single,
        OpName.batch_op_issue,
        OpName.barrier,
    ]
    assert isinstance(seen[0][1], AllReducePreHookArgs) and seen[0][1].tensor is x
    handle.remove()
    # the hooks of fastcomms.hooks on it
    fr = FlightRecorderHook()
    fr.register_with_comm(comm)
    comm.broadcast(x, 0, False)
    assert fr.size() == 1
    nan = NanCheckHook()
    nan.register_with_comm(comm)
    bad = torch.tensor([1.0, float("nan")])
    with pytest.raises(RuntimeError, match="NaN"):
        comm.all_reduce(bad, ReduceOp.SUM, False)
    # a communicator is a handle: copies are the object itself
    assert copy.copy(comm) is comm
    memo = {}
    assert copy.deepcopy(comm, memo) is comm and memo[id(comm)] is comm
    holder = {"comm": comm, "t": torch.ones(1)}
    dup = copy.deepcopy(holder)
    assert dup["comm"] is comm and dup["t"] is not holder["t"]
    comm.finalize()


def test_package_surface_as_torchcomms():
    """What `import torchcomms` gives besides the classes: Timeout (a timedelta), the hooks and
    objcol modules as attributes, and functional's compile checks."""
    import datetime

    import fastcomms

    t = fastcomms.Timeout(seconds=3)
    assert isinstance(t, datetime.timedelta) and t == datetime.timedelta(seconds=3)
    comm = fastcomms.new_comm("fake", "cpu", "timeout_test", timeout=t)
    assert comm.get_options().timeout == datetime.timedelta(seconds=3)
    comm.finalize()
    assert fastcomms.hooks.FlightRecorderHook and fastcomms.objcol.all_gather_object
    import fastcomms.functional

    assert (
        fastcomms.functional.is_torch_compile_supported() is True
    )  # (NOTE [compiled communicator methods])
