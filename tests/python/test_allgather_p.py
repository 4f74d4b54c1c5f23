# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Persistent all-gather (torchcomms' all_gather_p_init / _exec / _free) on gloo, worlds of 2
and 3: random data into a poisoned registered output, reused across calls; each call checked;
use after free; hooks and the flight recorder see all_gather_p_exec."""

import json

import pytest
import torch


def persistent_all_gather(comm, rank, size):
    import fastcomms
    from fastcomms import AllGatherPHandle, OpName
    from fastcomms.hooks import FlightRecorderHook

    n = 5
    out = torch.full((size * n,), float("nan"))
    h = comm.all_gather_p_init(out)
    assert isinstance(h, AllGatherPHandle) and h.output is out and not h.is_freed()
    g = torch.Generator().manual_seed(1234)
    for step in range(3):  # the same buffer, filled anew each call
        xs = [torch.randn(n, generator=g) for _ in range(size)]
        out.fill_(float("nan"))
        w = comm.all_gather_p_exec(h, xs[rank], step % 2 == 1)
        if step % 2 == 1:
            w.wait()
        assert torch.equal(out, torch.cat(xs)), (step, out)
    # hints and timeout, by keyword, as torchcomms takes them
    import datetime

    x = torch.arange(n, dtype=torch.float32) + rank
    comm.all_gather_p_exec(h, x, False, hints={"a": "b"}, timeout=datetime.timedelta(seconds=30))
    assert torch.equal(
        out, torch.cat([torch.arange(n, dtype=torch.float32) + q for q in range(size)])
    )

    # each call is checked against the handle's output
    with pytest.raises(ValueError, match=r"all_gather_p_exec.*input has 4 elements"):
        comm.all_gather_p_exec(h, torch.zeros(n - 1), False)
    with pytest.raises(TypeError, match=r"all_gather_p_exec.*dtype"):
        comm.all_gather_p_exec(h, torch.zeros(n, dtype=torch.float64), False)
    with pytest.raises(TypeError, match="AllGatherPHandle"):
        comm.all_gather_p_exec(object(), x, False)

    # hooks and the flight recorder name it as torchcomms does
    seen = []
    hook = comm.register_pre_hook(lambda name, op_id, args: seen.append((name, args)))
    fr = FlightRecorderHook(max_entries=8, isolated=True)
    fr.register_with_comm(comm)
    comm.all_gather_p_exec(h, x, False)
    hook.remove()
    fr.unregister()
    assert [s[0] for s in seen] == [OpName.all_gather_p_exec]
    assert seen[0][1].input is x and seen[0][1].output is out and seen[0][1].async_op is False
    names = [e["profiling_name"] for e in json.loads(fr.dump_json())["entries"]]
    assert names == ["gloo:all_gather_p_exec"], names

    # free: drops the buffer; a second free and free(None) do nothing; use after free raises
    comm.all_gather_p_free(h)
    assert h.is_freed() and h.output is None
    comm.all_gather_p_free(h)
    comm.all_gather_p_free(None)
    with pytest.raises(ValueError, match="freed by all_gather_p_free"):
        comm.all_gather_p_exec(h, x, False)

    # init checks its output
    with pytest.raises(ValueError, match="multiple of the size"):
        comm.all_gather_p_init(torch.zeros(size * n + 1))
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_gather_p_init(torch.zeros(size * n, 2).t())
    # a handle of another communicator is refused
    sub = comm.split(list(range(size)), "agp_sub")
    h2 = sub.all_gather_p_init(torch.zeros(size * n))
    with pytest.raises(ValueError, match="another communicator"):
        comm.all_gather_p_exec(h2, x, False)
    sub.all_gather_p_exec(h2, x, False)
    assert torch.equal(h2.output, torch.cat([x - rank + q for q in range(size)]))
    sub.all_gather_p_free(h2)
    sub.finalize()
    assert "AllGatherPHandle" in fastcomms.__all__


@pytest.mark.parametrize("size", [2, 3])
def test_persistent_all_gather(world, size):
    world(persistent_all_gather, size)
