# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' modules on gloo: fastcomms.objcol (the object collectives, worlds of 2 and 3,
against the objects each rank can compute for every rank) and fastcomms.hooks (the flight
recorder's ring and the NaN check)."""

import pickle

import pytest
import torch
from fastcomms import objcol


class _Custom:  # a class: loading it runs code, so weights_only refuses it
    def __init__(self, v):
        self.v = v


def _obj(q, step):
    return {"rank": q, "step": step, "name": "r" * (q + 1), "t": torch.arange(q + step + 1)}


def _same(a, b):
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )


def objects(comm, rank, size):
    got = [None] * size
    objcol.all_gather_object(comm, got, _obj(rank, 1))
    assert all(_same(got[q], _obj(q, 1)) for q in range(size))
    root = size - 1
    gathered = [None] * size if rank == root else None
    objcol.gather_object(comm, _obj(rank, 2), root, gathered)
    if rank == root:
        assert all(_same(gathered[q], _obj(q, 2)) for q in range(size))
    lst = [_obj(root, 3), "x", 7] if rank == root else [None, None, None]
    objcol.broadcast_object_list(comm, lst, root)
    assert _same(lst[0], _obj(root, 3)) and lst[1:] == ["x", 7]
    out = [None]
    objcol.scatter_object_list(
        comm, 0, out, [_obj(q, 4) for q in range(size)] if rank == 0 else None
    )
    assert _same(out[0], _obj(rank, 4))
    if rank == 0:
        objcol.send_object_list(comm, [_obj(0, 5), [1, 2]], 1)
    elif rank == 1:
        recv = [None, None]
        objcol.recv_object_list(comm, recv, 0)
        assert _same(recv[0], _obj(0, 5)) and recv[1] == [1, 2]
    # weights_only (the default) refuses a pickled class; weights_only=False loads it
    got = [None] * size
    with pytest.raises(pickle.UnpicklingError):
        objcol.all_gather_object(comm, got, _Custom(rank))
    objcol.all_gather_object(comm, got, _Custom(rank), weights_only=False)
    assert [g.v for g in got] == list(range(size))


@pytest.mark.parametrize("size", [2, 3])
def test_object_collectives(world, size):
    world(objects, size)


