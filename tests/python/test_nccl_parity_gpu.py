# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier of NCCL parity with torchcomms (issue 51): NCCL config hints accepted by a real NCCL
(NOTE [nccl config hints]), get_nccl_comm_ptr a live ncclComm_t (NCCL itself asked for its size,
rank and device through the pointer) on nccl and nvlink, and the nccl-lazy backend: world 1 on one
GPU, and its pair communicators at world 2 where there are two GPUs. Skipped (saying why) without a
CUDA device."""

import ctypes
import datetime
import glob
import os
import traceback

import pytest
import torch
from conftest import _hang_guard, gpu_rank, spawn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the GPU tier runs in scripts/gpu.sh)",
)

# Hints a real NCCL takes at world 1 (netName is left out: it names a network plugin).
CONFIG_HINTS = {
    "blocking": "1",
    "cga_cluster_size": "2",
    "minCTAs": "1",
    "max_ctas": "8",
    "split_share": "0",
    "commName": "parity_comm",
    "CTAPolicy": "0",
    "is_high_priority_stream": "true",
    "max_event_pool_size": "64",
}


def _libnccl():
    """The libnccl the process loaded (the nvidia-nccl package's, which fastcomms links)."""
    import nvidia.nccl

    for d in nvidia.nccl.__path__:
        for path in glob.glob(os.path.join(d, "lib", "libnccl.so*")):
            return ctypes.CDLL(path)
    pytest.skip("no libnccl.so in the nvidia-nccl package")


def _ask_nccl(ptr):
    """(count, rank, device) NCCL reports for the communicator at `ptr`."""
    lib = _libnccl()
    count, rank, dev = ctypes.c_int(-1), ctypes.c_int(-1), ctypes.c_int(-1)
    comm = ctypes.c_void_p(ptr)
    assert lib.ncclCommCount(comm, ctypes.byref(count)) == 0
    assert lib.ncclCommUserRank(comm, ctypes.byref(rank)) == 0
    assert lib.ncclCommCuDevice(comm, ctypes.byref(dev)) == 0
    return count.value, rank.value, dev.value


def _one_rank(rank, size, path, errq, backend):
    _hang_guard()
    try:
        import fastcomms
        import torch.distributed as dist

        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = "0", "1"
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        store = dist.FileStore(path, 1)
        comm = fastcomms.new_comm(
            backend,
            dev,
            "parity",
            store=store,
            timeout=datetime.timedelta(seconds=60),
            hints=CONFIG_HINTS,
        )
        assert comm.get_backend() == backend
        x = torch.randn(4096, device=dev)
        want = x.clone()
        comm.all_reduce(x, fastcomms.ReduceOp.SUM, False)
        torch.cuda.synchronize()
        assert torch.equal(x, want)
        if backend == "nccl-lazy":
            # torchcomms' lazy backend object has no get_nccl_comm_ptr.
            try:
                comm.get_nccl_comm_ptr()
                raise AssertionError("nccl-lazy gave a comm pointer")
            except AttributeError:
                pass
            try:
                comm.send(x, 0, False)  # a pair needs another rank
                raise AssertionError("send to itself went through")
            except ValueError as e:
                assert "must not be this rank" in str(e), e
        else:
            ptr = comm.get_backend_impl().get_nccl_comm_ptr()
            assert ptr != 0 and ptr == comm.get_nccl_comm_ptr()
            assert _ask_nccl(ptr) == (1, 0, 0)
            sub = comm.split([0], "parity_sub", hints={"maxCTAs": "4"})
            sub_ptr = sub.get_nccl_comm_ptr()
            assert sub_ptr not in (0, ptr) and _ask_nccl(sub_ptr) == (1, 0, 0)
            sub.finalize()
        comm.finalize()
        if backend != "nccl-lazy":
            assert comm.get_backend_impl().get_nccl_comm_ptr() == 0  # gone with the finalize
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink", "nccl-lazy"])
def test_config_and_comm_ptr_world_1(backend):
    import fastcomms

    if not fastcomms.is_backend_built(backend):
        pytest.skip(f"this build has no {backend} backend")
    spawn(_one_rank, 1, backend)


def _lazy_pairs(rank, size, path, errq):
    _hang_guard()
    try:
        from fastcomms import ReduceOp

        dev, comm = gpu_rank(rank, size, path, "nccl-lazy", "lazy", hints={"maxCTAs": "8"})
        assert comm.get_backend() == "nccl-lazy"
        peer = 1 - rank
        for dtype in (torch.float32, torch.int32, torch.int8):
            out = (torch.arange(4000, device=dev) % 100 + rank).to(dtype)
            got = torch.full((4000,), -1, device=dev).to(dtype)  # poison
            # The lower rank sends first, the higher receives first (torchcomms' LazyP2PTest).
            if rank == 0:
                s, r = comm.send(out, peer, True), comm.recv(got, peer, True)
            else:
                r, s = comm.recv(got, peer, True), comm.send(out, peer, True)
            s.wait()
            r.wait()
            torch.cuda.synchronize()
            want = (torch.arange(4000, device=dev) % 100 + peer).to(dtype)
            assert torch.equal(got, want), dtype
        x = torch.full((1024,), float(rank + 1), device=dev)
        comm.all_reduce(x, ReduceOp.SUM, False)
        torch.cuda.synchronize()
        assert torch.equal(x, torch.full_like(x, 3.0))
        sub = comm.split([0, 1], "lazy_sub")
        assert sub.get_backend() == "nccl"  # torchcomms' split of the primary: plain nccl
        sub.finalize()
        comm.finalize()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_nccl_lazy_pairs_world_2():
    import fastcomms

    if not fastcomms.is_backend_built("nccl-lazy"):
        pytest.skip("this build has no nccl-lazy backend")
    spawn(_lazy_pairs, 2)
