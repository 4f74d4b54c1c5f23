# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' smaller surface, each as torchcomms has it: NanCheckHook(check_inputs,
check_outputs) and is_enabled(); FlightRecorderHook's len() and max_entries=0;
TorchWork._set_status; _comms._is_backend_registered; deep copies of a window;
ProcessGroup.new_window / supports_window over a fastcomms communicator (torchcomms #3492);
distwrap.init_process_group's defaults and pg_options; distwrap.register_mem_pool."""

import copy
import json

import pytest
import torch


def _fake(name):
    import fastcomms

    return fastcomms.new_comm("fake", "cpu", name)


def test_nan_check_inputs_outputs_and_is_enabled():
    from fastcomms import ReduceOp
    from fastcomms.hooks import NanCheckHook

    comm = _fake("nan_items")
    bad = torch.tensor([1.0, float("nan")])
    good = torch.ones(2)
    default = NanCheckHook()
    assert not default.is_enabled()
    default.register_with_comm(comm)
    assert default.is_enabled()
    with pytest.raises(
        RuntimeError, match=r"NaN detected in input tensor for 'all_reduce' on comm"
    ):
        comm.all_reduce(bad, ReduceOp.SUM, False)
    # outputs are not checked by default: a NaN in a buffer the op writes is fine
    comm.recv(bad.clone(), 0, False)
    comm.all_to_all_single(bad.clone(), good, False)
    default.unregister()
    outs = NanCheckHook(check_inputs=False, check_outputs=True)
    outs.register_with_comm(comm)
    comm.send(bad, 0, False)  # inputs are not checked
    with pytest.raises(RuntimeError, match=r"NaN detected in output tensor for 'recv'"):
        comm.recv(bad.clone(), 0, False)
    with pytest.raises(
        RuntimeError, match=r"NaN detected in output tensor for 'all_to_all_single'"
    ):
        comm.all_to_all_single(bad.clone(), good, False)
    with pytest.raises(RuntimeError, match=r"NaN detected in output tensor for 'all_gather'"):
        comm.all_gather([bad.clone()], good, False)
    # an in-place tensor is checked (as input) when either is on
    with pytest.raises(RuntimeError, match=r"NaN detected in input tensor for 'broadcast'"):
        comm.broadcast(bad.clone(), 0, False)
    outs.unregister()
    comm.finalize()


def test_flight_recorder_len_and_zero_entries(monkeypatch):
    from fastcomms import ReduceOp
    from fastcomms.hooks import FlightRecorderHook

    comm = _fake("fr_items")
    fr = FlightRecorderHook(max_entries=2)
    fr.register_with_comm(comm)
    for _ in range(3):
        comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    # torchcomms' size(): entries recorded since reset (past max_entries), len() the same
    assert len(fr) == fr.size() == 3
    assert len(json.loads(fr.dump_json())["entries"]) == 2
    fr.reset()
    assert len(fr) == 0
    fr.unregister()
    # max_entries=0: the shared recorder's size, TORCHCOMM_FR_BUFFER_SIZE (default 2000)
    monkeypatch.setenv("TORCHCOMM_FR_BUFFER_SIZE", "3")
    zero = FlightRecorderHook(max_entries=0)
    zero.register_with_comm(comm)
    for _ in range(5):
        comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    assert len(zero) == 5 and len(json.loads(zero.dump_json())["entries"]) == 3
    zero.unregister()
    monkeypatch.delenv("TORCHCOMM_FR_BUFFER_SIZE")
    assert FlightRecorderHook(max_entries=0)._max == 2000
    # an isolated recorder of 0 entries records nothing
    none = FlightRecorderHook(max_entries=0, isolated=True)
    none.register_with_comm(comm)
    comm.all_reduce(torch.ones(2), ReduceOp.SUM, False)
    assert none.is_enabled() and len(none) == 0 and json.loads(none.dump_json())["entries"] == []
    none.unregister()
    with pytest.raises(ValueError, match="max_entries"):
        FlightRecorderHook(max_entries=-1)
    comm.finalize()


def test_work_set_status_and_is_backend_registered():
    import fastcomms
    from fastcomms import WorkStatus, _comms

    class Pending:
        def wait(self):
            pass

    class Py(fastcomms.TorchCommBackend):
        def init(self, device, name, options):
            pass

        def get_rank(self):
            return 0

        def get_size(self):
            return 1

        def barrier(self, async_op):
            return Pending()

    assert not _comms._is_backend_registered("set_status_py")
    fastcomms.register_backend("set_status_py", Py)
    assert _comms._is_backend_registered("set_status_py")
    assert _comms._is_backend_registered("gloo") and not _comms._is_backend_registered("nope")
    comm = fastcomms.new_comm("set_status_py", "cpu", "ss")
    w = comm.barrier(True)
    assert w.status() == WorkStatus.INPROGRESS and not w.is_completed()
    w._set_status(WorkStatus.COMPLETED)
    assert w.status() == WorkStatus.COMPLETED and w.is_completed()
    w._set_status(WorkStatus.ERROR)
    assert w.status() == WorkStatus.ERROR and not w.is_completed()
    w.wait()  # waited: completed, as torchcomms' Python work
    assert w.status() == WorkStatus.COMPLETED
    comm.finalize()


def _native_work(rank, size, path, errq):
    import traceback

    import fastcomms
    import torch.distributed as dist
    from conftest import init_rank

    try:
        store = init_rank(rank, size, path)
        comm = fastcomms.new_comm("gloo", "cpu", "sw", store=dist.PrefixStore("fc", store))
        w = comm.barrier(True)
        with pytest.raises(RuntimeError, match="only supported on Python-created work"):
            w._set_status(fastcomms.WorkStatus.COMPLETED)
        w.wait()
        comm.finalize()
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_set_status_refused_on_native_work():
    from conftest import spawn

    spawn(_native_work, 1)


class _FakeNativeWindow:
    """Stands in for the extension's window on a CPU communicator (gloo has none)."""

    made = 0

    def __init__(self):
        type(self).made += 1
        self.buf = None

    def register_buffer(self, t):
        self.buf = t

    def deregister(self):
        self.buf = None

    def bytes(self):
        return 0 if self.buf is None else self.buf.numel() * self.buf.element_size()


class _CommStandin:
    def __init__(self, c):
        self._c = c

    def __getattr__(self, name):
        return getattr(self._c, name)

    def new_window(self):
        return _FakeNativeWindow()


def test_window_deepcopy_clones_as_torchcomms():
    from fastcomms import TorchCommWindow

    comm = _fake("win_copy")
    comm._c = _CommStandin(comm._c)
    t = torch.arange(6.0)
    win = TorchCommWindow(comm, t)
    assert copy.copy(win) is win
    holder = {"w": win, "t": t}
    memo = {}
    dup = copy.deepcopy(holder, memo)
    assert dup["w"] is not win and isinstance(dup["w"], TorchCommWindow)
    assert _FakeNativeWindow.made == 2  # a new window (collective, as torchcomms' clone)
    clone = dup["w"].get_tensor()
    assert clone is not t and torch.equal(clone, t)
    assert dup["t"] is clone  # the memo maps the tensor to the window's clone
    assert copy.deepcopy(win, {id(win): win}) is win
    empty = TorchCommWindow(comm)
    assert copy.deepcopy(empty).get_tensor() is None


def _pg_windows(comm, rank, size):
    import fastcomms
    import torch.distributed as dist
    from fastcomms.device_mesh import _create_torchcomm_process_group

    pg = _create_torchcomm_process_group(comm, "pg_windows")
    assert pg.supports_window is False  # gloo has no windows, as comm.new_window says
    with pytest.raises(fastcomms.UnsupportedError, match="has no windows"):
        pg.new_window(torch.ones(4))
    # the call reaches the communicator's new_window, its tensor and its result
    got = []
    sentinel = object()
    comm.new_window = lambda tensor=None: got.append(tensor) or sentinel
    t = torch.ones(4)
    assert pg.new_window(t) is sentinel and got == [t]
    assert pg.new_window() is sentinel and got[-1] is None
    del comm.new_window
    # a group that is not fastcomms': torch's answer (this torch: no windows)
    assert dist.group.WORLD.supports_window is False


def test_process_group_new_window(world):
    world(_pg_windows, 2)


def _distwrap_defaults(rank, size, path, errq):
    import traceback

    import fastcomms.distwrap as fd
    import torch.distributed as dist
    from fastcomms.device_mesh import comm_of

    try:
        with pytest.raises(ValueError, match="backend must be specified"):
            fd.init_process_group(init_method=f"file://{path}", rank=rank, world_size=size)
        # the default is torch.distributed's own group (use_torchcomms=False, as torchcomms)
        fd.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=size)
        assert fd._torch_mode and comm_of(dist.group.WORLD) is None
        t = torch.full((2,), float(rank + 1))
        fd.all_reduce(t)
        assert torch.equal(t, torch.full((2,), float(size * (size + 1) // 2)))
        fd.destroy_process_group()
        # use_torchcomms=True: pg_options' stream priority reaches the communicator
        opts = dist.ProcessGroupNCCL.Options()
        opts.is_high_priority_stream = True
        fd.init_process_group(
            "gloo",
            init_method=f"file://{path}2",
            rank=rank,
            world_size=size,
            pg_options=opts,
            use_torchcomms=True,
        )
        comm = fd._group(None).comm
        assert comm.get_options().hints.get("nccl.high_priority") == "1"
        fd.register_mem_pool(None, torch.device("cpu"), object())  # over fastcomms: nothing to do
        fd.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_distwrap_defaults_and_pg_options():
    from conftest import spawn

    spawn(_distwrap_defaults, 2)
