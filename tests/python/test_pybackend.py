# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""NOTE [python backend trampoline]: a backend written in Python (torchcomms' protocol) under the
C++ communicator. Its methods get the caller's own tensor objects in torchcomms' order, its
calls pass the communicator's argument checks and hooks (flight recorder, NaN check, clog), a
sync op is waited for, the backend's own exceptions reach the caller as themselves, and the
library's C++ paths refuse it. One process, no store; but for the ranks sharing a store at the
end (NOTE [store incarnations] for a backend written in Python)."""

import datetime
import json
import os
import re
import time
import traceback

import fastcomms
import pytest
import torch
from conftest import init_rank, spawn
from fastcomms import ReduceOp


class Token:
    """An async result: done once waited for."""

    def __init__(self, log):
        self.log, self.done = log, False

    def wait(self):
        self.done = True
        self.log.append("wait")

    def is_completed(self):
        return self.done


class Recording(fastcomms.TorchCommBackend):
    """Rank 0 of 2; records every call's method and arguments and returns a Token."""

    def init(self, device, name, options):
        self.calls = []

    def get_rank(self):
        return 0

    def get_size(self):
        return 2

    def __getattr__(self, method):
        if method.startswith("_") or method in ("split", "get_backend_version"):
            raise AttributeError(method)

        def op(*args):
            self.calls.append((method, args))
            return Token(self.calls)

        return op


fastcomms.register_backend("recording_py", Recording)


@pytest.fixture
def rec():
    comm = fastcomms.new_comm("recording_py", "cpu", f"rec{torch.randint(1 << 30, ()).item()}")
    yield comm, comm.get_backend_impl()
    comm.finalize()


def _last(impl, method):
    return next(c[1] for c in reversed(impl.calls) if c != "wait" and c[0] == method)


def test_methods_get_the_callers_tensors_in_torchcomms_order(rec):
    comm, impl = rec
    assert isinstance(impl, Recording) and comm.get_backend() == "recording_py"
    n = int(torch.randint(1, 5, ()).item())
    x, y = torch.randn(2 * n), torch.randn(2 * n)
    outs, ins = [torch.empty(n), torch.empty(n)], [torch.randn(n), torch.randn(n)]

    comm.all_reduce(x, ReduceOp.MAX, False)
    t, op, a = _last(impl, "all_reduce")
    assert t is x and op.type == ReduceOp.MAX.type and a is False
    factor = torch.tensor([0.5])
    comm.reduce_scatter_v(outs[0], ins, ReduceOp.PREMUL_SUM(factor), True).wait()
    out, lst, op, a = _last(impl, "reduce_scatter_v")
    assert out is outs[0] and all(p is q for p, q in zip(lst, ins, strict=True)) and a is True
    assert op.type == ReduceOp.PREMUL_SUM(factor).type and torch.equal(op.factor, factor)
    comm.reduce(x, 1, ReduceOp.PREMUL_SUM(2.0), False)
    t, root, op, _ = _last(impl, "reduce")
    assert t is x and root == 1 and op.factor == 2.0
    comm.all_gather(outs, ins[0], False)
    lst, t, _ = _last(impl, "all_gather")
    assert all(p is q for p, q in zip(lst, outs, strict=True)) and t is ins[0]
    # the even forms arrive as themselves, not as the _v forms the communicator runs them as
    comm.all_to_all_single(y, x, False)
    assert _last(impl, "all_to_all_single")[:2] == (y, x)
    comm.all_to_all_v_single(y, x, [n, n], [2 * n, 0], False)
    o, i, os_, is_, _ = _last(impl, "all_to_all_v_single")
    assert o is y and i is x and list(os_) == [n, n] and list(is_) == [2 * n, 0]
    comm.gather_single(y, ins[0], 0, False)
    o, i, root, _ = _last(impl, "gather_single")
    assert o is y and i is ins[0] and root == 0
    comm.scatter(outs[1], ins, 0, False)
    o, lst, root, _ = _last(impl, "scatter")
    assert o is outs[1] and all(p is q for p, q in zip(lst, ins, strict=True))
    comm.all_to_all(outs, ins, False)
    lo, li, _ = _last(impl, "all_to_all")
    assert [id(t) for t in lo + li] == [id(t) for t in outs + ins]
    comm.send(x, 1, False)
    assert _last(impl, "send")[:2] == (x, 1)
    batch = comm.batch_op_create()
    batch.send(x, 1)
    batch.recv(y, 1)
    batch.issue(False)
    (ops, _) = _last(impl, "batch_op_issue")
    assert [(s, t is u, p) for (s, t, p), u in zip(ops, (x, y), strict=True)] == [
        (True, True, 1),
        (False, True, 1),
    ]
    comm.barrier(False)
    assert _last(impl, "barrier") == (False,)
    gathered = torch.empty(2 * n)
    h = comm.all_gather_p_init(gathered)
    comm.all_gather_p_exec(h, ins[1], False)
    o, i, _ = _last(impl, "all_gather_single")
    assert o is gathered and i is ins[1]
    comm.all_gather_p_free(h)