def hooks_module(comm, rank, size):
    import json

    from fastcomms import ReduceOp
    from fastcomms.hooks import FlightRecorderHook, NanCheckHook

    fr = FlightRecorderHook(max_entries=4)
    fr.register_with_comm(comm)
    assert fr.is_enabled()
    for i in range(6):
        comm.all_reduce(torch.ones(3 + i), ReduceOp.SUM, False)
    comm.barrier(True).wait()
    trace = json.loads(fr.dump_json())
    entries = trace["entries"]
    assert trace["version"] == "2.10" and trace["rank"] == rank
    assert (
        trace["pg_config"][comm.get_name()]["ranks"]
        == "[" + ",".join(str(r) for r in range(size)) + "]"
    )
    assert fr.size() == 7 and len(fr) == 7  # recorded since reset (torchcomms count)
    assert len(entries) == 4  # the ring keeps the last max_entries
    assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce"] * 3 + ["gloo:barrier"]
    assert [e["collective_seq_id"] for e in entries] == [4, 5, 6, 7]
    assert entries[-2]["input_sizes"] == [[8]] and entries[-2]["output_sizes"] == [[8]]
    assert entries[-2]["input_dtypes"] == ["Float"] and not entries[-2]["is_p2p"]
    ids = [e["op_id"] for e in entries]
    assert ids == list(range(ids[0], ids[0] + 4)), ids  # one sequence, no gaps
    assert all(e["state"] == "completed" and e["retired"] for e in entries), entries
    # torch's analyzer reads the trace
    import argparse

    from torch.distributed.flight_recorder.components.builder import build_db

    db = build_db(
        {f"rank_{rank}": trace},
        argparse.Namespace(
            verbose=False, just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=10
        ),
        "2.10",
    )
    assert db.groups and db.memberships
    # a split is recorded, and the communicator it makes is recorded from then on
    child = comm.split(list(range(size)), "fr_child")
    child.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    seen = [
        (e["process_group"][0], e["profiling_name"]) for e in json.loads(fr.dump_json())["entries"]
    ]
    assert (comm.get_name(), "gloo:split") in seen and ("fr_child", "gloo:all_reduce") in seen, seen
    child.finalize()
    fr.unregister()
    nan = NanCheckHook()
    nan.register_with_comm(comm)
    bad = torch.ones(4)
    bad[2] = float("nan")
    with pytest.raises(RuntimeError, match="NaN detected in input tensor for .all_reduce."):
        comm.all_reduce(bad, ReduceOp.SUM, False)  # raised on every rank before anything moved
    ok = torch.ones(4)
    comm.all_reduce(ok, ReduceOp.SUM, False)
    assert torch.equal(ok, torch.full((4,), float(size)))
    nan.unregister()

    # states read from the async ops' works; a dump when an op times out (sync or on wait)
    import datetime
    import os
    import tempfile

    fr = FlightRecorderHook()
    fr.register_with_comm(comm)
    held = comm.all_reduce(torch.ones(5), ReduceOp.SUM, True)
    held.wait()
    assert json.loads(fr.dump_json())["entries"][-1]["state"] == "completed"
    assert json.loads(fr.dump_json(include_completed=False))["entries"] == []
    # rank 0 alone next: its ops time out. A timeout ends gloo's pairs, so the communicator cannot
    # tell the other ranks when rank 0 is done: a file named for the test run (the ranks share
    # their parent) does, and they stay until then (a rank that left early would turn rank 0's
    # timeouts into "connection closed" errors)
    done = os.path.join(tempfile.gettempdir(), f"fastcomms_fr_done_{os.getppid()}")
    if rank == 0 and os.path.exists(done):
        os.remove(done)  # a leftover of an earlier run in the same parent
    comm.barrier(False)
    if rank != 0:
        import time

        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
        return
    prefix = os.path.join(tempfile.mkdtemp(), "fr_")
    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = prefix
    one_s = datetime.timedelta(seconds=1)
    w = comm.all_reduce(torch.ones(6), ReduceOp.SUM, True, timeout=one_s)
    with pytest.raises(TimeoutError):
        w.wait()
    import pickle

    with open(prefix + "0", "rb") as f:  # pickled, as torch's flight recorder writes
        last = pickle.load(f)["entries"][-1]
    assert last["profiling_name"] == "gloo:all_reduce" and last["state"] == "started", last
    assert not last["retired"] and last["input_sizes"] == [[6]]
    os.remove(prefix + "0")
    with pytest.raises(TimeoutError):
        comm.broadcast(torch.ones(7), 1, False, timeout=one_s)
    with open(prefix + "0", "rb") as f:
        entries = pickle.load(f)["entries"]
    assert entries[-1]["profiling_name"] == "gloo:broadcast", entries[-1]
    assert entries[-1]["state"] == "scheduled"  # it never got past its start
    unfinished = json.loads(fr.dump_json(include_completed=False))["entries"]
    names = [e["profiling_name"] for e in unfinished]
    assert names == ["gloo:all_reduce", "gloo:broadcast"], unfinished
    # torchcomms' dynamic file name: the variable is the whole path, read at each dump
    os.environ["TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME"] = "1"
    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = prefix + "whole"
    assert fr.dump_file(rank) == prefix + "whole" and os.path.exists(prefix + "whole")
    del os.environ["TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME"]
    open(done, "w").close()  # the other ranks may go
    fr.unregister()


def test_flight_recorder_and_nan_check(world):
    world(hooks_module, 2)


