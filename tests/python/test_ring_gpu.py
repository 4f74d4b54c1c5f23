# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier of fastcomms.ring (issue 37, item 2): RingGroup's window transport on an "nvlink"
communicator (puts into the next rank's window, no NCCL call per step), bit-exact against
torch.distributed NCCL isend/irecv; its double buffer, window growth, reverse steps and an
exchange in flight beside compute; the collective transport on CUDA (a fastcomms nccl
communicator, torch's NCCL group); the USP example's attention on CUDA (flash blocks in bfloat16,
plain-torch blocks in float32) against single-process attention; and an armed control (the
exchange without its signal waits, the put held back 50 ms) that must read poison on every run.

Needs two or more GPUs: an nvlink communicator holds an inner NCCL communicator, and NCCL refuses
two ranks on one GPU, so ranks cannot share a GPU here (the MPS route of test_ulysses_gpu.py does
not apply). Skipped, saying why, elsewhere."""

import os
import traceback

import pytest
import torch
from conftest import _hang_guard, gpu_rank, spawn

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA (the GPU tier runs in scripts/gpu.sh)"
    ),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.device_count() < 2,
        reason="needs 2 GPUs: an nvlink communicator's inner NCCL refuses two ranks on one GPU",
    ),
    pytest.mark.skipif(
        not __import__("fastcomms")._C.has_transport("nvlink"),
        reason="the extension was built without CUDA",
    ),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DTYPES = [torch.bfloat16, torch.float32, torch.float16, torch.int32, torch.uint8, torch.float64]


def _data(step, rank, i, shape, dtype, dev):
    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + i)
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), generator=g)
    return raw.to(torch.uint8).view(dtype).view(shape).to(dev)


def _same(a, b):
    a, b = a.detach().contiguous().cpu(), b.detach().contiguous().cpu()
    return a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _nccl_reference(tensors, rank, size, reverse):
    import torch.distributed as dist

    dst = (rank - 1) % size if reverse else (rank + 1) % size
    src = (rank + 1) % size if reverse else (rank - 1) % size
    out = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, dst) for t in tensors]
    ops += [dist.P2POp(dist.irecv, o, src) for o in out]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    return out


def _check_ring(ring, rank, size, dev, label):
    checks = 0
    step = 0
    # growing shapes (the window grows on every rank at the same step), every dtype, both ways
    for rows in (4, 1024, 16, 65536):
        for reverse in (False, True):
            shapes = [((rows, 24), d) for d in DTYPES]
            mine = [_data(step, rank, i, s, d, dev) for i, (s, d) in enumerate(shapes)]
            got = ring.exchange(mine, reverse=reverse).wait()
            ref = _nccl_reference(mine, rank, size, reverse)
            src = (rank + 1) % size if reverse else (rank - 1) % size
            for i, (s, d) in enumerate(shapes):
                assert _same(got[i], ref[i]), f"{label} step {step} tensor {i} vs NCCL"
                assert _same(got[i], _data(step, src, i, s, d, dev)), f"{label} step {step}"
                checks += 1
            step += 1
    # the double buffer: the last two results intact, step k+2 in step k's memory
    prev = (rank - 1) % size
    shape = ((4096, 128), torch.bfloat16)
    res = []
    for k in range(3):
        res.append(ring.exchange([_data(200 + k, rank, 0, *shape, dev)]).wait())
    torch.cuda.synchronize()
    assert res[2][0].data_ptr() == res[0][0].data_ptr()
    assert _same(res[1][0], _data(201, prev, 0, *shape, dev)), f"{label}: step k+1 overwritten"
    assert _same(res[2][0], _data(202, prev, 0, *shape, dev))
    # a ring-attention loop: 2 * size steps, each in flight beside a matmul on the current stream
    kv = [_data(300, rank, 0, (8192, 256), torch.bfloat16, dev)]
    a = torch.randn(2048, 2048, device=dev)
    for k in range(2 * size):
        w = ring.exchange(kv)
        a = a @ a
        a = a / a.norm()
        kv = w.wait()
        src = (rank - k - 1) % size
        assert _same(kv[0], _data(300, src, 0, (8192, 256), torch.bfloat16, dev)), (label, k)
        checks += 1
    return checks + 2


def _worker(rank, size, path, errq):
    _hang_guard()
    try:
        import datetime

        import fastcomms
        import torch.distributed as dist
        from fastcomms.ring import RingGroup
        from fastcomms.sequence_parallel import SequenceParallelGroup

        dev, comm = gpu_rank(rank, size, path, "nvlink", "ring")
        ring = RingGroup(comm)
        assert ring.transport == "window", ring.transport_reason
        checks = _check_ring(ring, rank, size, dev, "window")
        ring.destroy()
        # the collective transport on CUDA: a fastcomms nccl communicator, torch's NCCL group
        nccl = fastcomms.new_comm(
            "nccl",
            dev,
            "ring_nccl",
            store=dist.PrefixStore("fc_nccl", dist.distributed_c10d._get_default_store()),
            timeout=datetime.timedelta(seconds=60),
        )
        for label, g in (("nccl comm", RingGroup(nccl)), ("torch nccl", RingGroup())):
            assert g.transport == "collective", g.transport_reason
            checks += _check_ring(g, rank, size, dev, label)
        # armed control: without its signal waits, rank 1 reads its slot before rank 0's put,
        # held back 50 ms behind a sleep, has landed: it must read the poison
        armed = RingGroup(comm)
        armed._armed_unordered = True
        n = 1 << 20
        first = armed.exchange([torch.zeros(n, device=dev)]).wait()  # grows the window
        torch.cuda.synchronize()
        dist.barrier()
        first[0].fill_(-1.0)  # poison in this rank's slot 0, where step 2 lands
        armed.exchange([torch.zeros(n, device=dev)]).wait()
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 0:
            torch.cuda._sleep(100_000_000)  # ~50 ms: rank 0's put to rank 1 comes late
        got = armed.exchange([torch.full((n,), float(rank), device=dev)]).wait()
        early = got[0].clone()  # read at once on the current stream
        torch.cuda.synchronize()
        tore = not torch.equal(early, torch.full_like(early, float((rank - 1) % size)))
        dist.barrier()
        armed.destroy()
        # USP attention on CUDA: a ring over every rank, and (2 x size/2) where it divides
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "usp_attention", os.path.join(ROOT, "examples", "usp_attention.py")
        )
        ex = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(ex)
        grids = [(size, 1)] + ([(2, size // 2)] if size % 2 == 0 and size > 2 else [])
        for grid in grids:
            sp = SequenceParallelGroup(grid, group=comm)
            assert sp.ring.transport == ("window" if grid[0] > 1 else "collective")
            log = print if rank == 0 else (lambda *a: None)
            ex.run_checks(sp, seq=256 * size, dim=64, dtype=torch.bfloat16, device=dev, log=log)
            ex.run_checks(sp, seq=64 * size, dim=32, dtype=torch.float32, device=dev, log=log)
            torch.cuda.synchronize()
            sp.destroy()
        if rank == 1:
            assert tore, "rank 1: the armed control did not read poison (the test cannot fail)"
        torch.cuda.synchronize()
        nccl.finalize()
        comm.finalize()
        dist.destroy_process_group()
        print(f"[rank {rank}/{size}] ring on GPU: {checks} checks bit-exact; armed control tore")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("size", [2, 4])
def test_ring_gpu(size):
    if torch.cuda.device_count() < size:
        pytest.skip(f"needs {size} GPUs, {torch.cuda.device_count()} here")
    spawn(_worker, size, timeout=300)
