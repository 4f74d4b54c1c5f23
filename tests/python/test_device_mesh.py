# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms communicators as torch.distributed process groups (issue 15): torch's functions,
functional collectives, DeviceMesh, DDP and FSDP2 on them give what torch's own gloo groups give,
bit for bit, on random data (CPU, gloo)."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from fastcomms.device_mesh import _create_torchcomm_process_group, comm_of, init_device_mesh
from torch import nn


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def process_group_ops(comm, rank, size):
    pg = _create_torchcomm_process_group(comm, "fc_world")
    assert pg.group_name == "fc_world"
    assert comm_of(pg) is comm and dist.get_rank(pg) == rank and dist.get_world_size(pg) == size
    assert dist.get_process_group_ranks(pg) == list(range(size))
    assert dist.get_backend(pg) == "fastcomms"
    dev = comm.get_device()
    torch.manual_seed(1000 + rank)
    n = 6 * size

    def both(fn, *shapes_or_tensors):
        """fn(group, *fresh copies) on ours and on torch's group; the tensors after each."""
        outs = []
        for group in (pg, None):
            ts = [t.clone() for t in shapes_or_tensors]
            fn(group, *ts)
            outs.append(ts)
        return outs

    x = torch.randn(n, device=dev)
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT):
        ours, theirs = both(lambda g, t, op=op: dist.all_reduce(t, op, group=g), x)
        assert _same(ours[0], theirs[0]), op
    # PREMUL_SUM (what FSDP2 reduces gradients with): its factor reaches the communicator
    ours = x.clone()
    dist.all_reduce(ours, op=dist._make_nccl_premul_sum(0.5), group=pg)
    theirs = x.clone()
    dist.all_reduce(theirs, group=None)
    assert _same(ours, theirs * 0.5)
    ours, theirs = both(lambda g, t: dist.broadcast(t, src=size - 1, group=g), x)
    assert _same(ours[0], theirs[0])
    ours, theirs = both(lambda g, t: dist.reduce(t, dst=0, group=g), x)
    if rank == 0:
        assert _same(ours[0], theirs[0])
    out = [torch.empty(n, device=dev) for _ in range(size)]
    for group in (pg, None):
        res = [torch.full((n,), float("nan"), device=dev) for _ in range(size)]
        dist.all_gather(res, x, group=group)
        out = res if group is pg else out
        if group is None:
            assert all(_same(a, b) for a, b in zip(out, res, strict=True))
    ours, theirs = both(
        lambda g, o, i: dist.all_gather_into_tensor(o, i, group=g),
        torch.empty(n * size, device=dev),
        x,
    )
    assert _same(ours[0], theirs[0])
    ours, theirs = both(
        lambda g, o, i: dist.reduce_scatter_tensor(o, i, group=g), torch.empty(6, device=dev), x
    )
    assert _same(ours[0], theirs[0])
    ours, theirs = both(
        lambda g, o, i: dist.all_to_all_single(o, i, group=g), torch.empty(n, device=dev), x
    )
    assert _same(ours[0], theirs[0])
    # uneven splits: rank r sends q + 1 elements to rank q
    send = torch.randn(sum(q + 1 for q in range(size)), device=dev)
    recv_sizes = [rank + 1] * size
    ours, theirs = both(
        lambda g, o, i: dist.all_to_all_single(
            o, i, recv_sizes, [q + 1 for q in range(size)], group=g
        ),
        torch.empty(sum(recv_sizes), device=dev),
        send,
    )
    assert _same(ours[0], theirs[0])
    # point to point in a ring, as a batch: a plain torch ProcessGroup whose backend coalesces,
    # so torch hands the batch to the communicator as one batch (no single sends or receives)
    assert type(pg) is dist.ProcessGroup
    assert pg._get_backend(dev).supports_coalescing
    issued = []
    hook = comm.register_pre_hook(lambda name, op_id, args: issued.append(name.value))
    right, left = (rank + 1) % size, (rank - 1) % size
    pairs = [((rank + k) % size, (rank - k) % size) for k in range(1, min(2, size - 1) + 1)]
    got2 = [torch.full((n,), float("nan"), device=dev) for _ in pairs]
    reqs = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.full((n,), 10.0 * rank + k, device=dev), to, pg)
            for k, (to, _) in enumerate(pairs)
        ]
        + [dist.P2POp(dist.irecv, g, frm, pg) for g, (_, frm) in zip(got2, pairs, strict=True)]
    )
    for r in reqs:
        r.wait()
    hook.remove()
    assert issued == ["batch_op_issue"], issued
    for k, (_, frm) in enumerate(pairs):
        assert _same(got2[k], torch.full((n,), 10.0 * frm + k, device=dev)), (k, frm, got2[k])
    for group in (pg, None):
        got = torch.full((n,), float("nan"), device=dev)
        reqs = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x, right, group), dist.P2POp(dist.irecv, got, left, group)]
        )
        for r in reqs:
            r.wait()
        if group is pg:
            mine = got
        else:
            assert _same(mine, got)
    dist.barrier(group=pg)
    # torch's functional collectives (what DTensor and torch.compile use) by group name
    y, w = torch.randn(n, device=dev), dist.group.WORLD
    assert _same(
        funcol.all_reduce(y, "sum", "fc_world").wait(), funcol.all_reduce(y, "sum", w).wait()
    )
    assert _same(
        funcol.all_gather_tensor(y, 0, "fc_world").wait(),
        funcol.all_gather_tensor(y, 0, w).wait(),
    )
    assert _same(
        funcol.reduce_scatter_tensor(y, "sum", 0, "fc_world").wait(),
        funcol.reduce_scatter_tensor(y, "sum", 0, w).wait(),
    )
    assert _same(
        funcol.all_to_all_single(y, None, None, "fc_world").wait(),
        funcol.all_to_all_single(y, None, None, w).wait(),
    )