def test_sync_ops_are_waited_and_async_ones_are_not(rec):
    comm, impl = rec
    w = comm.broadcast(torch.ones(3), 0, False)
    assert impl.calls[-1] == "wait"  # the communicator waited for the sync op's token
    n = len(impl.calls)
    w.wait()
    assert len(impl.calls) == n  # its token is waited for once
    w = comm.broadcast(torch.ones(3), 0, True)
    assert impl.calls[-1][0] == "broadcast" and not w.is_completed()
    w.wait()
    assert w.is_completed() and impl.calls[-1] == "wait"


def test_the_communicators_argument_checks_apply(rec):
    comm, impl = rec
    before = len(impl.calls)
    with pytest.raises(ValueError, match="dst must be in"):
        comm.send(torch.ones(1), 5, False)
    with pytest.raises(ValueError, match="tensor_list"):
        comm.all_gather([torch.empty(2)], torch.ones(2), False)  # two ranks, one output
    assert len(impl.calls) == before  # refused before the backend was called


def test_the_backends_own_exception_reaches_the_caller():
    class Failing(Recording):
        def all_reduce(self, tensor, op, async_op):
            raise KeyError("from the backend")

    fastcomms.register_backend("failing_py", Failing)
    comm = fastcomms.new_comm("failing_py", "cpu", "failing")
    with pytest.raises(KeyError, match="from the backend"):
        comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    comm.barrier(False)  # the communicator goes on
    comm.finalize()


def test_cpp_hooks_on_a_python_backend(rec, tmp_path):
    """The flight recorder, the NaN check and clog are the C++ communicator's hooks, on a
    Python backend as on any other."""
    from fastcomms.hooks import FlightRecorderHook, NanCheckHook, clog

    comm, impl = rec
    fr = FlightRecorderHook(isolated=True, max_entries=8)
    fr.register_with_comm(comm)
    log = clog(str(tmp_path / "c.log"), ["ALL"])
    log.register_with_comm(comm)
    comm.all_reduce(torch.ones(4), ReduceOp.SUM, True).wait()
    entries = json.loads(fr.dump_json())["entries"]
    assert [e["profiling_name"] for e in entries] == ["recording_py:all_reduce"]
    assert entries[0]["input_sizes"] == [[4]]
    nan = NanCheckHook()
    nan.register_with_comm(comm)
    calls = len(impl.calls)
    with pytest.raises(RuntimeError, match="NaN"):
        comm.all_reduce(torch.tensor([float("nan")]), ReduceOp.SUM, False)
    assert len(impl.calls) == calls  # stopped before the backend saw it
    nan.unregister()
    fr.unregister()
    log.close()
    lines = (tmp_path / "c.log").read_text().splitlines()
    assert any(ln.startswith("C1|sig|all_reduce|in_count=4|") for ln in lines), lines
    events = [ln for ln in lines if re.match(r"C\d+\|[QSEW]\|", ln)]
    assert [ln.split("|")[1] for ln in events][:4] == list("QSEW"), lines
    assert all(re.search(r"\|\+\d+\.\d{3}$", ln) for ln in events), events


def test_other_devices_are_refused_at_new_comm():
    with pytest.raises(fastcomms.UnsupportedError, match="serves cpu or cuda devices; got meta"):
        fastcomms.new_comm("recording_py", "meta", "on_meta")


def test_library_cpp_paths_refuse_a_python_backend(rec):
    comm, _ = rec
    assert comm._fast is None  # NOTE [process group fast path], NOTE [compiled calls in C++]
    with pytest.raises(fastcomms.UnsupportedError, match="needs a built-in backend"):
        comm._c.select_transport("auto", False)


