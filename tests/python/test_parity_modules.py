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
    entries = json.loads(fr.dump_json())["entries"]
    assert fr.size() == 4 and len(entries) == 4  # the ring keeps the last max_entries
    assert [e["op"] for e in entries] == ["all_reduce"] * 3 + ["barrier"]
    assert entries[-2]["tensors"] == [{"arg": "tensor", "shape": [8], "dtype": "float32"}]
    assert all(e["state"] == "issued" and e["rank"] == rank for e in entries)
    fr.unregister()
    nan = NanCheckHook()
    nan.register_with_comm(comm)
    bad = torch.ones(4)
    bad[2] = float("nan")
    with pytest.raises(RuntimeError, match="NaN in tensor"):
        comm.all_reduce(bad, ReduceOp.SUM, False)  # raised on every rank before anything moved
    ok = torch.ones(4)
    comm.all_reduce(ok, ReduceOp.SUM, False)
    assert torch.equal(ok, torch.full((4,), float(size)))
    nan.unregister()


def test_flight_recorder_and_nan_check(world):
    world(hooks_module, 2)
