# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier: the nccl and nvlink backends from Python against torch.distributed NCCL, bit-exact,
world 2 (one process per GPU), sync, async and graph-captured. Skipped (saying why) without two
GPUs."""

import datetime
import time
import traceback

import pytest
import torch
from conftest import _hang_guard, gpu_rank, init_rank, spawn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (the GPU tier runs in scripts/gpu.sh)",
)


def _worker(rank, size, path, errq, backend):
    _hang_guard()  # a crash or a hang in native code still names the Python line
    try:
        import torch.distributed as dist
        from fastcomms import ReduceOp

        dev, comm = gpu_rank(rank, size, path, backend, "g")
        g = torch.Generator(device=dev).manual_seed(rank)
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for async_op in (False, True):
                x = torch.randint(-50, 50, (1000,), generator=g, device=dev).to(dtype)
                for op, dop in (
                    (ReduceOp.SUM, dist.ReduceOp.SUM),
                    (ReduceOp.MAX, dist.ReduceOp.MAX),
                ):
                    a, b = x.clone(), x.clone()
                    w = comm.all_reduce(a, op, async_op)
                    w.wait()
                    dist.all_reduce(b, op=dop)
                    assert torch.equal(a, b), (dtype, op)
                a, b = x.clone(), x.clone()
                comm.broadcast(a, 1, async_op).wait()
                dist.broadcast(b, 1)
                assert torch.equal(a, b)
                out, ref = (
                    torch.empty(1000 * size, dtype=dtype, device=dev),
                    torch.empty(1000 * size, dtype=dtype, device=dev),
                )
                comm.all_gather_single(out, x, async_op).wait()
                dist.all_gather_into_tensor(ref, x)
                assert torch.equal(out, ref)
                out, ref = (
                    torch.empty(500, dtype=dtype, device=dev),
                    torch.empty(500, dtype=dtype, device=dev),
                )
                comm.reduce_scatter_single(out, x, ReduceOp.SUM, async_op).wait()
                dist.reduce_scatter_tensor(ref, x)
                assert torch.equal(out, ref)
                out, ref = torch.empty_like(x), torch.empty_like(x)
                comm.all_to_all_single(out, x, async_op).wait()
                dist.all_to_all_single(ref, x)
                assert torch.equal(out, ref)
                # split sizes the two ranks agree on: rank r sends in_s[q] rows to q
                sends = {0: [300, 700], 1: [400, 600]}
                in_s = sends[rank]
                out_s = [sends[0][rank], sends[1][rank]]
                out, ref = (torch.empty(sum(out_s), dtype=dtype, device=dev) for _ in range(2))
                comm.all_to_all_v_single(out, x, out_s, in_s, async_op).wait()
                dist.all_to_all_single(ref, x, out_s, in_s)
                assert torch.equal(out, ref)
                comm.barrier(async_op).wait()
        # CUDA graph: a captured sync all_reduce replays bit-exact
        t = torch.zeros(4096, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            comm.all_reduce(t, ReduceOp.SUM, False)  # warm-up outside the graph
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.all_reduce(t, ReduceOp.SUM, False)
        for rep in range(3):
            t.copy_(torch.full((4096,), float(rank + rep), device=dev))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(
                t, torch.full((4096,), float(sum(r + rep for r in range(size))), device=dev)
            )
        # a barrier through the process group blocks the host until the stream's earlier work
        # is done, as torch's NCCL process group does (code flushes stream work that way)
        from fastcomms.device_mesh import _create_torchcomm_process_group

        pg = _create_torchcomm_process_group(comm, f"barrier_{backend}")
        torch.cuda._sleep(1_000_000_000)  # ~0.5 s on the stream
        assert not torch.cuda.current_stream().query()
        opts = dist.BarrierOptions()
        opts.device = dev
        pg.barrier(opts=opts).wait()
        assert torch.cuda.current_stream().query(), "the barrier's wait did not block the host"
        # NCCL waits for the graphs that captured a communicator's kernels to go before the
        # communicator can be destroyed: release the graph first (as with torch's own NCCL).
        del graph
        torch.cuda.synchronize()
        comm.finalize()
        del comm
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_backend_matches_torch_distributed_nccl(backend):
    """nvlink: all_to_all_single peer-to-peer over NVLink, the rest through its inner nccl."""
    spawn(_worker, 2, backend, timeout=200)


def _window_worker(rank, size, path, errq, backend):
    """Windows on the nvlink and nccl backends: puts land where they should, a signal orders the
    sender's put before the receiver's read, and an armed control whose signal is not ordered
    after its put (the put held back 50 ms behind a sleep) reads poison, on every run. On nccl
    the window's tensor comes from the backend's allocator in a MemPool, as torchcomms' tests
    make it; on nvlink from PyTorch's caching allocator."""
    _hang_guard()
    try:
        import fastcomms
        import torch.distributed as dist

        dev = torch.device("cuda", rank)
        torch.cuda.set_device(dev)
        store = init_rank(rank, size, path)
        comm = fastcomms.new_comm(
            backend,
            dev,
            store=dist.PrefixStore("fc", store),
            name="w",
            timeout=datetime.timedelta(seconds=60),
        )
        n, peer = 8192, 1 - rank
        if backend == "nccl":
            pool = torch.cuda.MemPool(comm.get_mem_allocator())
            with torch.cuda.use_mem_pool(pool):
                buf = torch.full((size * n,), -1.0, device=dev)  # poison
        else:
            buf = torch.full((size * n,), -1.0, device=dev)  # poison
        win = comm.new_window(buf)
        assert win.get_size() == buf.numel() * 4 and win.dtype == torch.float32

        def data(r, round_):
            g = torch.Generator().manual_seed(1000 * round_ + r)
            return torch.randn(n, generator=g).to(dev)

        side = torch.cuda.Stream()
        results = {}
        for round_, armed in ((1, False), (2, True), (3, False)):
            torch.cuda.synchronize()
            dist.barrier()  # every put of the last round has landed
            buf.fill_(-1.0)
            torch.cuda.synchronize()
            dist.barrier()  # every buffer is poisoned before any put of this round
            # the source is made first: a pageable host-to-device copy behind the sleep would
            # wait for it on the host, and the armed put would no longer come late
            src = data(rank, round_)
            torch.cuda._sleep(100_000_000)  # ~50 ms: the put below comes late
            win.put(src, peer, rank * n, False)
            if armed:  # the fault: the signal does not wait for the put
                with torch.cuda.stream(side):
                    win.signal(peer, False)
            else:
                win.signal(peer, False)
            with torch.cuda.stream(side):  # the reader does not sit behind this rank's sleep
                win.wait_signal(peer, False)
                got = buf[peer * n : (peer + 1) * n].clone()
            torch.cuda.synchronize()
            win.check_errors()
            results[round_] = torch.equal(got, data(peer, round_))
            dist.barrier()
        assert results[1] and results[3], f"rank {rank}: a signalled put was not visible {results}"
        assert not results[2], f"rank {rank}: the armed control did not tear (the test cannot fail)"
        # the peer's buffer mapped here holds what this rank put there last
        remote = win.map_remote_tensor(peer)
        assert remote.shape == buf.shape and torch.equal(
            remote[rank * n : (rank + 1) * n], data(rank, 3)
        )
        # bad arguments raise before anything is enqueued
        with pytest.raises(ValueError, match="do not fit the window"):
            win.put(data(rank, 0), peer, size * n, False)
        with pytest.raises(ValueError, match=r"dst_rank must be in \[0, 2\)"):
            win.put(data(rank, 0), 5, 0, False)
        with pytest.raises(TypeError, match="the window holds torch.float32"):
            win.put(data(rank, 0).double(), peer, 0, False)
        # torchcomms' window attributes
        attr = win.get_attr(peer)
        assert attr.access_type == fastcomms.TorchCommWinAccessType.WIN_ACCESS_TYPE_UNIFIED
        assert win.get_tensor() is buf and win.shape == [size * n] and win.device == dev
        with pytest.raises(ValueError, match=r"call get_device_window\(\) first"):
            win.register_local_buffer(buf)
        # a wait with its own timeout for a signal that never comes gives up and says so
        t0 = time.monotonic()
        win.wait_signal(peer, False, timeout=datetime.timedelta(milliseconds=300))
        torch.cuda.synchronize()
        assert time.monotonic() - t0 < 30
        with pytest.raises(TimeoutError, match="300 ms"):
            win.check_errors()
        with pytest.raises(ValueError, match="timeout must be positive"):
            win.wait_signal(peer, False, timeout=datetime.timedelta(0))
        torch.cuda.synchronize()
        dist.barrier()
        win.tensor_deregister()
        assert win.get_tensor() is None and win.get_size() == 0
        # owning=False: the window keeps no reference, the metadata stays
        other = torch.zeros(64, dtype=torch.bfloat16, device=dev)
        win.tensor_register(other, owning=False)
        assert win.get_tensor() is None and win.dtype == torch.bfloat16 and win.shape == [64]
        assert win.map_remote_tensor(peer).dtype == torch.bfloat16
        torch.cuda.synchronize()
        win.tensor_deregister()
        comm.finalize()
        del win, comm
        dist.destroy_process_group()
        print(f"[rank {rank}] windows: puts, signals, remote map ok; armed control tore")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nvlink", "nccl"])