def process_group_fast_path(comm, rank, size):
    """NOTE [process group fast path]: all_reduce, all_gather_into_tensor and
    reduce_scatter_tensor on a fastcomms process group reach the communicator from C++, bit for
    bit what torch's own group gives; calls the table does not cover, and every call while the
    communicator runs a Python backend, take the Python path; Python hooks see either path's
    calls."""
    import time

    from fastcomms import _C, ReduceOp

    pg = _create_torchcomm_process_group(comm, "fc_fast")
    dev = comm.get_device()
    torch.manual_seed(7000 + rank)
    n = 5 * size

    def fast(fn):
        before = _C._fast_calls()
        fn()
        return _C._fast_calls() - before

    # integer-valued floats: any summation order gives the same bits
    x = torch.randint(-50, 50, (n,), device=dev).float()
    for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.AVG):
        ours, theirs = x.clone(), x.clone()
        assert fast(lambda op=op, t=ours: dist.all_reduce(t, op, group=pg)) == 1, op
        dist.all_reduce(theirs, op)
        assert _same(ours, theirs), op
    out = torch.full((n * size,), float("nan"), device=dev)
    assert fast(lambda: dist.all_gather_into_tensor(out, x, group=pg)) == 1
    ref = torch.empty(n * size, device=dev)
    dist.all_gather_into_tensor(ref, x)
    assert _same(out, ref)
    rs, rs_ref = torch.full((5,), float("nan"), device=dev), torch.empty(5, device=dev)
    assert fast(lambda: dist.reduce_scatter_tensor(rs, x, group=pg)) == 1
    dist.reduce_scatter_tensor(rs_ref, x)
    assert _same(rs, rs_ref)
    a2a, a2a_ref = torch.full((n,), float("nan"), device=dev), torch.empty(n, device=dev)
    assert fast(lambda: dist.all_to_all_single(a2a, x, group=pg)) == 1
    dist.all_to_all_single(a2a_ref, x)
    assert _same(a2a, a2a_ref)
    splits = [5] * size  # explicit splits: the Python path (all_to_all_v_single)
    assert fast(lambda: dist.all_to_all_single(a2a, x, splits, splits, group=pg)) == 0
    assert _same(a2a, a2a_ref)
    # PREMUL_SUM: a factor held as a number takes the fast path, one held in a tensor the
    # Python path; both scale
    for factor, path in ((0.5, 1), (torch.tensor(0.25), 0)):
        t = x.clone()
        op = dist._make_nccl_premul_sum(factor)
        assert fast(lambda op=op, t=t: dist.all_reduce(t, op=op, group=pg)) == path
        ref = x.clone()
        dist.all_reduce(ref)
        assert _same(t, ref * float(factor)), factor
    # an async call: its work and future as the Python path's
    t = x.clone()
    w = dist.all_reduce(t, group=pg, async_op=True)
    got = w.get_future().wait()
    assert w.is_completed() and len(got) == 1 and got[0] is t
    ref = x.clone()
    dist.all_reduce(ref)
    assert _same(t, ref)
    # NOTE [hooks on the fast path]: pre- and post-hooks leave the path on and see its calls as
    # the Python path's (the same tensors, the reduction)
    seen, posted = [], []
    hook = comm.register_pre_hook(lambda name, op_id, args: seen.append((name, op_id, args)))
    post = comm.register_post_hook(lambda op_id, args: posted.append((op_id, type(args).__name__)))
    t, rs2 = x.clone(), torch.empty(5, device=dev)
    assert fast(lambda: dist.all_reduce(t, dist.ReduceOp.MAX, group=pg)) == 1
    assert fast(lambda: dist.reduce_scatter_tensor(rs2, x, group=pg)) == 1
    assert fast(lambda: dist.all_gather_into_tensor(out, x, group=pg)) == 1
    (n0, id0, a0), (n1, id1, a1), (n2, id2, a2) = seen
    assert (n0.value, n1.value, n2.value) == (
        "all_reduce",
        "reduce_scatter_single",
        "all_gather_single",
    )
    assert a0.tensor is t and a0.op == ReduceOp.MAX and a0.async_op is True, a0
    assert a1.input is x and a1.output is rs2 and a1.op == ReduceOp.SUM, a1
    assert a2.input is x and a2.output is out and not hasattr(a2, "op"), a2
    assert posted == [
        (id0, "AllReducePostHookArgs"),
        (id1, "ReduceScatterSinglePostHookArgs"),
        (id2, "AllGatherSinglePostHookArgs"),
    ], posted
    hook.remove()
    post.remove()
    assert fast(lambda: dist.all_reduce(x.clone(), group=pg)) == 1
    assert len(seen) == 3 and len(posted) == 3, (seen, posted)
    # an error is fastcomms' exception, on every rank, and the group works after it
    with pytest.raises(TypeError, match="BAND needs an integer or bool tensor"):
        dist.all_reduce(torch.ones(3, device=dev), dist.ReduceOp.BAND, group=pg)
    # a dropped unfinished work keeps its tensors until the op is done: rank 0 drops both while
    # the others are late, then reuses the memory
    big = 1 << 18
    if rank == 0:
        dropped = torch.full((big,), 1.0, device=dev)
        dist.all_reduce(dropped, group=pg, async_op=True)
        del dropped
        junk = [torch.full((big,), 99.0, device=dev) for _ in range(8)]  # noqa: F841
    else:
        time.sleep(0.3)
        t = torch.full((big,), float(rank + 1), device=dev)
        dist.all_reduce(t, group=pg, async_op=True).wait()
        want = 1.0 + sum(float(q + 1) for q in range(1, size))
        assert torch.all(t == want), (t.min(), t.max(), want)
    dist.barrier(group=pg)


