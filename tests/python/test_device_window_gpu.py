# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier of the device window API (issue 52): ranks sharing GPU 0 as MPS clients (2, 3 and 4
ranks) on the nvlink and nccl backends. Every device call from CUDA (tests/gpu/
device_window_kernels.cu, through the installed header only, loaded with ctypes) and from Triton
(device_window_triton_kernels.py over fastcomms.triton), in each scope: puts with signals and
counters bit-exact after the acquire, signal SET/ADD with every compare op, read/reset, stores
through get_nvlink_address, barriers, refusals (-1) and a timed-out wait (-2, then TimeoutError
from check_errors); signals and counters under contention (thousands of threads or programs
signalling one peer, waited for with EQ on the exact total); and the armed control of NOTE
[device window ordering]: with kFaultUnorderedSignal the signal overtakes a 32 MiB put and the
receiver must see stale bytes on every round, which the ordered runs never show. Skipped, saying
why, without a CUDA device, the kernels library, Triton or MPS."""

import ctypes
import datetime
import os
import pathlib
import traceback

import pytest
import torch
from conftest import _hang_guard, spawn
from test_ulysses_gpu import mps_daemon  # noqa: F401  (the fixture)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the GPU tier runs in scripts/gpu.sh)",
)

SCOPES = [(0, 1), (1, 32), (2, 128)]


def _guard():
    """conftest's hang guard, with room for the first Triton compiles of every kernel on every
    rank (scripts/gpu.sh sets 90 s)."""
    import faulthandler

    _hang_guard()
    faulthandler.dump_traceback_later(
        max(200, int(os.environ.get("FASTCOMMS_TEST_HANG_S", "150"))), exit=True
    )  # (CoopScope, threads of the one-block kernels)


def _kernels_path():
    import fastcomms

    build = os.environ.get("FASTCOMMS_BUILD")
    root = (
        pathlib.Path(build) if build else pathlib.Path(fastcomms._C.__file__).resolve().parents[2]
    )
    return root / "tests" / "libfastcomms_device_window_kernels.so"


def _need(backend):
    import fastcomms

    if not fastcomms.is_backend_built(backend):
        pytest.skip(f"this build has no {backend} backend")
    if not _kernels_path().exists():
        pytest.skip(f"{_kernels_path()} is not built (CUDA off in this build)")


def _window(rank, size, path, backend, buf, name="dw", timeout_s=60):
    """(comm or None, window over buf). "store": every rank on GPU 0 (MPS clients), a window over
    a FileStore folder with no communicator (NCCL refuses ranks sharing a GPU, so the nvlink and
    nccl backends cannot have them); "nvlink" / "nccl": a communicator, one GPU per rank."""
    import fastcomms
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "store":
        d = f"{path}.{name}.d"
        os.makedirs(d, exist_ok=True)
        return None, fastcomms.store_window(rank, size, buf.device, d, name, timeout, buf)
    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = str(rank), str(size)
    store = dist.PrefixStore(name, dist.FileStore(path, size))
    comm = fastcomms.new_comm(backend, buf.device, name, store=store, timeout=timeout)
    return comm, comm.new_window(buf)


def _device(rank, backend):
    n = torch.cuda.device_count() if backend != "store" else 1
    dev = torch.device("cuda", rank % n)
    torch.cuda.set_device(dev)
    return dev


def _pattern(rank, rnd, scope, nbytes):
    g = torch.Generator().manual_seed(1000 * rank + 10 * rnd + scope)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _ordering_src(nbytes, seed, dev):
    i = torch.arange(nbytes, dtype=torch.int64, device=dev)
    return ((i * 7 + seed) & 255).to(torch.uint8)


class _Cuda:
    """The CUDA kernels behind one interface with the Triton ones (see _Triton)."""

    name = "cuda"

    def __init__(self):
        self.lib = ctypes.CDLL(str(_kernels_path()))
        u64 = ctypes.c_uint64
        i = ctypes.c_int
        self.lib.fc_dw_exchange.argtypes = [u64, u64, u64, u64, i, u64, i, i, u64, u64]
        self.lib.fc_dw_barrier.argtypes = [u64, i, i, i, u64, u64]
        self.lib.fc_dw_calls.argtypes = [u64, u64, u64, i, u64, i, u64]
        self.lib.fc_dw_contention.argtypes = [u64, u64, i, i, u64, u64, i, i, u64, u64]
        self.lib.fc_dw_ordering.argtypes = [u64, u64, i, i, u64, u64, i, i, u64, u64, u64]
        self.lib.fc_dw_timeout.argtypes = [u64, i, i, i, u64, u64]

    @staticmethod
    def _s():
        return torch.cuda.current_stream().cuda_stream

    def _ok(self, rc):
        assert rc == 0, f"launch failed: cudaError {rc}"

    def units(self, scope, blocks, threads):
        return blocks * (1 if scope == 2 else threads // 32 if scope == 1 else threads)

    def exchange(self, dw, src, out, chunk, scope, expect, blocks, threads, rc):
        self._ok(
            self.lib.fc_dw_exchange(
                dw,
                src,
                out.data_ptr(),
                chunk,
                scope,
                expect,
                blocks,
                threads,
                rc.data_ptr(),
                self._s(),
            )
        )

    def barrier(self, dw, scope, threads, rc, bid=0):
        self._ok(self.lib.fc_dw_barrier(dw, scope, bid, threads, rc.data_ptr(), self._s()))

    def calls(self, dw, src, out, scope, rnd, threads):
        self._ok(self.lib.fc_dw_calls(dw, src, out.data_ptr(), scope, rnd, threads, self._s()))

    def contention(self, dw, src, peer, reps, es, ec, blocks, rc):
        self._ok(
            self.lib.fc_dw_contention(
                dw, src, peer, reps, es, ec, blocks, 128, rc.data_ptr(), self._s()
            )
        )

    def ordering(self, dw, src, sender, receiver, nbytes, rnd, seed, wrong, rc):
        self._ok(
            self.lib.fc_dw_ordering(
                dw,
                src,
                sender,
                receiver,
                nbytes,
                rnd,
                seed,
                1024,
                wrong.data_ptr(),
                rc.data_ptr(),
                self._s(),
            )
        )


class _Triton:
    """The same checks through fastcomms.triton (a program is the block scope)."""

    name = "triton"

    def __init__(self):
        import device_window_triton_kernels as k

        self.k = k

    def units(self, scope, blocks, threads):
        return blocks

    def exchange(self, dw, src, out, chunk, scope, expect, blocks, threads, rc):
        self.k.tk_exchange[(blocks,)](dw, src, out.data_ptr(), chunk, expect, rc, num_warps=4)

    def barrier(self, dw, scope, threads, rc, bid=0):
        self.k.tk_barrier[(1,)](dw, bid, rc, num_warps=4)

    def calls(self, dw, src, out, scope, rnd, threads):
        self.k.tk_calls[(1,)](dw, src, out, rnd, num_warps=4)

    def contention(self, dw, src, peer, reps, es, ec, blocks, rc):
        self.k.tk_contention[(blocks,)](dw, src, peer, reps, es, ec, rc, num_warps=4)

    def ordering(self, dw, src, sender, receiver, nbytes, rnd, seed, wrong, rc):
        self.k.tk_ordering[(1,)](
            dw, src, sender, receiver, nbytes, rnd, seed, wrong, rc, num_warps=8
        )


def _device_worker(rank, size, path, errq, backend, lang):
    _guard()
    try:
        import fastcomms

        dev = _device(rank, backend)
        impl = _Cuda() if lang == "cuda" else _Triton()
        wbytes = 256 * 1024
        buf = torch.full((wbytes,), 0xA5, dtype=torch.uint8, device=dev)
        comm, win = _window(rank, size, path, backend, buf)
        with pytest.raises(ValueError, match=r"call get_device_window\(\) first"):
            win.register_local_buffer(buf)
        dw = win.get_device_window(signal_count=8, counter_count=4, barrier_count=2)
        assert isinstance(dw, int) and dw != 0
        assert win.get_device_window() == dw, "a second call returns the cached window"
        with pytest.raises(fastcomms.UnsupportedError, match="multicast"):
            win.get_multimem_address()
        src = torch.zeros(wbytes, dtype=torch.uint8, device=dev)
        h = win.register_local_buffer(src)
        rc = torch.zeros(1, dtype=torch.int32, device=dev)
        checks = 0

        # 1. every call, each scope (Triton: the program scope only)
        scopes = SCOPES if lang == "cuda" else [(2, 128)]
        for rnd, (scope, threads) in enumerate(scopes, 1):
            out = torch.zeros(64, dtype=torch.int64, device=dev)
            impl.calls(dw, h, out, scope, rnd, threads)
            o = out.cpu().tolist()
            what = f"{lang} scope {scope} rank {rank}"
            assert o[0] == rank and o[1] == size, (what, o[:2])
            assert o[2] == buf.data_ptr() and o[3] == wbytes, (what, o[2:4])
            assert o[4] == 0 and o[5] == 0, (what, "multimem / out-of-range address not null")
            for q in range(size):
                assert o[8 + q] == win.map_remote_tensor(q).data_ptr(), (what, "nvlink address")
                assert o[8 + q] == win.get_nvlink_address(q)
            assert o[6] == 9, (what, f"{o[6]} of 9 refusals returned -1")
            assert o[7] == 0, (what, f"a call failed: {o[7]}")
            assert o[20] == 5 * size * (size + 1) and o[21] == size * (size + 1), (what, o[20:22])
            assert o[22] == 0 and o[23] == 0 and o[24] == 0, (what, "read/reset", o[22:25])
            assert o[25] == 0, (what, f"{o[25]} words stored through get_nvlink_address wrong")
            assert o[26] == 1 and o[27] == 0, (what, "counter", o[26:28])
            if lang == "triton":
                assert o[28:32] == [rank, size, 0, 1 if size > 1 else 0], (what, o[28:32])
            checks += 1

        # 2. puts with signal and counter, bit-exact right after the acquire, each scope
        blocks, threads, expect = 4, 128, 0
        for scope, _ in scopes:
            units = impl.units(scope, blocks, threads)
            chunk = (wbytes // size // units) // 16 * 16
            total = units * chunk
            for rnd in range(3):
                src[:total] = _pattern(rank, rnd, scope, total).to(dev)
                expect += size * units
                out = torch.zeros(size * total, dtype=torch.uint8, device=dev)
                impl.exchange(dw, h, out, chunk, scope, expect, blocks, threads, rc)
                impl.barrier(dw, scope, 128 if scope == 2 else 32 if scope == 1 else 1, rc)
                want = torch.cat([_pattern(q, rnd, scope, total) for q in range(size)])
                assert rc.item() == 0, f"{lang} exchange scope {scope}: a call failed"
                assert torch.equal(out.cpu(), want), f"{lang} exchange scope {scope} round {rnd}"
                checks += 1

        # 3. contention: a ring, then every rank signalling rank 0 (running totals)
        blocks, reps, per = 64, 4, 64 * 4 * (1 if lang == "triton" else 128)
        impl.contention(dw, h, (rank + 1) % size, reps, per, per, blocks, rc)
        torch.cuda.synchronize()
        impl.barrier(dw, 2, 128, rc, bid=1)
        total0 = per + size * per if rank == 0 else per
        impl.contention(dw, h, 0, reps, total0, 2 * per, blocks, rc)
        impl.barrier(dw, 2, 128, rc, bid=1)
        torch.cuda.synchronize()
        assert rc.item() == 0, f"{lang} contention: a wait or a call failed"
        checks += 2

        # 4. ordering on a 32 MiB window, then the armed control, which must be caught each round
        big = 32 << 20
        bbuf = torch.zeros(big, dtype=torch.uint8, device=dev)
        _, win2 = (
            (None, comm.new_window(bbuf))
            if comm
            else _window(rank, size, path, backend, bbuf, name="dw2")
        )
        dw2 = win2.get_device_window(signal_count=8, counter_count=1, barrier_count=1)
        bsrc = torch.empty(big, dtype=torch.uint8, device=dev)
        hb = win2.register_local_buffer(bsrc)
        rnd = 0
        for armed in (False, True):
            if armed:
                win2._arm_device_faults(1)
            for _ in range(3):
                rnd += 1
                seed = 17 * rnd + 3
                bsrc.copy_(_ordering_src(big, seed, dev))
                wrong = torch.zeros(1, dtype=torch.int64, device=dev)
                impl.ordering(dw2, hb, 0, 1, big, rnd, seed, wrong, rc)
                impl.barrier(dw2, 2, 128, rc)
                n_wrong = wrong.item()
                if rank == 1 and not armed:
                    assert n_wrong == 0, f"{lang} ordered put: {n_wrong} stale bytes after the wait"
                if rank == 1 and armed:
                    assert n_wrong > 0, (
                        f"{lang} armed control (signal before the data) went unnoticed in round "
                        f"{rnd}: the ordering check is blind"
                    )
                checks += 1
        win2._arm_device_faults(0)
        assert rc.item() == 0
        torch.cuda.synchronize()
        win2.deregister_local_buffer(hb)
        win2.tensor_deregister()

        if comm is not None:  # the communicator's own device window (torchcomms' transport)
            t = comm.get_device_transport()
            assert isinstance(t, int) and t not in (0, dw) and comm.get_device_transport() == t
        # 5. teardown: handles, deregistration, the device window goes with the tensor
        win.deregister_local_buffer(h)
        with pytest.raises(ValueError, match="was not returned by register_local_buffer"):
            win.deregister_local_buffer(h)
        win.tensor_deregister()
        with pytest.raises(ValueError, match="no tensor is registered"):
            win.get_device_window()
        torch.cuda.synchronize()
        if comm is not None:
            comm.finalize()
        print(f"[rank {rank}/{size} {backend} {lang}] {checks} device-window checks passed")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize(
    ("backend", "size"), [("store", 2), ("store", 3), ("store", 4), ("nvlink", 2), ("nccl", 2)]
)
def test_cuda_device_window_calls(mps_daemon, backend, size):  # noqa: F811
    """store: ranks sharing GPU 0 as MPS clients; nvlink / nccl: a GPU per rank (skipped on a
    machine with fewer, as NCCL refuses two ranks on one GPU)."""
    _need("nvlink" if backend == "store" else backend)
    if backend != "store" and torch.cuda.device_count() < size:
        pytest.skip(f"NCCL refuses ranks sharing a GPU: {size} {backend} ranks need {size} GPUs")
    spawn(_device_worker, size, backend, "cuda", timeout=300)


@pytest.mark.parametrize("size", [2, 3, 4])
def test_triton_device_window_calls(mps_daemon, size):  # noqa: F811
    _need("nvlink")
    pytest.importorskip("triton", reason="fastcomms.triton needs triton")
    spawn(_device_worker, size, "store", "triton", timeout=300)


def _transport_worker(rank, size, path, errq, lang):
    """torchcomms' device transport on the handle get_device_transport makes (here over a store
    window with the same counts, as ranks share GPU 0): send/recv of 2.5 MiB + 7 bytes in
    slot-sized chunks between pairs of ranks, twice (the sequence counters chain across calls),
    bit-exact; a pairwise barrier, a caller's signal and wait, the properties."""
    _guard()
    try:
        from fastcomms._window import transport_counts

        dev = _device(rank, "store")
        buf = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
        _, win = _window(rank, size, path, "store", buf, name="dtr")
        h = win.get_device_window(*transport_counts(size))
        nbytes = (5 << 19) + 7
        rc = torch.zeros(1, dtype=torch.int32, device=dev)
        peer = rank + 1 if rank % 2 == 0 else rank - 1
        for call in range(2):
            src = _pattern(rank, call, 7, nbytes).to(dev)
            dst = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
            if lang == "cuda":
                lib = _Cuda().lib
                lib.fc_dw_transport.argtypes = (
                    [ctypes.c_uint64] * 4 + [ctypes.c_int] + [ctypes.c_uint64] * 2
                )
                err = lib.fc_dw_transport(
                    h,
                    src.data_ptr(),
                    dst.data_ptr(),
                    nbytes,
                    256,
                    rc.data_ptr(),
                    torch.cuda.current_stream().cuda_stream,
                )
                assert err == 0, f"launch failed: cudaError {err}"
            else:
                import device_window_triton_kernels as k

                k.tk_transport[(1,)](h, src, dst, nbytes, rc, num_warps=8)
            torch.cuda.synchronize()
            assert rc.item() == 0, f"{lang} transport call {call}: flags {rc.item()}"
            if peer < size:
                want = _pattern(peer, call, 7, nbytes)
                assert torch.equal(dst.cpu(), want), f"{lang} transport call {call}: bytes differ"
        win.tensor_deregister()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("lang", ["cuda", "triton"])
