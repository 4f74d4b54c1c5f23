# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier: ``device_alltoallv_single`` (issue 52; NOTE [device all-to-all-v] in
include/fastcomms/cuda/device_a2av.hpp) with 2, 3 and 4 ranks sharing GPU 0 as MPS clients, on
nvlink communicators whose inner NCCL communicator is never made (hint nvlink.lazy_nccl: NCCL
refuses two ranks on one GPU; NOTE [nvlink lazy nccl]).

Every result is compared byte for byte with torch.distributed.all_to_all_single over gloo (host
split sizes, the rows as bytes), outputs poisoned first and followed by guard rows that must stay
poisoned. Counts are random with zeros, one rank receiving everything, and all zero; dtypes of
1, 2, 3 (int8 rows of 3), 4, 8 and 16 bytes. A CUDA graph captures one call and is replayed with
new counts copied into the same split tensors. Errors: a count that overflows the output, the
input or the receive buffers, and counts that disagree between sender and receiver, are raised on
every rank by its next call (a device_alltoallv_single or another op), never written past a
buffer, and the group goes on. No host sync: calls run under
``torch.cuda.set_sync_debug_mode("error")``, whose armed control (a ``.tolist()`` of the splits)
must raise. Skipped (saying why) without CUDA, MPS or a CUDA build."""

import datetime
import os
import traceback

import pytest
import torch
from conftest import _hang_guard, init_rank, spawn
from test_ulysses_gpu import mps_daemon  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the GPU tier runs in scripts/gpu.sh)",
)

# (dtype, shape of one row): row bytes 256, 2 * 24, 3, 4 * 5, 8 * 2, 16 * 1
_DTYPES = [
    (torch.bfloat16, (128,)),
    (torch.float16, (4, 6)),
    (torch.int8, (3,)),
    (torch.float32, (5,)),
    (torch.float64, (2,)),
    (torch.complex128, ()),
]
_GUARD_ROWS = 3
_POISON = 0xA5


def _comm(rank, size, path, name="a2av"):
    import fastcomms
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = init_rank(rank, size, path)  # torch.distributed over gloo: the reference
    comm = fastcomms.new_comm(
        "nvlink",
        torch.device("cuda", 0),
        name,
        store=dist.PrefixStore("fc", store),
        timeout=datetime.timedelta(seconds=60),
        hints={"nvlink.lazy_nccl": "1"},
    )
    return store, comm


def _shared_seed(store, rank):
    if rank == 0:
        store.set("a2av_seed", str(int.from_bytes(os.urandom(4), "little")))
    return int(store.get("a2av_seed"))


def _matrix(kind, size, gen):
    """counts[p][q]: rows rank p sends rank q."""
    if kind == "random":
        m = torch.randint(0, 40, (size, size), generator=gen)
        m[torch.rand((size, size), generator=gen) < 0.3] = 0  # zeros
        return m
    if kind == "one_receiver":  # rank size - 1 receives everything, the others nothing
        m = torch.zeros((size, size), dtype=torch.int64)
        m[:, size - 1] = torch.randint(1, 200, (size,), generator=gen)
        return m
    if kind == "zeros":
        return torch.zeros((size, size), dtype=torch.int64)
    if kind == "uniform":
        return torch.full((size, size), 16, dtype=torch.int64)
    raise AssertionError(kind)


def _rows(n, dtype, row, gen):
    """n random rows of `dtype` with row shape `row` (random bytes, any dtype)."""
    inner = 1
    for d in row:
        inner *= d
    nbytes = n * inner * torch.empty((), dtype=dtype).element_size()
    b = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    return b.view(dtype).reshape((n, *row))


def _as_bytes(t):
    """Rows as bytes, (rows, row bytes) uint8, also for a tensor of no rows."""
    row_bytes = t.element_size()
    for d in t.shape[1:]:
        row_bytes *= d
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], row_bytes)


def _reference(x_cpu, counts, rank, row_bytes):
    """torch.distributed.all_to_all_single over gloo, rows as bytes."""
    import torch.distributed as dist

    send = [int(c) for c in counts[rank]]
    recv = [int(c) for c in counts[:, rank]]
    xb = x_cpu.contiguous().view(torch.uint8).reshape(-1, row_bytes)[: sum(send)].contiguous()
    out = torch.empty((sum(recv), row_bytes), dtype=torch.uint8)
    dist.all_to_all_single(out, xb, recv, send)
    return out


def _case(comm, counts, rank, dtype, row, gen, dev, slack_in=2):
    """One eager call against the reference: (ok, what)."""
    send, recv = counts[rank], counts[:, rank]
    x = _rows(int(send.sum()) + slack_in, dtype, row, gen)
    buf = torch.full(
        (int(recv.sum()) + _GUARD_ROWS, *row), 0, dtype=dtype, device=dev
    )  # output rows, then guard rows
    buf.view(torch.uint8).fill_(_POISON)
    out = buf[: int(recv.sum())]
    comm.device_alltoallv_single(out, x.to(dev), recv.to(dev), send.to(dev), False)
    row_bytes = _as_bytes(buf).shape[1] if buf.numel() else 0
    want = _reference(x, counts, rank, max(row_bytes, 1))
    got = _as_bytes(buf.cpu())
    assert torch.equal(got[: want.shape[0]], want), f"{dtype}{row}: rows differ from gloo's"
    assert bool((got[want.shape[0] :] == _POISON).all()), f"{dtype}{row}: guard rows written"


def _exact_worker(rank, size, path, errq):
    """Random, skewed and empty counts in every dtype, eager; then a CUDA graph replayed with
    new counts in the same split tensors, with eager calls between replays."""
    _hang_guard()
    try:
        store, comm = _comm(rank, size, path)
        dev = torch.device("cuda", 0)
        seed = _shared_seed(store, rank)
        gen = torch.Generator().manual_seed(seed)  # the same counts on every rank
        data = torch.Generator().manual_seed(seed * 31 + rank)  # this rank's rows
        # first call: sizes the buffers from its outputs (no prepare)
        _case(comm, _matrix("uniform", size, gen), rank, torch.bfloat16, (128,), data, dev)
        comm.device_alltoallv_prepare(1 << 20)
        checks = 1
        for kind in ("random", "one_receiver", "zeros", "random"):
            for dtype, row in _DTYPES:
                _case(comm, _matrix(kind, size, gen), rank, dtype, row, data, dev)
                checks += 1
        # async: a work whose wait orders the current stream
        counts = _matrix("random", size, gen)
        send, recv = counts[rank], counts[:, rank]
        x = _rows(int(send.sum()), torch.float32, (7,), data)
        out = torch.full((int(recv.sum()), 7), -1.0, device=dev)
        w = comm.device_alltoallv_single(out, x.to(dev), recv.to(dev), send.to(dev), True)
        w.wait()
        want = _reference(x, counts, rank, 28)
        assert torch.equal(_as_bytes(out.cpu()), want), "async call"
        checks += 1
        # NOTE [indexed push] (fastcomms.moe's private form): the rows the splits count read
        # through an index into a larger input, out-of-range entries sending zero rows
        from fastcomms import _device_a2av

        for dtype, row in ((torch.float32, (7,)), (torch.bfloat16, (128,))):
            counts = _matrix("random", size, gen)
            send, recv = counts[rank], counts[:, rank]
            n_log, n_phys = int(send.sum()) + 2, int(send.sum()) + 5
            phys = _rows(n_phys, dtype, row, data)
            index = torch.randint(0, n_phys, (n_log,), generator=data)
            if n_log > 2:
                index[0], index[-2] = -1, n_phys  # outside: zero rows
            logical = phys[index.clamp(0, n_phys - 1)]
            logical[(index < 0) | (index >= n_phys)] = 0
            buf = torch.empty((int(recv.sum()) + _GUARD_ROWS, *row), dtype=dtype, device=dev)
            buf.view(torch.uint8).fill_(_POISON)
            out = buf[: int(recv.sum())]
            _device_a2av.issue(
                comm._c, out, phys.to(dev), recv.to(dev), send.to(dev), False, None, index.to(dev)
            )
            row_bytes = _as_bytes(buf).shape[1]
            want = _reference(logical, counts, rank, row_bytes)
            got = _as_bytes(buf.cpu())
            assert torch.equal(got[: want.shape[0]], want), f"indexed {dtype}{row}: rows differ"
            assert bool((got[want.shape[0] :] == _POISON).all()), f"indexed {dtype}: guard rows"
            # the control: without the index the ranks' rows would be others (random data);
            # the reference is collective, so every rank computes it
            plain = _reference(phys, counts, rank, row_bytes)
            assert not want.numel() or not torch.equal(plain, want), "control"
            checks += 1

        # CUDA graph: one capture, replays with new counts written into the same tensors
        rows_max, row = 64 * size, (32,)
        x_dev = torch.empty((rows_max, *row), dtype=torch.bfloat16, device=dev)
        buf = torch.empty((rows_max + _GUARD_ROWS, *row), dtype=torch.bfloat16, device=dev)
        out = buf[:rows_max]
        in_splits = torch.zeros(size, dtype=torch.int64, device=dev)
        out_splits = torch.zeros(size, dtype=torch.int64, device=dev)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.device_alltoallv_single(out, x_dev, out_splits, in_splits, False)
        for replay in range(6):
            counts = torch.randint(0, 64, (size, size), generator=gen)
            if replay == 2:
                counts = _matrix("one_receiver", size, gen).clamp(max=64)
            if replay == 4:
                counts = _matrix("zeros", size, gen)
            send, recv = counts[rank], counts[:, rank]
            x = _rows(rows_max, torch.bfloat16, row, data)
            x_dev.copy_(x)
            in_splits.copy_(send)
            out_splits.copy_(recv)
            buf.view(torch.uint8).fill_(_POISON)
            graph.replay()
            want = _reference(x, counts, rank, 64)
            got = _as_bytes(buf.cpu())
            n = want.shape[0]
            assert torch.equal(got[:n], want), f"replay {replay}: rows differ"
            assert bool((got[n:] == _POISON).all()), f"replay {replay}: wrote past the rows"
            checks += 1
            if replay % 2:  # an eager call between replays: the device epoch serves both
                _case(comm, _matrix("random", size, gen), rank, torch.int8, (3,), data, dev)
                checks += 1
        torch.cuda.synchronize()
        comm.finalize()
        print(f"[rank {rank}/{size}] device_alltoallv_single: {checks} calls bit-exact vs gloo")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _errors_worker(rank, size, path, errq):
    """Bad counts are raised on every rank by its next call, nothing lands past a buffer, and
    the next good call is exact."""
    _hang_guard()
    try:
        store, comm = _comm(rank, size, path)
        dev = torch.device("cuda", 0)
        gen = torch.Generator().manual_seed(_shared_seed(store, rank))
        data = torch.Generator().manual_seed(rank + 1)
        comm.device_alltoallv_prepare(64 * 1024)  # rows of 64 bytes: 1024 rows per receiver

        def call(counts, out_rows=None, in_rows=None, recv=None):
            send = counts[rank]
            recv = counts[:, rank] if recv is None else recv
            n_out = int(recv.sum()) if out_rows is None else out_rows
            n_in = int(send.sum()) if in_rows is None else in_rows
            x = _rows(n_in, torch.float32, (16,), data)
            buf = torch.empty((n_out + _GUARD_ROWS, 16), device=dev)
            buf.view(torch.uint8).fill_(_POISON)
            comm.device_alltoallv_single(buf[:n_out], x.to(dev), recv.to(dev), send.to(dev), False)
            torch.cuda.synchronize()  # the flag is set before the next host call
            return x, buf

        def next_call_raises(pattern):
            counts = _matrix("random", size, gen)
            with pytest.raises(ValueError, match=pattern):
                call(counts)
            # the call that raised still ran, on every rank: its rows are exact
            x, buf = call(counts)
            want = _reference(x, counts, rank, 64)
            assert torch.equal(_as_bytes(buf.cpu())[: want.shape[0]], want), "after an error"

        good = _matrix("random", size, gen)
        # 1. rank 0's output is one row short of what its output_split_sizes sum to
        recv0 = good[:, 0].clone()
        recv0[size - 1] += 1
        if rank == 0:
            x, buf = call(good, out_rows=int(recv0.sum()) - 1, recv=recv0)
            assert bool((_as_bytes(buf.cpu()) == _POISON).all()), "rank 0 copied past its output"
        else:
            call(good)
        next_call_raises(
            r"output_split_sizes sum to \d+ rows, the output has \d+"
            if rank == 0
            else "rank 0 rejected its output_split_sizes"
        )
        # 2. rank 1 sends more rows than its input holds
        if rank == 1:
            call(good, in_rows=int(good[1].sum()) - 1)
        else:
            call(good)
        next_call_raises(
            r"input_split_sizes sum to \d+ rows, the input has \d+"
            if rank == 1
            else "rank 1 rejected its input_split_sizes"
        )
        # 3. the receiver expects fewer rows than the sender sends: min copied, guard intact
        big = good.clone()
        big[size - 1, 0] += 5
        recv0 = big[:, 0].clone()
        recv0[size - 1] -= 5
        if rank == 0:
            x, buf = call(big, recv=recv0)
            got = _as_bytes(buf.cpu())
            assert bool((got[int(recv0.sum()) :] == _POISON).all()), "mismatch wrote past"
        else:
            call(big)
        next_call_raises(rf"rank 0's output_split_sizes\[{size - 1}\] is \d+ rows")
        # 4. a receiver's buffer overflows: nobody sends to it, every rank says so
        flood = torch.zeros((size, size), dtype=torch.int64)
        flood[:, 0] = 1100  # 1100 rows of 64 bytes per sender: past 64 KiB at rank 0
        flood[0, 0] = 0
        x, buf = call(flood)
        if rank == 0:
            assert bool((_as_bytes(buf.cpu()) == _POISON).all()), "overflowing receiver wrote"
        next_call_raises(r"rank 0 would receive \d+ bytes, its receive buffer holds 65536")
        # 5. the next call of another op reports it too (a post-hook: the op still runs)
        if rank == 0:
            call(good, out_rows=int(good[:, 0].sum()) - 1)
        else:
            call(good)
        a = torch.arange(16 * size, dtype=torch.float32, device=dev) + 1000 * rank
        b = torch.empty_like(a)
        if rank == 0:
            with pytest.raises(ValueError, match="output_split_sizes sum to"):
                comm.all_to_all_single(b, a, False)
        else:
            with pytest.raises(ValueError, match="rank 0 rejected its output_split_sizes"):
                comm.all_to_all_single(b, a, False)
        torch.cuda.synchronize()
        want = torch.cat([torch.arange(16 * rank, 16 * rank + 16) + 1000 * q for q in range(size)])
        assert torch.equal(b.cpu(), want.float()), "the op that reported still ran"
        # the group goes on
        next_call = _matrix("random", size, gen)
        x, buf = call(next_call)
        want = _reference(x, next_call, rank, 64)
        assert torch.equal(_as_bytes(buf.cpu())[: want.shape[0]], want), "after the errors"
        comm.finalize()
        print(f"[rank {rank}/{size}] device_alltoallv_single: 5 flagged errors raised everywhere")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _no_sync_worker(rank, size, path, errq):
    """Under set_sync_debug_mode("error") a call (eager, async, first or not) raises nothing;
    the armed control (reading the splits on the host) must raise."""
    _hang_guard()
    try:
        store, comm = _comm(rank, size, path)
        dev = torch.device("cuda", 0)
        gen = torch.Generator().manual_seed(_shared_seed(store, rank))
        counts = _matrix("random", size, gen)
        send, recv = counts[rank].to(dev), counts[:, rank].to(dev)
        x = torch.randn(int(counts[rank].sum()), 8, device=dev)
        out = torch.empty(int(counts[:, rank].sum()), 8, device=dev)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            comm.device_alltoallv_single(out, x, recv, send, False)  # the first call: setup
            for _ in range(3):
                comm.device_alltoallv_single(out, x, recv, send, False)
            w = comm.device_alltoallv_single(out, x, recv, send, True)
            w.wait()
            # all_to_all_v_single with CUDA split tensors takes the device path
            comm.all_to_all_v_single(out, x, recv, send, False)
            with pytest.raises(RuntimeError, match="synchroniz"):
                send.tolist()  # the control: a host read of the counts
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        want = _reference(x.cpu(), counts, rank, 32)
        got = _as_bytes(out.cpu())
        bad = (got != want).any(1).nonzero().flatten().tolist() if got.shape == want.shape else "-"
        assert torch.equal(got, want), (
            f"rows under sync debug mode: counts {counts.tolist()}, got {tuple(got.shape)}, want "
            f"{tuple(want.shape)}, rows differing "
            f"{bad}"
        )
        comm.finalize()
        print(f"[rank {rank}/{size}] no host sync in 6 calls; the .tolist() control raised")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _two_gpu_worker(rank, size, path, errq, backend):
    """One GPU per rank, on ``backend`` (its NCCL made as usual): random and skewed counts,
    compared with torch.distributed.all_to_all_single on NCCL with host splits, and
    all_to_all_v_single given CUDA split tensors (the device path) against the same."""
    _hang_guard()
    try:
        import fastcomms
        import torch.distributed as dist

        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        store = init_rank(rank, size, path, "nccl", device_id=dev)
        comm = fastcomms.new_comm(
            backend,
            dev,
            "a2av2",
            store=dist.PrefixStore("fc", store),
            timeout=datetime.timedelta(seconds=60),
        )
        gen = torch.Generator().manual_seed(_shared_seed(store, rank))
        comm.device_alltoallv_prepare(1 << 20)
        for kind in ("random", "one_receiver", "zeros", "random"):
            counts = _matrix(kind, size, gen)
            send, recv = counts[rank], counts[:, rank]
            x = torch.randn(int(send.sum()), 64, generator=gen).to(dev, torch.bfloat16)
            want = torch.empty(int(recv.sum()), 64, dtype=torch.bfloat16, device=dev)
            dist.all_to_all_single(want, x, recv.tolist(), send.tolist())
            for method in ("device_alltoallv_single", "all_to_all_v_single"):
                out = torch.full_like(want, float("nan"))
                getattr(comm, method)(out, x, recv.to(dev), send.to(dev), False)
                torch.cuda.synchronize()
                assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (kind, method)
        comm.finalize()
        print(f"[rank {rank}/{size} {backend}] device_alltoallv_single bit-exact vs NCCL")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_device_alltoallv_one_gpu_per_rank(backend):
    import fastcomms

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs (the MPS tests above cover ranks sharing one)")
    if not fastcomms.is_backend_built(backend):
        pytest.skip(f"this build has no {backend} backend")
    spawn(_two_gpu_worker, 2, backend, timeout=200)


def _needs_nvlink():
    import fastcomms

    if not fastcomms.is_backend_built("nvlink"):
        pytest.skip("this build has no nvlink backend")


@pytest.mark.parametrize("size", [2, 3, 4])
def test_device_alltoallv_bit_exact_and_graph_replays(mps_daemon, size):  # noqa: F811
    _needs_nvlink()
    spawn(_exact_worker, size, timeout=300)


@pytest.mark.parametrize("size", [3])
def test_device_alltoallv_flagged_errors(mps_daemon, size):  # noqa: F811
    _needs_nvlink()
    spawn(_errors_worker, size, timeout=300)


def test_device_alltoallv_no_host_sync(mps_daemon):  # noqa: F811
    _needs_nvlink()
    spawn(_no_sync_worker, 2, timeout=200)