def test_windows(backend):
    spawn(_window_worker, 2, backend, timeout=200)


def _window_host_worker(rank, size, path, errq):
    """NOTE [windows need one host]: rank 1 moves into a UTS namespace of its own with another
    host name, as a rank on a second host would look; new_window must then raise
    UnsupportedError on both ranks, naming the hosts, and hang on neither."""
    _hang_guard()
    try:
        import os
        import socket

        import fastcomms

        dev, comm = gpu_rank(rank, size, path, "nccl", "h")
        if rank == 1:
            os.unshare(os.CLONE_NEWUTS)
            socket.sethostname("fastcomms-another-host")
        with pytest.raises(fastcomms.UnsupportedError, match="needs every rank on one host"):
            comm.new_window()
        comm.finalize()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_nccl_windows_refuse_ranks_on_other_hosts():
    import subprocess
    import sys

    probe = subprocess.run(
        [sys.executable, "-c", "import os; os.unshare(os.CLONE_NEWUTS)"], capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot make a UTS namespace here: {probe.stderr.decode()[-200:]}")
    spawn(_window_host_worker, 2, timeout=120)


def _reconfigure_worker(rank, size, path, errq, backend):
    _hang_guard()
    try:
        import fastcomms
        import torch.distributed as dist
        from fastcomms import ReduceOp

        torch.cuda.set_device(rank)
        dev = torch.device("cuda", rank)
        import os

        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
        store = dist.FileStore(path, size)
        comm = fastcomms.new_comm(backend, dev, "ft", store=store, enable_reconfigure=True)
        store.set(f"h/{rank}", comm.get_init_handle())
        hs = [store.get(f"h/{r}").decode() for r in range(size)]
        for uuid, handles in enumerate((list(reversed(hs)), [hs[rank]], hs)):
            comm.reconfigure(uuid, handles, datetime.timedelta(seconds=60)).wait()
            assert comm.get_rank() == handles.index(hs[rank]) and comm.get_size() == len(handles)
            t = torch.full((4096,), float(comm.get_rank() + 1), device=dev)
            comm.all_reduce(t, ReduceOp.SUM, False)
            want = float(sum(range(1, len(handles) + 1)))
            assert torch.equal(t, torch.full((4096,), want, device=dev)), (uuid, t[:4])
        torch.cuda.synchronize()
        comm.finalize()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_reconfigure_on_gpu_backends(backend):
    """reconfigure: all ranks (reversed order), each rank alone, all again."""
    spawn(_reconfigure_worker, 2, backend, timeout=200)


def _call_check_worker(rank, size, path, errq, backend, checked):
    """NOTE [call check] on the GPU backends: with check_calls=strict (the check through the store),
    mismatched collectives raise ValueError on every rank before NCCL moves anything, and the
    communicator stays in step; the CUDA collective Ulysses path's calls whose layouts differ but
    whose byte counts agree raise too (its call key). Armed control (checked=False): the same
    Ulysses mismatch returns without an error, which is why the check exists."""
    _hang_guard()
    try:
        import torch.distributed as dist
        from fastcomms import ReduceOp
        from fastcomms.ulysses import UlyssesGroup

        dev, comm = gpu_rank(
            rank,
            size,
            path,
            backend,
            "chk",
            20,
            hints={"check_calls": "strict" if checked else "0"},
        )
        n = 1000 if rank == 0 else 999

        def a2av():
            in_s = [3, 2] if rank == 0 else [2, 2]
            comm.all_to_all_v_single(
                torch.empty(4, device=dev), torch.ones(sum(in_s), device=dev), [2, 2], in_s, False
            )

        cases = [
            (
                "size",
                lambda: comm.all_reduce(torch.ones(n, device=dev), ReduceOp.SUM, False),
                "different",
            ),
            (
                "reduce op",
                lambda: comm.all_reduce(
                    torch.ones(8, device=dev), ReduceOp.SUM if rank else ReduceOp.MAX, False
                ),
                "different",
            ),
            ("root", lambda: comm.broadcast(torch.ones(8, device=dev), rank, False), "different"),
            ("per-peer sizes", a2av, "per-peer sizes"),
        ]
        # (1,8,4,16) against (1,16,4,8): every chunk is 2 heads x 8 x 16 = 2 x 16 x 8 elements.
        x = torch.randn((1, 8, 4, 16) if rank == 0 else (1, 16, 4, 8), device=dev)
        g = UlyssesGroup(comm, transport="collective")
        if not checked:
            g.all_to_all_4d(x)  # raises nothing: the bytes land in another layout
            torch.cuda.synchronize()
        else:
            cases.append(("Ulysses geometry", lambda: g.all_to_all_4d(x), "different"))
            for name, fn, message in cases:
                with pytest.raises(ValueError, match=message):
                    fn()
                t = torch.full((4,), float(rank + 1), device=dev)  # still in step
                comm.all_reduce(t, ReduceOp.SUM, False)
                assert torch.equal(t.cpu(), torch.full((4,), 3.0)), name
        g.destroy()
        comm.finalize()
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def _default_check_worker(rank, size, path, errq, backend):
    """NOTE [nccl call check] on the GPU, the default setting: mismatched collectives (another
    dtype, reduction or root with the same bytes; another count, on which NCCL hangs) raise
    ValueError on every rank naming both calls, at the call or at the first call after the
    fingerprints landed, well within the timeout; each case on a split of its own, since a
    mismatch aborts its communicator; the parent stays bit-exact. Armed control: the same dtype
    mismatch with check_calls=0 raises nothing and leaves wrong data."""
    _hang_guard()
    try:
        from fastcomms import ReduceOp

        dev, comm = gpu_rank(rank, size, path, backend, "dc", 20, hints={"check_calls": "1"})
        last = rank == size - 1
        cases = [
            (
                "dtype",
                lambda c: c.all_reduce(
                    torch.ones(4, dtype=torch.int32 if last else torch.float32, device=dev),
                    ReduceOp.SUM,
                    False,
                ),
                "all_reduce(SUM, 4 x int32)",
            ),
            (
                "reduce op",
                lambda c: c.all_reduce(
                    torch.ones(4, device=dev), ReduceOp.MAX if last else ReduceOp.SUM, False
                ),
                "all_reduce(MAX, 4 x float32)",
            ),
            (
                "root",
                lambda c: c.broadcast(torch.ones(4, device=dev), 1 if last else 0, False),
                "broadcast(root 1, 4 x float32)",
            ),
            (
                "count",
                lambda c: c.all_reduce(
                    torch.ones(5120 if last else 4096, device=dev), ReduceOp.SUM, False
                ),
                "all_reduce(SUM, 5120 x float32)",
            ),
        ]
        for i, (name, fn, theirs) in enumerate(cases):
            sub = comm.split(list(range(size)), f"case{i}")
            t0 = time.monotonic()
            with pytest.raises(ValueError) as info:
                fn(sub)
                torch.cuda.synchronize()  # the fingerprints landed (a hang ends with the abort)
                sub.barrier(False)
            msg = str(info.value)
            assert f"rank {size - 1} called {theirs} as collective #1" in msg, (name, msg)
            assert "(this rank called " in msg, (name, msg)
            assert time.monotonic() - t0 < 15, (name, time.monotonic() - t0)
            sub.finalize()
        t = torch.full((4,), float(rank + 1), device=dev)
        comm.all_reduce(t, ReduceOp.SUM, False)
        assert torch.equal(t.cpu(), torch.full((4,), 3.0))
        ctl = comm.split(list(range(size)), "control", hints={"check_calls": "0"})
        t = torch.ones(4, dtype=torch.int32 if last else torch.float32, device=dev)
        ctl.all_reduce(t, ReduceOp.SUM, False)
        torch.cuda.synchronize()
        assert not torch.equal(t.cpu(), torch.full((4,), 2, dtype=t.dtype)), t
        ctl.finalize()
        comm.finalize()
        import torch.distributed as dist

        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_default_call_check_on_gpu_backends(backend):
    spawn(_default_check_worker, 2, backend, timeout=200)


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_call_check_on_gpu_backends(backend):
    spawn(_call_check_worker, 2, backend, True, timeout=200)


def test_armed_control_unchecked_ulysses_mismatch_goes_unnoticed():
    spawn(_call_check_worker, 2, "nccl", False, timeout=200)