def test_device_transport_send_recv(mps_daemon, lang, size):  # noqa: F811
    _need("nvlink")
    if lang == "triton":
        pytest.importorskip("triton", reason="fastcomms.triton needs triton")
    spawn(_transport_worker, size, lang, timeout=200)


def _timeout_worker(rank, size, path, errq):
    """A device wait for a signal that never comes gives up after the communicator's timeout
    (2 s) with -2, and the host's check_errors raises TimeoutError, in each scope."""
    _guard()
    try:
        dev = _device(rank, "store")
        buf = torch.zeros(4096, dtype=torch.uint8, device=dev)
        _, win = _window(rank, size, path, "store", buf, name="dwt", timeout_s=2)
        dw = win.get_device_window()
        lib = _Cuda()
        rc = torch.zeros(1, dtype=torch.int32, device=dev)
        for scope, threads in SCOPES:
            rc.fill_(0)
            lib.lib.fc_dw_timeout(
                dw,
                (rank + 1) % size,
                scope,
                threads,
                rc.data_ptr(),
                torch.cuda.current_stream().cuda_stream,
            )
            torch.cuda.synchronize()
            assert rc.item() == -2, f"scope {scope}: {rc.item()}, expected -2 (kDeviceTimeout)"
            with pytest.raises(TimeoutError, match="timed out"):
                win.check_errors()
        torch.cuda.synchronize()
        win.tensor_deregister()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_device_wait_times_out_and_says_so(mps_daemon):  # noqa: F811
    _need("nvlink")
    spawn(_timeout_worker, 2, timeout=120)


@pytest.mark.parametrize("example", ["device_window_triton.py", "device_window_cuda.py"])
def test_examples_match_torch(mps_daemon, example):  # noqa: F811
    """The worked examples (ring all-reduce through the device window) on 2 and 3 ranks sharing
    GPU 0, each checking its result against torch itself."""
    import subprocess
    import sys

    _need("nvlink")
    if example.endswith("triton.py"):
        pytest.importorskip("triton", reason="the Triton example needs triton")
    repo = pathlib.Path(__file__).resolve().parents[2]
    for n in (2, 3):
        r = subprocess.run(
            [sys.executable, str(repo / "examples" / example), "--nproc", str(n)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "matches torch" in r.stdout, r.stdout[-2000:]