def _monitored_worker(rank, size, path, errq):
    """monitored_barrier (on the communicator and through its process group): all ranks pass;
    a rank that never arrives is named by rank 0 (all of them with wait_all_ranks, the lowest
    without) within the timeout, and the other ranks raise instead of hanging."""
    import datetime
    import time
    import traceback

    from conftest import _hang_guard, init_rank

    _hang_guard()
    try:
        import fastcomms
        import torch.distributed as dist
        from fastcomms.device_mesh import _create_torchcomm_process_group

        store = init_rank(rank, size, path)

        def comm(name):
            return fastcomms.new_comm(
                "gloo",
                "cpu",
                name,
                store=dist.PrefixStore(name, store),
                timeout=datetime.timedelta(seconds=60),
            )

        c = comm("mb_ok")
        pg = _create_torchcomm_process_group(c, "mb_ok")
        pg.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
        c.monitored_barrier()  # the communicator's timeout
        assert isinstance(c.get_backend_impl(), fastcomms._C.Comm)
        import warnings

        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert c.unsafe_get_backend() is c.get_backend_impl()
        assert any(issubclass(x.category, DeprecationWarning) for x in w)
        with pytest.raises(ValueError, match="monitored_barrier. timeout must be positive"):
            c.monitored_barrier(datetime.timedelta(0))
        c.finalize()
        one = datetime.timedelta(seconds=1)
        for wait_all in (True, False):
            name = f"mb_late_{int(wait_all)}"
            c = comm(name)
            t0 = time.monotonic()
            if rank == 0:
                with pytest.raises(RuntimeError, match="monitoredBarrier") as e:
                    c.monitored_barrier(one, wait_all_ranks=wait_all)
                late = list(range(1 if size == 2 else 2, size))  # the ranks that never arrive
                want = (
                    f"Ranks {', '.join(map(str, late))} failed"
                    if wait_all
                    else f"Rank {late[0]} failed"
                )
                assert want in str(e.value), str(e.value)
            elif rank == 1 and size > 2:  # arrives, and is never released
                with pytest.raises(RuntimeError, match="did not release monitoredBarrier"):
                    c.monitored_barrier(one, wait_all_ranks=wait_all)
            else:  # never arrives
                time.sleep(2.5)
            assert time.monotonic() - t0 < 10
            store.set(f"{name}/done/{rank}", "1")
            store.wait([f"{name}/done/{q}" for q in range(size)])
            c.finalize()
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("size", [2, 3])
def test_monitored_barrier(size):
    from conftest import spawn

    spawn(_monitored_worker, size, timeout=120)


def test_extension_errors_are_runtime_errors_too():
    """torchcomms raises RuntimeError for bad arguments; ours are ValueError (TypeError,
    TimeoutError) and RuntimeError at once."""
    from fastcomms import _C

    with pytest.raises(ValueError, match="not divisible by world_size=2") as e:
        _C.ulysses_geometry([1, 4, 5, 8], 2, 0, None, None, 0, 2, 1)
    assert isinstance(e.value, RuntimeError)
    assert issubclass(_C.TypeError, TypeError) and issubclass(_C.TypeError, RuntimeError)
    assert issubclass(_C.TimeoutError, TimeoutError) and issubclass(_C.TimeoutError, RuntimeError)


def _storeless_worker(rank, size, path, errq, port):
    """Communicators made without a store (MASTER_ADDR/MASTER_PORT): several alive at once, and
    one after another where rank 0 drops the previous one late (so that another rank reaches the
    port while rank 0's old server still serves it)."""
    import datetime
    import os
    import time
    import traceback

    from conftest import _hang_guard

    _hang_guard()
    try:
        import fastcomms
        from fastcomms import ReduceOp

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
        t = datetime.timedelta(seconds=30)
        a = fastcomms.new_comm("gloo", "cpu", "a", timeout=t)
        b = fastcomms.new_comm("gloo", "cpu", "b", timeout=t)  # the same port, both alive
        for c in (a, b):
            x = torch.ones(3)
            c.all_reduce(x, ReduceOp.SUM, False)
            assert torch.equal(x, torch.full((3,), float(size)))
        a.finalize()
        b.finalize()
        del a, b
        for i in range(3):
            c = fastcomms.new_comm("gloo", "cpu", f"seq{i}", timeout=t)
            x = torch.full((2,), float(rank))
            c.all_reduce(x, ReduceOp.SUM, False)
            assert torch.equal(x, torch.full((2,), float(sum(range(size)))))
            c.finalize()
            if rank == 0:
                time.sleep(0.5)  # the others go on to the next communicator first
            del c
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("size", [2, 3])
def test_storeless_communicators_share_the_port(size):
    from conftest import free_port, spawn

    spawn(_storeless_worker, size, free_port(), timeout=120)