def process_group_wait_errors(comm, rank, size):
    """An error that comes at wait (a timeout: the other ranks never issue) is the same
    fastcomms exception on the fast path as on the Python path (forced by clearing `_fast`)."""
    import datetime

    from fastcomms import _C

    got = {}
    for path in ("fast", "python"):
        sub = comm.split(list(range(size)), f"wait_err_{path}")
        # the op's timeout, set after the split: the split's own rendezvous keeps the default, so
        # a rank that comes late to it on a loaded machine does not fail it
        sub.set_timeout(datetime.timedelta(seconds=1))
        if path == "python":  # (the path a Python backend's group takes)
            sub._fast = None
        pg = _create_torchcomm_process_group(sub, f"fc_wait_err_{path}")
        if rank == 0:
            before = _C._fast_calls()
            w = dist.all_reduce(torch.ones(8), group=pg, async_op=True)
            assert (_C._fast_calls() - before) == (1 if path == "fast" else 0), path
            with pytest.raises(Exception) as info:
                w.wait()
            got[path] = (type(info.value), str(info.value))
        dist.barrier()  # torch's own group: the others wait here while rank 0 times out
        sub.abort()
    if rank == 0:
        (fast_t, fast_m), (py_t, py_m) = got["fast"], got["python"]
        assert fast_t is py_t and issubclass(fast_t, TimeoutError), (fast_t, py_t)
        assert "all_reduce" in fast_m and "all_reduce" in py_m, (fast_m, py_m)


