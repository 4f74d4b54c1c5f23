# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""reconfigure() (torchcomms' fault-tolerance API, issue 14) on gloo, world 3: a communicator
made with enable_reconfigure=True has no ranks until reconfigure(uuid, init_handles); a list
gives rank = position, a set the sorted order; it shrinks (a rank left out) and grows back; every
misuse raises a clear error on the ranks that made it, and a disagreement on the handles raises on
every rank instead of hanging."""

import datetime
import os
import time
import traceback

import pytest
import torch
from conftest import _hang_guard, spawn

TIMEOUT = datetime.timedelta(seconds=30)


def _all_reduce_ok(comm, want_size):
    assert comm.get_size() == want_size
    t = torch.full((5,), float(comm.get_rank() + 1))
    comm.all_reduce(t, _sum(), False)
    assert torch.equal(t, torch.full((5,), float(sum(range(1, want_size + 1))))), t


def _sum():
    from fastcomms import ReduceOp

    return ReduceOp.SUM


def _handles(store, key, handle, size):
    store.set(f"{key}/{os.environ['TORCHCOMM_RANK']}", handle)
    return [store.get(f"{key}/{r}").decode() for r in range(size)]


def _worker(rank, size, path, errq):
    _hang_guard()
    try:
        import fastcomms
        import torch.distributed as dist

        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
        store = dist.FileStore(path, size)
        comm = fastcomms.new_comm("gloo", "cpu", "ft", store=store, enable_reconfigure=True)
        assert comm.get_options().enable_reconfigure
        with pytest.raises(RuntimeError, match="until reconfigure"):
            comm.get_rank()
        with pytest.raises(RuntimeError, match="until reconfigure"):
            comm.all_reduce(torch.zeros(2), _sum(), False)
        mine = comm.get_init_handle()
        assert mine == comm.get_init_handle() and mine.startswith("fastcomms:gloo:")
        hs = _handles(store, "h", mine, size)
        assert len(set(hs)) == size

        # misuse, caught on this rank before anything is exchanged
        with pytest.raises(RuntimeError, match="not among init_handles"):
            comm.reconfigure(0, [h for h in hs if h != mine], TIMEOUT)
        with pytest.raises(RuntimeError, match="twice"):
            comm.reconfigure(0, hs + [mine], TIMEOUT)
        with pytest.raises(RuntimeError, match="get_init_handle"):
            comm.reconfigure(0, hs + ["nccl:0:1:"], TIMEOUT)
        with pytest.raises(ValueError, match="non-negative"):
            comm.reconfigure(-1, hs, TIMEOUT)
        with pytest.raises(TypeError, match="uuid must be an int"):
            comm.reconfigure("0", hs, TIMEOUT)
        with pytest.raises(TypeError):
            comm.reconfigure(0, "not a list", TIMEOUT)

        # a list: rank = position (reversed here)
        order = list(reversed(hs))
        work = comm.reconfigure(uuid=0, init_handles=order, timeout=TIMEOUT)
        work.wait()
        assert work.is_completed()
        assert comm.get_rank() == order.index(mine) == size - 1 - rank
        _all_reduce_ok(comm, size)
        with pytest.raises(RuntimeError, match="used before"):
            comm.reconfigure(0, hs, TIMEOUT)
        # NOTE [communicator attachments]: the communicator's UlyssesGroup (its async lane and lend
        # ring) is released by each reconfigure and made anew over the next configuration
        g = comm._ulysses_group
        x = torch.arange(2 * size * 4, dtype=torch.float32).reshape(2, 1, size, 4)
        assert torch.equal(g.all_to_all_4d_async(x).wait(), g.all_to_all_4d(x))
        # hooks written in C++ (the flight recorder, the NaN check) move with every reconfigure
        from fastcomms.hooks import FlightRecorderHook, NanCheckHook

        fr, nan = FlightRecorderHook(max_entries=1000, isolated=True), NanCheckHook()
        fr.register_with_comm(comm)
        nan.register_with_comm(comm)
        n = fr.size()
        _all_reduce_ok(comm, size)
        assert fr.size() > n, "the flight recorder saw no call"

        # the handles disagree (rank 0 passes another order): every rank raises
        disagree = list(reversed(hs)) if rank == 0 else list(hs)
        with pytest.raises(RuntimeError, match="other init_handles"):
            comm.reconfigure(1, disagree, TIMEOUT)
        _all_reduce_ok(comm, size)  # the configuration before stays usable

        # shrink: the middle rank leaves; a set, so sorted order decides the ranks
        survivors = {h for h in hs if h != hs[1]}
        if rank != 1:
            comm.reconfigure(2, survivors, TIMEOUT).wait()
            assert comm.get_rank() == sorted(survivors).index(mine)
            _all_reduce_ok(comm, size - 1)
            assert g.transport == "destroyed" and comm._ulysses_group is not g
            y = comm._ulysses_group.all_to_all_4d_async(x[:, :, : size - 1]).wait()
            assert y.shape == (2, size - 1, 1, 4)
            b = torch.full((3,), float(rank))
            comm.broadcast(b, 0, False)
            assert torch.equal(b, torch.full((3,), float(hs.index(sorted(survivors)[0]))))
        # grow back: the left-out rank joins with a uuid it has not used
        comm.reconfigure(ropts(3, hs)).wait()
        assert comm.get_rank() == rank
        assert g.transport == "destroyed"
        want = x[:, :, rank : rank + 1].repeat(1, size, 1, 1)  # every rank sends the same x
        assert torch.equal(comm._ulysses_group.all_to_all_4d_async(x).wait(), want)
        n = fr.size()
        _all_reduce_ok(comm, size)
        assert fr.size() > n, "the flight recorder lost the communicator reconfigure made"
        with pytest.raises(ValueError, match="NaN detected in input tensor for 'all_reduce'"):
            comm.all_reduce(torch.full((2,), float("nan")), _sum(), False)
        fr.unregister()
        nan.unregister()
        n = fr.size()
        _all_reduce_ok(comm, size)
        assert fr.size() == n, "an unregistered recorder still records"

        # a listed rank that never comes: a timeout naming it, within the timeout
        ghost = f"fastcomms:gloo:nowhere:0:{rank}"
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match="did not join"):
            comm.reconfigure(4, [mine, ghost], datetime.timedelta(seconds=2))
        assert time.monotonic() - t0 < 10
        _all_reduce_ok(comm, size)
        comm.finalize()

        # a communicator made without enable_reconfigure refuses
        plain = fastcomms.new_comm("gloo", "cpu", "plain", store=dist.PrefixStore("p", store))
        assert plain.get_init_handle().startswith("fastcomms:gloo:")
        with pytest.raises(RuntimeError, match="enable_reconfigure"):
            plain.reconfigure(0, [plain.get_init_handle()])
        plain.finalize()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def ropts(uuid, handles):
    from fastcomms import ReconfigureOptions

    return ReconfigureOptions(uuid, handles, TIMEOUT)


def test_reconfigure_world3():
    spawn(_worker, 3, timeout=150)
