# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Mismatched calls caught with the defaults (issue 39; NOTE [call check modes], NOTE [fingerprint
tags], NOTE [mismatch probe], NOTE [point-to-point header] in backends/gloo/gloo_backend.cpp), on
gloo at 2 and 3 ranks. Rank 0's call differs from the others'. Collectives: every rank whose call
cannot complete raises the mismatch naming both calls within a second or two (the communicator's
timeout is 30 s), every later call raises the same (the communicator is broken), and no byte
crosses between mismatched calls (an in-place buffer of the rank that differs keeps its input); a
rank whose rooted call completed with the root agreeing has the right data and its next call
raises. Point-to-point: the receiving rank raises naming both sides,
its buffer poisoned and untouched, the sender completes, the communicator stays usable. The
controls (FASTCOMMS_CHECK_CALLS=0) return the wrong data."""

import datetime
import os
import time
import traceback

import pytest
import torch
from conftest import _hang_guard, init_rank, spawn
from fastcomms import ReduceOp

TIMEOUT = datetime.timedelta(seconds=30)


def _collective_cases(rank, size):
    """name -> fn(comm) issuing a collective in which rank 0 differs from the others."""
    n = 1000 if rank == 0 else 999
    root = 0 if rank == 0 else 1  # rank 0 believes in root 0, the others in root 1
    sevens = torch.full((8,), 7.0)
    dt = torch.float32 if rank == 0 else torch.int32
    return {
        "size": lambda c: c.all_reduce(torch.full((n,), 7.0), ReduceOp.SUM, False),
        "dtype": lambda c: c.all_reduce(torch.full((8,), 7, dtype=dt), ReduceOp.SUM, False),
        "reduce op": lambda c: c.all_reduce(
            sevens, ReduceOp.MAX if rank == 0 else ReduceOp.SUM, False
        ),
        "root": lambda c: c.broadcast(sevens, root, False),
        "shorter broadcast": lambda c: c.broadcast(torch.full((n,), 7.0), 0, False),
        "another collective": lambda c: (
            c.all_reduce(sevens, ReduceOp.SUM, False)
            if rank == 0
            else c.broadcast(sevens, 0, False)
        ),
        "all_gather size": lambda c: c.all_gather_single(
            torch.empty(n * size), torch.ones(n), False
        ),
        "all_to_all_single size": lambda c: c.all_to_all_single(
            torch.empty(n * size), torch.ones(n * size), False
        ),
        "gather root": lambda c: c.gather(
            [torch.empty(8) for _ in range(size)] if rank == root else [],
            torch.ones(8),
            root,
            False,
        ),
        # sizes per peer: the strict check runs for them under the default (before data moves)
        "all_to_all_v_single per-peer size": lambda c: c.all_to_all_v_single(
            torch.empty(2 * size),
            torch.ones(2 * size + (1 if rank == 0 else 0)),
            [2] * size,
            [3 if (rank == 0 and q == 1) else 2 for q in range(size)],
            False,
        ),
    }


ROOTED = {"root", "shorter broadcast", "gather root", "another collective"}


def _rank(rank, size, path, errq, body, check_calls, *args):
    """A spawned rank: FASTCOMMS_CHECK_CALLS (None: unset, the default), torch's gloo group on the
    test's store, then body(rank, size, comm, *args) with comm(name) making a fastcomms gloo
    communicator under its own prefix; the traceback goes to the parent."""
    _hang_guard()
    import fastcomms
    import torch.distributed as dist

    try:
        if check_calls is None:
            os.environ.pop("FASTCOMMS_CHECK_CALLS", None)
        else:
            os.environ["FASTCOMMS_CHECK_CALLS"] = check_calls
        base = init_rank(rank, size, path)

        def comm(name):
            store = dist.PrefixStore(name, base)
            return fastcomms.new_comm("gloo", "cpu", name, store=store, timeout=TIMEOUT)

        body(rank, size, comm, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _collectives(rank, size, comm):
    for i, (name, fn) in enumerate(_collective_cases(rank, size).items()):
        c = comm(f"case{i}")
        t0 = time.monotonic()
        try:
            fn(c)
            raised = None
        except ValueError as e:
            raised = str(e)
        took = time.monotonic() - t0
        if raised is None:
            # only a rank whose rooted call agreed with its root may complete; its next call
            # finds the communicator broken
            assert name in ROOTED and rank != 0, f"rank {rank} {name}: no error"
            with pytest.raises(RuntimeError):
                c.barrier(False)
        else:
            assert took < 10, f"rank {rank} {name}: raised after {took:.1f} s: {raised}"
            assert raised.startswith(f"[rank {rank}/{size} case{i} "), raised
            if "per-peer" in name:
                assert "ranks disagree on the per-peer sizes" in raised, raised
            else:
                assert "ranks issued different collectives: this rank called" in raised
                assert "rank 0 called" in raised or rank == 0, raised
                with pytest.raises(ValueError, match="ranks issued different collectives"):
                    c.barrier(False)  # every later call says why the communicator is broken
        c.abort()


@pytest.mark.parametrize("size", [2, 3])
def test_default_catches_mismatched_collectives(size):
    spawn(_rank, size, _collectives, None, timeout=300)


def _in_place_untouched(rank, size, comm):
    """The three in-place all_reduce mismatches: no byte crosses between mismatched calls."""
    for i, (dt, op, n) in enumerate(
        [
            (torch.float32, ReduceOp.SUM, 100 if rank == 0 else 99),
            (torch.float32 if rank == 0 else torch.int32, ReduceOp.SUM, 64),
            (torch.float32, ReduceOp.MAX if rank == 0 else ReduceOp.SUM, 64),
        ]
    ):
        c = comm(f"ip{i}")
        t = torch.arange(n).to(dt) * (rank + 2)
        want = t.clone()
        with pytest.raises(ValueError, match="ranks issued different collectives"):
            c.all_reduce(t, op, False)
        # no byte crosses between mismatched calls: rank 0's buffer keeps its input (at 3 ranks
        # the two agreeing ranks exchange among themselves before they wait, so theirs may hold
        # partial sums; they raise all the same)
        if rank == 0 or size == 2:
            assert torch.equal(t, want), f"rank {rank} case {i}: the buffer changed"
        c.abort()


@pytest.mark.parametrize("size", [2, 3])
def test_default_mismatch_moves_no_byte(size):
    spawn(_rank, size, _in_place_untouched, None, timeout=300)


def _p2p(rank, size, comm, batched):
    """A ring: rank 0 sends float32 to rank 1, which receives int32 (dtype); rank 1 sends 4
    elements to rank 2 (or rank 0 at size 2), which expects 8 (size); at size 3, rank 2 sends
    rank 0 what it expects."""
    c = comm("p2p")
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    send = torch.ones(8) if rank == 2 else torch.arange(4.0) + 1
    if rank == 1:
        recv = torch.full((4,), -5, dtype=torch.int32)  # rank 0 sent float32
    else:
        recv = torch.full((8,), -5.0)  # rank 1 sent 4 elements; rank 2 sends 8
    poisoned = recv.clone()
    mismatched = rank in (1, 2 % size)  # the receivers of rank 0's and of rank 1's send
    error = None

    def receive():
        try:
            c.recv(recv, prv, False)
        except ValueError as e:
            return str(e)
        return None

    if batched:
        b = c.batch_op_create()
        b.send(send, nxt)
        b.recv(recv, prv)
        try:
            b.issue(False)
        except ValueError as e:
            error = str(e)
    elif rank % 2 == 0:
        c.send(send, nxt, False)
        error = receive()
    else:
        error = receive()
        c.send(send, nxt, False)
    if mismatched:
        assert error is not None, f"rank {rank}: no error, got {recv.tolist()}"
        assert error.startswith(f"[rank {rank}/{size} p2p "), error
        assert f"point-to-point mismatch: rank {prv}'s send #0" in error, error
        assert torch.equal(recv, poisoned), f"rank {rank}: the buffer changed: {recv}"
    else:
        assert error is None, error
        assert torch.equal(recv, torch.ones(8)), recv
    # the communicator goes on
    t = torch.full((4,), float(rank + 1))
    c.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.full((4,), float(size * (size + 1) // 2))), t
    c.finalize()


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("batched", [False, True])
def test_default_catches_mismatched_point_to_point(size, batched):
    spawn(_rank, size, _p2p, None, batched, timeout=300)


def _p2p_unchecked(rank, size, comm):
    c = comm("p2p0")
    if rank == 0:
        c.send(torch.ones(4), 1, False)
        c.send(torch.ones(4), 1, False)
    else:
        t = torch.full((4,), -5, dtype=torch.int32)
        c.recv(t, 0, False)
        assert t.tolist() == [1065353216] * 4, t  # float32 1.0 read as int32
        big = torch.full((8,), -5.0)
        c.recv(big, 0, False)
        assert big.tolist() == [1.0] * 4 + [-5.0] * 4, big  # the tail left as it was
    c.finalize()


def test_control_point_to_point_unchecked_is_wrong():
    """FASTCOMMS_CHECK_CALLS=0: the int32 receive of a float32 send returns the bits."""
    spawn(_rank, 2, _p2p_unchecked, "0", timeout=300)