def test_process_group_fast_path(world):
    world(process_group_fast_path, 2)


def test_process_group_wait_errors(world):
    world(process_group_wait_errors, 2)


def test_process_group_fast_path_world3(world):
    world(process_group_fast_path, 3)


def test_process_group_ops(world):
    world(process_group_ops, 2)


def test_process_group_ops_world3(world):
    world(process_group_ops, 3)


def _model(seed, dev="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).to(dev)


def _train(model, rank, steps=3, dev="cpu"):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(77 + rank)
    for _ in range(steps):
        x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 8, generator=gen)
        x, y = x.to(dev), y.to(dev)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.detach()


def ddp_and_fsdp2(comm, rank, size):
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = comm.get_device()
    pg = _create_torchcomm_process_group(comm, "fc_ddp")
    # DDP: the same steps over our group and over torch's own default group, bit for bit
    ours, theirs = DDP(_model(5, dev), process_group=pg), DDP(_model(5, dev))
    assert _same(_train(ours, rank, dev=dev), _train(theirs, rank, dev=dev))
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert _same(a.detach(), b.detach())
    # FSDP2 over a 1-D DeviceMesh of our communicator vs torch's own mesh
    mesh = init_device_mesh((comm,), ("dp",))
    assert comm_of(mesh.get_group("dp")) is comm
    ref_mesh = torch_mesh(dev.type, (size,), mesh_dim_names=("dp",))
    models = []
    for m in (mesh, ref_mesh):
        model = _model(9, dev)
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=m)
        fully_shard(model, mesh=m)
        models.append((model, _train(model, rank, dev=dev)))
    (a, loss_a), (b, loss_b) = models
    assert _same(loss_a, loss_b)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert _same(pa.full_tensor(), pb.full_tensor())


def test_ddp_and_fsdp2(world):
    world(ddp_and_fsdp2, 2)


