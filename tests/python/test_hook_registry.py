# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The methods written from the operation table keep torchcomms' signatures (NOTE [operation
table]), and Python hooks, the C++ hooks and the C++ communicator share one registry and one op-id
sequence (NOTE [one hook registry], NOTE [op ids]). One process, world 1 over gloo."""

import inspect
import os

import fastcomms
import pytest
import torch
import torch.distributed as dist
from fastcomms import OpName, ReduceOp

# torchcomms' positional order of every generated method (async_op, hints, timeout follow)
SIGNATURES = {
    "send": "tensor dst",
    "recv": "tensor src",
    "broadcast": "tensor root",
    "all_reduce": "tensor op",
    "reduce": "tensor root op",
    "all_gather": "tensor_list tensor",
    "all_gather_v": "tensor_list tensor",
    "all_gather_single": "output input",
    "reduce_scatter": "output input_list op",
    "reduce_scatter_v": "output input_list op",
    "reduce_scatter_single": "output input op",
    "all_to_all_single": "output input",
    "all_to_all_v_single": "output input output_split_sizes input_split_sizes",
    "all_to_all": "output_tensor_list input_tensor_list",
    "barrier": "",
    "scatter": "output_tensor input_tensor_list root",
    "gather": "output_tensor_list input_tensor root",
    "gather_single": "output input root",
}


def test_signatures_are_torchcomms():
    for name, params in SIGNATURES.items():
        sig = inspect.signature(getattr(fastcomms.TorchComm, name))
        want = ["self", *params.split(), "async_op", "hints", "timeout"]
        assert list(sig.parameters) == want, (name, sig)
        assert sig.parameters["hints"].default is None and sig.parameters["timeout"].default is None
        assert all(
            p.default is inspect.Parameter.empty for p in list(sig.parameters.values())[:-2]
        ), (name, sig)
    assert "all_reduce" in inspect.getsource(fastcomms.TorchComm.all_reduce)  # (linecache)


@pytest.fixture
def comms(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    made = [fastcomms.new_comm("gloo", "cpu", f"reg{i}", store=store) for i in range(2)]
    yield made
    for c in made:
        c.finalize()


def test_one_registry_one_sequence(comms):
    a, b = comms
    seen, raw, post = [], [], []
    assert a._fast is not None  # no hook: the process group's C++ path
    ha = a.register_pre_hook(lambda name, op_id, args: seen.append((name, op_id, args)))
    hb = b.register_pre_hook(lambda name, op_id, args: seen.append((name, op_id, args)))
    hp = a.register_post_hook(lambda op_id, args: post.append((op_id, type(args).__name__)))
    # NOTE [hooks on the fast path]: the C++ paths (the process group's, the compiled calls')
    # stay on
    assert a._fast is not None
    # a hook registered on the C++ communicator itself sees the same ops and ids
    remove_raw = a.get_backend_impl().register_pre_hook(lambda *i: raw.append(i))
    x = torch.ones(2)
    a.all_reduce(x, ReduceOp.SUM, False)
    b.barrier(False)
    w = a.broadcast(x, 0, True)
    w.wait()
    ids = [i for _, i, _ in seen]
    assert [n for n, _, _ in seen] == [OpName.all_reduce, OpName.barrier, OpName.broadcast]
    assert ids == [ids[0], ids[0] + 1, ids[0] + 2]  # across communicators: one sequence
    assert seen[0][2].tensor is x and seen[0][2].op == ReduceOp.SUM
    assert raw == [("all_reduce", ids[0], False), ("broadcast", ids[2], True)]
    assert post == [(ids[0], "AllReducePostHookArgs"), (ids[2], "BroadcastPostHookArgs")]
    remove_raw()
    # split: its post-hook gets the communicator it made; finalize's ops have id 0
    splits = []
    hs = a.register_post_hook(lambda op_id, args: splits.append(getattr(args, "new_comm", None)))
    child = a.split([0], "child")
    assert splits[-1] is child and seen[-1][0] is OpName.split and seen[-1][1] > ids[2]
    child.finalize()
    for h in (ha, hb, hp, hs):
        h.remove()
    assert a._fast is not None
    n = len(seen)
    a.barrier(False)
    assert len(seen) == n  # removed


def test_finalize_and_async_hooks(monkeypatch):
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    comm = fastcomms.new_comm("gloo", "cpu", "obs", store=dist.HashStore())
    pre, post = [], []
    comm.register_pre_hook(lambda name, op_id, args: pre.append((name, op_id)))
    comm.register_post_hook(lambda op_id, args: post.append(op_id))
    w = comm.all_reduce(torch.ones(1), ReduceOp.SUM, True)
    w.wait()
    assert post == [pre[0][1]] and pre[0][0] is OpName.all_reduce
    comm.finalize()
    assert pre[-1] == (OpName.finalize, 0)


def test_python_backend_draws_from_the_sequence():
    fake = fastcomms.new_comm("fake", "cpu", "fake_ids")
    ids = []
    fake.register_pre_hook(lambda name, op_id, args: ids.append(op_id))
    fake.barrier(False)
    fake.barrier(False)
    assert ids[1] == ids[0] + 1 and ids[0] > 0
    fake.finalize()
    assert ids[-1] == 0


def test_flight_recorder_keeps_the_fast_paths(comms):
    """NOTE [flight recorder in C++]: a recorder leaves the C++ paths on, and records the calls
    they issue (the process group's all_reduce) with the eager ones."""
    import json

    from fastcomms import _C
    from fastcomms.device_mesh import _create_torchcomm_process_group
    from fastcomms.hooks import FlightRecorderHook

    a, _ = comms
    fr = FlightRecorderHook(max_entries=8)
    fr.register_with_comm(a)
    assert a._fast is not None and fr.is_enabled()
    pg = _create_torchcomm_process_group(a, "fr_fast_pg")
    x = torch.ones(3)
    a.all_reduce(x, ReduceOp.SUM, False)
    before = _C._fast_calls()
    dist.all_reduce(x, group=pg)
    assert _C._fast_calls() == before + 1  # the process group's C++ path ran it
    entries = json.loads(fr.dump_json())["entries"]
    assert [e["profiling_name"] for e in entries] == ["gloo:all_reduce"] * 2
    assert [e["input_sizes"] for e in entries] == [[[3]]] * 2
    assert all(e["state"] == "completed" for e in entries)
    fr.unregister()
    assert not fr.is_enabled()
    a.barrier(False)
    assert fr.size() == 2


def test_nan_check_is_a_cpp_hook(comms):
    """NOTE [NaN check on the device]: the check leaves the C++ paths on and checks the calls they
    issue too; a CPU tensor's NaN stops its own op, with torchcomms' message."""
    from fastcomms.device_mesh import _create_torchcomm_process_group
    from fastcomms.hooks import NanCheckHook

    a, _ = comms
    check = NanCheckHook()
    check.register_with_comm(a)
    assert a._fast is not None and check.is_enabled()
    bad = torch.tensor([1.0, float("nan"), 3.0])
    msg = r"NaN detected in input tensor for 'all_reduce' on comm 'reg0': \(3,\) float32"
    with pytest.raises(RuntimeError, match=msg):
        a.all_reduce(bad, ReduceOp.SUM, False)
    pg = _create_torchcomm_process_group(a, "nan_fast_pg")
    with pytest.raises(RuntimeError, match="NaN detected in input tensor for 'all_reduce'"):
        dist.all_reduce(bad, group=pg)
    ok = torch.ones(2)
    dist.all_reduce(ok, group=pg)
    a.all_reduce(torch.ones(2, dtype=torch.int64), ReduceOp.SUM, False)  # not floating: unchecked
    check.unregister()
    a.all_reduce(bad, ReduceOp.SUM, False)  # unregistered