def test_dropped_async_work_releases_its_tensors():
    """A work that never completes (only wait(), never waited) keeps no tensor once dropped."""
    import gc
    import weakref

    class Never:
        def wait(self):
            pass

    class Pending(Recording):  # (its broadcast and barrier record nothing)
        def get_size(self):
            return 1

        def broadcast(self, tensor, root, async_op):
            return Never()

        def barrier(self, async_op):
            return None

    fastcomms.register_backend("pending_py", Pending)
    comm = fastcomms.new_comm("pending_py", "cpu", "pending")
    t = torch.ones(3)
    ref = weakref.ref(t)
    w = comm.broadcast(t, 0, True)
    assert not w.is_completed()
    del w, t
    comm.barrier(False)  # (parked tensors are looked at by the next call)
    gc.collect()
    assert ref() is None
    comm.finalize()


def test_device_alltoallv_refuses_a_python_backend_of_any_name():
    fastcomms.register_backend("nccl_py_named", Recording)
    comm = fastcomms.new_comm("nccl_py_named", "cpu", "nccl_named")
    with pytest.raises(fastcomms.UnsupportedError, match="backend written in Python"):
        comm.device_alltoallv_single(
            torch.empty(4),
            torch.ones(4),
            torch.ones(2, dtype=torch.int64) * 2,
            torch.ones(2, dtype=torch.int64) * 2,
            False,
        )
    comm.finalize()


class OverTorchDistributed(fastcomms.TorchCommBackend):
    """The ranks of torch.distributed's default group (gloo); only all_reduce."""

    def init(self, device, name, options):
        import torch.distributed as dist

        self.dist = dist

    def get_rank(self):
        return self.dist.get_rank()

    def get_size(self):
        return self.dist.get_world_size()

    def all_reduce(self, tensor, op, async_op):
        self.dist.all_reduce(tensor)

    def finalize(self):
        pass


def _over_dist_rank(rank, size, path, errq, body):
    """A rank of torch.distributed's default group running body(rank, store) with the backend
    above registered; its traceback goes to errq."""
    try:
        import torch.distributed as dist

        store = dist.PrefixStore("fc", init_rank(rank, size, path))
        fastcomms.register_backend("over_dist_py", OverTorchDistributed)
        body(rank, size, store)
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _reused_name(rank, size, store):
    # keys stay after finalize, so only the new incarnation's own key space keeps the second
    # communicator from the first one's verdict
    os.environ["FASTCOMMS_KEEP_STORE_KEYS"] = "1"
    kw = dict(store=store, hints={"check_calls": "strict"}, timeout=datetime.timedelta(seconds=30))
    first = fastcomms.new_comm("over_dist_py", "cpu", "reused", **kw)
    with pytest.raises(ValueError, match="ranks issued different collectives"):
        first.all_reduce(torch.ones(4 + rank), ReduceOp.SUM, False)
    first.finalize()
    # The name again, on the same store: rank 1 reaches the check first, where the first
    # incarnation's verdict (a mismatch) would answer it.
    second = fastcomms.new_comm("over_dist_py", "cpu", "reused", **kw)
    if rank == 0:
        time.sleep(1.0)
    t = torch.full((8,), float(rank + 1))
    second.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.full((8,), 3.0)), t
    second.finalize()


def _reincarnations(rank, size, store):
    kw = dict(store=store, timeout=datetime.timedelta(seconds=60))
    # new_comm then finalize with nothing collective between (the backend's init and finalize do
    # nothing): every incarnation still numbers alike on every rank
    for _ in range(8):
        fastcomms.new_comm("over_dist_py", "cpu", "again", **kw).finalize()
    last = fastcomms.new_comm("over_dist_py", "cpu", "again", **kw)
    t = torch.ones(3)
    last.all_reduce(t, ReduceOp.SUM, False)
    assert torch.equal(t, torch.full((3,), float(size))), t
    last.finalize()


def test_incarnations_of_a_name_without_a_collective_between():
    spawn(_over_dist_rank, 4, _reincarnations, timeout=180)


def test_a_failed_new_comm_lets_the_backend_go():
    """A rank/size the backend gives wrong is refused at new_comm, and the backend it set up is
    aborted (no communicator will ever finalize it)."""
    stopped = []

    class Wrong(Recording):
        def get_rank(self):
            return 2

        def abort(self):
            stopped.append("abort")

    fastcomms.register_backend("wrong_rank_py", Wrong)
    with pytest.raises(ValueError, match="must give 0 <= rank < size, got rank 2 and size 2"):
        fastcomms.new_comm("wrong_rank_py", "cpu", "wrong")
    assert stopped == ["abort"]


def test_a_reused_name_reads_none_of_its_predecessors_keys():
    """The strict call check of a backend written in Python keeps its records and verdicts in the
    communicator's own key space, a new one for each incarnation of a name."""
    spawn(_over_dist_rank, 2, _reused_name, timeout=120)