def test_cuda_device_without_index_follows_the_rank(monkeypatch):
    """torchcomms' CUDA backends resolve `cuda` without an index to cuda:(rank % device count),
    so every rank of a node takes its own GPU without a set_device call; where no rank is known
    yet, the current device."""
    import torch
    from fastcomms._comm import _indexed

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert _indexed(torch.device("cuda")) == torch.device("cuda", 1)
    assert _indexed(torch.device("cuda", 3)) == torch.device("cuda", 3)
    assert _indexed(torch.device("cpu")) == torch.device("cpu")
    for name in ("RANK", "WORLD_SIZE", "TORCHCOMM_RANK", "TORCHCOMM_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert _indexed(torch.device("cuda")) == torch.device("cuda", 2)


def clog_lines(comm, rank, size):
    """fastcomms.hooks.clog (NOTE [clog]): the file holds torchcomms' clog format, line for line,
    for calls of several kinds, sync and async, a repeated signature (one sig line, one Q per
    call with increasing work ids), the lifecycle events, a split, the buffers' addresses when
    asked, only Q lines with events=["NONE"]; bad arguments raise."""
    import os
    import re
    import tempfile

    from fastcomms import ReduceOp
    from fastcomms.hooks import clog

    d = tempfile.mkdtemp()
    path, quiet_path = os.path.join(d, "clog.log"), os.path.join(d, "quiet.log")
    log, quiet = clog(path, ["ALL"], verbose=["buffers"]), clog(quiet_path, ["NONE"])
    log.register_with_comm(comm)
    quiet.register_with_comm(comm)
    name, n = comm.get_name(), 3 + size
    x = torch.randn(n)
    comm.all_reduce(x, ReduceOp.SUM, False)
    comm.all_reduce(x, ReduceOp.SUM, False)  # the same signature
    y = torch.zeros(4 * size, dtype=torch.float16)
    w = comm.all_reduce(y, ReduceOp.MAX, True)
    w.wait()
    comm.broadcast(torch.ones(5, dtype=torch.int32), size - 1, False)
    out = torch.empty(size * 2, dtype=torch.bfloat16)
    comm.all_gather_single(out, torch.ones(2, dtype=torch.bfloat16), False)
    comm.reduce_scatter_single(torch.empty(3), torch.ones(3 * size), ReduceOp.AVG, False)
    comm.barrier(False)
    sub = comm.split(list(range(size)), "sub")
    lines = open(path).read().splitlines()
    assert re.fullmatch(r"V\|1\|base_timestamp=\d+\.\d{3}", lines[0]), lines[0]
    assert lines[1] == f"new_comm|comm={name}|rank={rank}|world_size={size}", lines[1]
    sigs = {
        int(m.group(1)): m.group(2)
        for m in map(re.compile(r"C(\d+)\|sig\|(.*)").fullmatch, lines)
        if m
    }
    px = f"{x.data_ptr():#x}"
    expect = [
        f"all_reduce|in_count={n}|out_count={n}|dtype=f32|red_op=sum|async_op=f|buf={px}|comm={name}",
        f"all_reduce|in_count={4 * size}|out_count={4 * size}|dtype=f16|red_op=max|async_op=t"
        f"|buf={y.data_ptr():#x}|comm={name}",
    ]
    assert sigs[1] == expect[0] and sigs[2] == expect[1], sigs
    assert sigs[3].startswith("broadcast|in_count=5|out_count=5|dtype=i32|root=") and sigs[
        3
    ].endswith(f"|comm={name}")
    assert sigs[4].startswith(
        f"all_gather_single|in_count=2|out_count={2 * size}|dtype=bf16|async_op=f|in=0x"
    ), sigs[4]
    assert sigs[5].startswith(
        f"reduce_scatter_single|in_count={3 * size}|out_count=3|dtype=f32|red_op=avg|async_op=f|"
    ), sigs[5]
    assert sigs[6] == f"barrier|async_op=f|comm={name}", sigs[6]
    events = [ln for ln in lines if re.match(r"C\d+\|[QSEW]\|", ln)]
    kinds = [(int(ln[1 : ln.index("|")]), ln.split("|")[1]) for ln in events]
    # sync calls: Q S E; the async call: Q, S once issued, then E and W at its wait
    assert kinds[:9] == [
        (1, "Q"),
        (1, "S"),
        (1, "E"),
        (1, "Q"),
        (1, "S"),
        (1, "E"),
        (2, "Q"),
        (2, "S"),
        (2, "E"),
    ], kinds
    assert kinds[9] == (2, "W"), kinds
    ids = [int(re.search(r"work_id=(\d+)", ln).group(1)) for ln in events if "|Q|" in ln]
    assert ids == list(range(1, len(ids) + 1)), ids
    assert all(re.search(r"\|\+\d+\.\d{3}$", ln) for ln in events), events
    joined = ",".join(str(r) for r in range(size))
    assert lines[-1] == f"split|parent={name}|child=sub|ranks={joined}", lines[-1]
    q = open(quiet_path).read().splitlines()
    assert not [ln for ln in q if re.match(r"C\d+\|[SEW]\|", ln)], q
    assert len([ln for ln in q if "|Q|" in ln]) == len(ids)
    assert "|buf=" not in "".join(q)
    assert not [ln for ln in lines if ln.startswith("WARN")], lines
    # an op clog does not log (finalize) writes nothing, and no warning
    log.register_with_comm(sub)
    sub.finalize()
    after = open(path).read().splitlines()
    assert after[len(lines)] == f"new_comm|comm=sub|rank={rank}|world_size={size}", after
    assert after[len(lines) + 1 :] == [], after[len(lines) :]
    # the process group's C++ path stays on and is logged (NOTE [clog] in clog.hpp)
    from fastcomms import _C
    from fastcomms.device_mesh import _create_torchcomm_process_group

    pg = _create_torchcomm_process_group(comm, "clog_pg")
    before, t = _C._fast_calls(), torch.ones(2)
    torch.distributed.all_reduce(t, group=pg)
    assert _C._fast_calls() == before + 1
    new = open(path).read().splitlines()[len(after) :]
    sig = f"all_reduce|in_count=2|out_count=2|dtype=f32|red_op=sum|async_op=t|buf={t.data_ptr():#x}"
    assert any(ln.endswith(f"|sig|{sig}|comm={name}") for ln in new), new
    # the Ulysses collective transport's own byte exchange is logged, ended and waited when the
    # transport waits for it (NOTE [wait observers])
    from fastcomms.ulysses import UlyssesGroup

    g = UlyssesGroup(comm)
    start = len(open(path).read().splitlines())
    g.all_to_all_4d(torch.randn(1, 2, size, 4))
    new = open(path).read().splitlines()[start:]
    assert any("|sig|all_to_all_v_single|" in ln and "|dtype=u8|" in ln for ln in new), new
    kinds = [ln.split("|")[1] for ln in new if re.match(r"C\d+\|[QSEW]\|", ln)]
    assert kinds[-4:] == ["Q", "S", "E", "W"], new
    g.destroy()
    log.close()
    quiet.close()
    with pytest.raises(ValueError, match="unknown event"):
        clog(path, ["QQ"])
    with pytest.raises(ValueError, match="unknown verbose"):
        clog(path, ["ALL"], verbose=["stacks"])


@pytest.mark.parametrize("size", [2, 3])
def test_clog(world, size):
    world(clog_lines, size)
