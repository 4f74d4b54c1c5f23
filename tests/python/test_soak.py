# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Soak (issue 16): random sequences of collectives and Ulysses calls on gloo, random sizes and
dtypes, async handles sometimes dropped unwaited, every waited result checked against values each
rank computes for every rank on its own; after a warm-up, resident memory, open file descriptors
and threads must stay flat. Bounded by FASTCOMMS_SOAK_S seconds (default 30; set it higher for a
long run). The GPU soak (scripts/gpu.sh) runs the same on the nccl and nvlink backends, one
GPU per rank, with the CUDA caching allocator's allocated bytes flat as well (FASTCOMMS_SOAK_GPU_S,
default 20)."""

import os
import random
import time

import pytest
import torch
from fastcomms import ReduceOp
from fastcomms.ulysses import UlyssesGroup


def _value(seed, step, r, n, dtype):
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + r)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)  # exact in every dtype used


def _usage():
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    return (
        rss_pages * os.sysconf("SC_PAGE_SIZE"),
        len(os.listdir("/proc/self/fd")),
        len(os.listdir("/proc/self/task")),
    )


def soak(comm, rank, size, device=None, budget=None):
    dev = torch.device("cpu") if device is None else device
    cuda = dev.type == "cuda"
    budget = budget or float(os.environ.get("FASTCOMMS_SOAK_S", "30"))
    seed = torch.tensor([random.randrange(1 << 30)], device=dev)
    comm.broadcast(seed, 0, False)
    seed = int(seed.cpu())
    shared = random.Random(seed)  # the same choices on every rank
    local = random.Random(seed + 7919 * (rank + 1))  # which handles this rank drops
    group = UlyssesGroup(comm)
    start, step, checked, dropped = time.monotonic(), 0, 0, 0
    baseline, samples = None, []
    while True:
        if step % 25 == 0:  # rank 0's clock decides, every rank follows
            go = torch.tensor([1 if time.monotonic() - start < budget else 0], device=dev)
            comm.broadcast(go, 0, False)
            if not go.item():
                break
            usage = _usage() + ((torch.cuda.memory_allocated(dev),) if cuda else (0,))
            if baseline is None and time.monotonic() - start > 0.25 * budget:
                baseline = usage  # after the warm-up
            elif baseline is not None:
                samples.append(usage)
        step += 1
        kind = shared.choice(["all_reduce", "broadcast", "gather", "scatter", "a2a", "ulysses"])
        dtype = shared.choice([torch.float32, torch.int32, torch.float64])
        n = size * shared.choice([1, 7, 64, 1000, 40_000])
        async_op = shared.random() < 0.5
        drop = async_op and local.random() < 0.3
        mine = _value(seed, step, rank, n, dtype).to(dev)
        everyone = [_value(seed, step, q, n, dtype).to(dev) for q in range(size)]
        if kind == "all_reduce":
            out = mine.clone()
            w = comm.all_reduce(out, ReduceOp.SUM, async_op)
            want = sum(everyone)
        elif kind == "broadcast":
            root = shared.randrange(size)
            out = mine.clone()
            w = comm.broadcast(out, root, async_op)
            want = everyone[root]
        elif kind == "gather":
            out = torch.full((n * size,), -1, dtype=dtype, device=dev)
            w = comm.all_gather_single(out, mine, async_op)
            want = torch.cat(everyone)
        elif kind == "scatter":
            out = torch.full((n // size,), -1, dtype=dtype, device=dev)
            w = comm.reduce_scatter_single(out, mine.clone(), ReduceOp.SUM, async_op)
            want = sum(everyone).chunk(size)[rank]
        elif kind == "a2a":
            out = torch.full((n,), -1, dtype=dtype, device=dev)
            w = comm.all_to_all_single(out, mine, async_op)
            want = torch.cat([e.chunk(size)[rank] for e in everyone])
        else:  # the Ulysses op, mode 0: (1, s, h*size, d) -> (1, s*size, h, d)
            # the NVLink path needs rows of a multiple of 16 bytes; the CPU path takes any d
            d = shared.choice([4, 8] if cuda else [1, 8])
            s, h = shared.choice([1, 3]), shared.choice([1, 2])
            if n < s * h * size * d:  # too few values for this shape (the same on every rank)
                continue
            xs = [v[: s * h * size * d].view(1, s, h * size, d) for v in everyone]
            if async_op:
                w = group.all_to_all_4d_async(xs[rank])
                out = None
            else:
                out, w = group.all_to_all_4d(xs[rank]), None
            want = torch.cat([x[:, :, rank * h : (rank + 1) * h] for x in xs], dim=1)
        if drop:
            dropped += 1
            del w, out  # nothing waits; the op must still not corrupt anything
            continue
        if kind == "ulysses":
            out = w.wait() if w is not None else out
        elif async_op:
            w.wait()
        assert torch.equal(out, want), (step, kind, dtype, n, async_op)
        checked += 1
    comm.barrier(False)
    if cuda:
        torch.cuda.synchronize(dev)
        group.check_errors()
    assert checked > 20, f"only {checked} checked steps in {budget} s"
    if baseline is not None and samples:
        rss0, fds0, tasks0, gpu0 = baseline
        rss, fds, tasks, gpu = (max(s[i] for s in samples) for i in range(4))
        assert gpu - gpu0 < 64 << 20, f"CUDA memory grew {(gpu - gpu0) >> 20} MiB after warm-up"
        assert rss - rss0 < 96 << 20, f"RSS grew {(rss - rss0) >> 20} MiB after the warm-up"
        assert fds - fds0 <= 2, f"open files grew from {fds0} to {fds}"
        assert tasks - tasks0 <= 2, f"threads grew from {tasks0} to {tasks}"
    print(
        f"[soak rank {rank} {dev}] {step} steps, {checked} checked, {dropped} dropped, seed {seed}"
    )


@pytest.mark.parametrize("size", [2])
def test_soak_random_ops_with_dropped_handles(world, size):
    world(soak, size)


def _gpu_soak_rank(rank, size, path, errq, backend):
    import datetime
    import traceback

    import fastcomms
    import torch.distributed as dist

    try:
        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        comm = fastcomms.new_comm(
            backend,
            dev,
            "soak",
            store=dist.FileStore(path, size),
            timeout=datetime.timedelta(seconds=60),
        )
        soak(comm, rank, size, dev, float(os.environ.get("FASTCOMMS_SOAK_GPU_S", "20")))
        comm.finalize()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (the GPU soak runs in scripts/gpu.sh)",
)
@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_soak_gpu_backends(backend):
    import fastcomms
    from conftest import spawn

    if backend not in fastcomms.built_backends():
        pytest.skip(f"this build has no {backend} backend")
    spawn(_gpu_soak_rank, 2, backend, timeout=240)