def mesh_2d(comm, rank, size):
    # a 2 x 2 mesh: rank r sits at (r // 2, r % 2); "dp" groups share the column, "sp" the row
    dp = comm.split([rank % 2, rank % 2 + 2], "dp")
    sp = comm.split([2 * (rank // 2), 2 * (rank // 2) + 1], "sp")
    mesh = init_device_mesh((dp, sp), ("dp", "sp"), _global_comm=comm)
    assert list(mesh.get_coordinate()) == [rank // 2, rank % 2], mesh.get_coordinate()
    assert comm_of(mesh.get_group("dp")) is dp and comm_of(mesh.get_group("sp")) is sp
    assert dist.get_process_group_ranks(mesh.get_group("sp")) == [
        2 * (rank // 2),
        2 * (rank // 2) + 1,
    ]
    assert mesh["sp"].get_local_rank() == rank % 2
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=mesh.get_group("sp"))
    assert _same(t, torch.full((3,), float(4 * (rank // 2) + 1)))
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=mesh["dp"].get_group())
    assert _same(t, torch.full((3,), float(2 * (rank % 2) + 2)))
    # UlyssesGroup over a mesh dimension runs on that dimension's communicator
    from fastcomms.ulysses import UlyssesGroup

    g = UlyssesGroup(mesh["sp"])
    assert g.group is sp and g.transport == "collective"
    x = torch.randn(2, 3, 4, 8, generator=torch.Generator().manual_seed(rank))
    assert _same(g.all_to_all_4d(x), UlyssesGroup(sp).all_to_all_4d(x))
    # both dimensions flattened onto the global communicator (torchcomms' _flatten_with_comm)
    from fastcomms.device_mesh import _flatten_with_comm

    flat = _flatten_with_comm(mesh, "dp_sp", comm, list(range(size)), mesh._layout)
    assert mesh._get_root_mesh()._flatten_mapping["dp_sp"] is flat
    assert comm_of(flat.get_group()) is comm and comm_of(mesh["dp_sp"].get_group()) is comm
    assert flat.get_local_rank() == rank
    t = torch.full((2,), float(rank))
    dist.all_reduce(t, group=flat.get_group())
    assert _same(t, torch.full((2,), float(sum(range(size)))))


def test_mesh_2d(world):
    world(mesh_2d, 4)


def functional_compiled(comm, rank, size):
    from fastcomms import functional as fcf

    w, dev = dist.group.WORLD, comm.get_device()
    x = torch.randn(2 * size, 3, generator=torch.Generator().manual_seed(rank)).to(dev)

    # compiled first (no eager call on this communicator before), fullgraph, forward and backward
    def f(t):
        a = fcf.all_reduce(t, "sum", comm)
        g = fcf.all_gather_tensor_autograd(t * 2, 0, comm)
        r = fcf.reduce_scatter_tensor_autograd(g, "sum", 0, comm)
        s = fcf.all_to_all_single_autograd(r + 1, None, None, comm)
        return a, g, s

    import torch._dynamo.utils as dynamo_utils

    compiled = torch.compile(f, fullgraph=True, backend="inductor")
    xr = x.clone().requires_grad_(True)
    a, g, s = compiled(xr)
    frames = dynamo_utils.counters["frames"]["ok"]
    for i in range(10):  # fresh data of the same shape: no recompilation
        compiled(torch.randn(2 * size, 3, generator=torch.Generator().manual_seed(i)).to(dev))
    assert dynamo_utils.counters["frames"]["ok"] == frames, dynamo_utils.counters["frames"]
    assert _same(a, funcol.all_reduce(x, "sum", w).wait())
    assert _same(g, funcol.all_gather_tensor(x * 2, 0, w).wait())
    want_r = funcol.reduce_scatter_tensor(funcol.all_gather_tensor(x * 2, 0, w), "sum", 0, w)
    assert _same(s, funcol.all_to_all_single(want_r.wait() + 1, None, None, w).wait())
    s.sum().backward()
    # d sum(s) / d t: the all-to-all and the reduce-scatter pass ones back, the all-gather's
    # backward sums them over the ranks, times the 2 of t * 2
    assert _same(xr.grad, torch.full_like(x, 2.0 * size))
    # eager: the same ops, results wait on first use
    assert _same(fcf.broadcast(x, 0, comm).wait(), funcol.broadcast(x, 0, w).wait())
    assert _same(
        fcf.all_reduce(x, fastcomms_sum(), comm) + 0, funcol.all_reduce(x, "sum", w).wait()
    )


def fastcomms_sum():
    from fastcomms import ReduceOp

    return ReduceOp.SUM


def test_functional_compiled(world):
    world(functional_compiled, 2)


def tensor_parallel(comm, rank, size):
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dev = comm.get_device()
    mesh = init_device_mesh((comm,), ("tp",))
    model, ref = _model(3, dev), _model(3, dev)
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(11)).to(dev)  # same everywhere
    y, want = model(x), ref(x)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    y.sum().backward()
    want.sum().backward()
    full = model[0].weight.grad.full_tensor()  # a DTensor sharded over our communicator
    torch.testing.assert_close(full, ref[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_tensor_parallel(world):
    world(tensor_parallel, 2)


def compiled_step_in_cuda_graph(comm, rank, size):
    """A compiled training-like step (matmul, all_reduce, all_gather over the communicator)
    captured in a CUDA graph and replayed on fresh data: the same bits as the compiled step run
    eagerly, and as torch's own collectives on the same data (GPU tier only)."""
    from fastcomms import functional as fcf

    dev, w = comm.get_device(), dist.group.WORLD
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(5)).to(dev)

    def step(x):
        h = fcf.all_reduce(x @ weight, "sum", comm)
        return fcf.all_gather_tensor(torch.relu(h), 0, comm)

    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    static_x = torch.randn(8, 64, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        for _ in range(3):
            compiled(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = compiled(static_x)
    for i in range(4):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * i + rank)).to(dev)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert _same(static_out, compiled(x)), i
        want = funcol.all_gather_tensor(
            torch.relu(funcol.all_reduce(x @ weight, "sum", w).wait()), 0, w
        ).wait()
        torch.testing.assert_close(static_out, want, rtol=1e-5, atol=1e-5)
    del graph
    torch.cuda.synchronize()


def test_nvlink_is_a_torch_backend_name():
    """NOTE [nvlink as a torch.distributed backend]: `import fastcomms` registers "nvlink" with
    torch.distributed where the build has it, for CUDA only, and leaves torch's defaults alone
    (the GPU tier runs a process group over it: test_one_gpu.py)."""
    import fastcomms
    import torch.distributed as dist

    if not fastcomms.is_backend_built("nvlink"):
        pytest.skip("this build has no nvlink backend (no CUDA)")
    assert "nvlink" in dist.Backend.backend_list
    assert dist.Backend.backend_capability["nvlink"] == ["cuda"]
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"
    assert dist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert fastcomms._register_nvlink_name()  # idempotent
    assert dist.Backend.backend_list.count("nvlink") == 1


def test_nvlink_name_registered_when_torch_imports_fastcomms(tmp_path):
    """The same where torch imports fastcomms while it imports torch.distributed (README's
    `torchcomms` alias, found by torch's torchcomms switch): the name is registered once the
    registry exists."""
    import subprocess
    import sys

    import fastcomms

    if not fastcomms.is_backend_built("nvlink"):
        pytest.skip("this build has no nvlink backend (no CUDA)")
    alias = tmp_path / "torchcomms"
    alias.mkdir()
    (alias / "__init__.py").write_text(
        "import sys\nimport fastcomms\nimport fastcomms._comms\n"
        "sys.modules['torchcomms._comms'] = fastcomms._comms\nfrom fastcomms import *\n"
    )
    code = (
        "import sys, torch\n"
        "assert 'fastcomms' in sys.modules, 'torch did not import the alias'\n"
        "import torch.distributed as dist\n"
        "assert 'nvlink' in dist.Backend.backend_list\n"
        "assert dist.Backend.backend_list.count('nvlink') == 1\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_group_constructors_refuse_a_mesh_of_two_dimensions():
    """UlyssesGroup and RingGroup take a 1-D DeviceMesh; a 2-D one is refused by name, with the
    slice to take, before any group is looked up."""
    from fastcomms.ring import RingGroup
    from fastcomms.ulysses import UlyssesGroup

    class Mesh2D:
        mesh, ndim = None, 2

        def get_group(self):
            raise AssertionError("a 2-D mesh's group was looked up")

    for cls, dim in ((UlyssesGroup, "sp"), (RingGroup, "ring")):
        want = rf"{cls.__name__}: a DeviceMesh must be 1-D \(slice it, mesh\['{dim}'\]\), got 2 "
        with pytest.raises(ValueError, match=want):
            cls(Mesh2D())
