# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier, one GPU (the two-rank cases are in test_nccl_gpu.py and test_device_mesh_gpu.py):
torch.distributed over the registered "nvlink" backend name, and windows of a world of one on
the nccl and nvlink backends. A put into this rank's own window and a signal to itself, the
window tensor from the backend's allocator in a torch.cuda.MemPool (as torchcomms' tests make
it) and from PyTorch's caching allocator; poisoned first, so an unwritten byte shows. Skipped
(saying why) without a CUDA device."""

import datetime
import os
import traceback

import pytest
import torch
from conftest import _hang_guard, spawn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA device (the GPU tier runs in scripts/gpu.sh)",
)


def _one_rank_comm(backend, name, path):
    """(device, communicator) of a world of one on cuda:0."""
    import fastcomms
    import torch.distributed as dist

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = "0", "1"
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    store = dist.FileStore(path, 1)
    return dev, fastcomms.new_comm(
        backend, dev, name, store=store, timeout=datetime.timedelta(seconds=60)
    )


def _one_rank_windows(rank, size, path, errq, backend, pooled):
    _hang_guard()
    try:
        import fastcomms

        dev, comm = _one_rank_comm(backend, "w1", path)
        n = 4096 + int(torch.randint(0, 512, ()).item())  # a fresh size every run
        if pooled:
            alloc = comm.get_mem_allocator()
            assert alloc is fastcomms.get_mem_allocator(backend)  # one per backend per process
            pool = torch.cuda.MemPool(alloc)
            with torch.cuda.use_mem_pool(pool):
                buf = torch.full((2 * n,), -7.0, device=dev)  # poison
        else:
            buf = torch.full((2 * n,), -7.0, device=dev)
        win = comm.new_window(buf)
        assert win.get_size() == buf.numel() * 4
        for round_ in range(3):
            src = torch.randn(n, device=dev)
            win.put(src, 0, n, False)
            win.signal(0, False)
            win.wait_signal(0, False)
            got = buf[n:].clone()
            torch.cuda.synchronize()
            win.check_errors()
            assert torch.equal(got, src), f"round {round_}: the put did not land"
            assert torch.equal(buf[:n], torch.full((n,), -7.0, device=dev)), "wrote outside"
        assert torch.equal(win.map_remote_tensor(0), buf)
        with pytest.raises(ValueError, match="do not fit the window"):
            win.put(src, 0, n + 1, False)
        torch.cuda.synchronize()
        win.tensor_deregister()
        comm.finalize()
        print(f"[{backend} pooled={pooled}] world-1 window: 3 puts landed, nothing outside")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("pooled", [True, False])
@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_world_one_windows(backend, pooled):
    import fastcomms

    if not fastcomms.is_backend_built(backend):
        pytest.skip(f"this build has no {backend} backend")
    spawn(_one_rank_windows, 1, backend, pooled, timeout=120)


def _torch_nvlink_backend(rank, size, path, errq):
    """NOTE [nvlink as a torch.distributed backend]: init_process_group("nvlink") and
    new_group(backend="nvlink") run torch.distributed's collectives on fastcomms nvlink
    communicators; destroy_process_group finalizes them."""
    _hang_guard()
    try:
        import fastcomms  # noqa: F401  (registers the name)
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nvlink", store=dist.FileStore(path, 1), rank=0, world_size=1)
        from fastcomms.device_mesh import comm_of

        comm = comm_of(dist.group.WORLD)
        assert comm is not None and comm.get_backend() == "nvlink", comm
        x = torch.randn(1000, device="cuda")
        y = x.clone()
        dist.all_reduce(y)
        assert torch.equal(x, y)
        out = torch.full((2000,), -7.0, device="cuda")
        dist.all_gather_into_tensor(out[:1000], x)
        assert torch.equal(out[:1000], x) and torch.equal(
            out[1000:], torch.full((1000,), -7.0, device="cuda")
        )
        sub = dist.new_group([0], backend="nvlink")
        z = x.clone()
        dist.all_reduce(z, group=sub)
        torch.cuda.synchronize()
        assert torch.equal(z, x)
        dist.destroy_process_group()
        print(
            "[nvlink] torch.distributed over the registered name: all_reduce, all_gather, "
            "new_group ok"
        )
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_torch_distributed_over_the_nvlink_name():
    import fastcomms

    if not fastcomms.is_backend_built("nvlink"):
        pytest.skip("this build has no nvlink backend")
    spawn(_torch_nvlink_backend, 1, timeout=120)


def _registered_tensors(rank, size, path, errq, backend):
    """TorchComm.tensor_register on the CUDA backends (NOTE [nccl memory registration]): an op
    on a registered tensor is right, a second registration, a deregistration of what is not
    registered and a tensor of another device raise; finalize drops what is left."""
    _hang_guard()
    try:
        import fastcomms

        dev, comm = _one_rank_comm(backend, "reg", path)
        x = torch.randn(1 << 20, device=dev)
        want = x.clone()
        comm.tensor_register(x)
        with pytest.raises(ValueError, match="registered already"):
            comm.tensor_register(x)
        comm.all_reduce(x, fastcomms.ReduceOp.SUM, False)
        torch.cuda.synchronize()
        assert torch.equal(x, want)
        comm.tensor_deregister(x)
        with pytest.raises(ValueError, match="not registered"):
            comm.tensor_deregister(x)
        with pytest.raises(ValueError, match="must be on cuda:0"):
            comm.tensor_register(torch.zeros(4))
        comm.tensor_register(torch.empty(4096, device=dev))  # left for finalize to drop
        comm.finalize()
        print(f"[{backend}] tensor_register: op right, misuse refused, finalize dropped the rest")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_tensor_register(backend):
    import fastcomms

    if not fastcomms.is_backend_built(backend):
        pytest.skip(f"this build has no {backend} backend")
    spawn(_registered_tensors, 1, backend, timeout=120)


def _one_rank_compiled(rank, size, path, errq, backend):
    """NOTE [compiled communicator methods] on a CUDA backend: every method of a world of one
    compiled (inductor) against its eager call, bit for bit, CUDA tensors, one graph per case."""
    _hang_guard()
    try:
        import test_compiled_methods

        _, comm = _one_rank_comm(backend, "c1", path)
        test_compiled_methods.compiled_methods(comm, 0, 1)
        torch.cuda.synchronize()
        comm.finalize()
        print(f"[{backend}] world-1 compiled methods: every case bit-exact, one graph each")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_world_one_compiled_methods(backend):
    import fastcomms

    if not fastcomms.is_backend_built(backend):
        pytest.skip(f"this build has no {backend} backend")
    spawn(_one_rank_compiled, 1, backend, timeout=600)
