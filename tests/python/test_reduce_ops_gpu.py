# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier, world of one on nccl and nvlink (NCCL allows no two ranks on one GPU): PREMUL_SUM on
float16, bfloat16, float32 and float64 with a number and a device-scalar factor (NCCL's
ncclScalarDevice: no host sync, checked with torch.cuda.set_sync_debug_mode("error"), and the
factor an earlier kernel on the caller's stream wrote is the one used), through the communicator
and torch.distributed's _make_nccl_premul_sum; AVG on integers; a batch's send/recv pair to self.
Skipped (saying why) without a CUDA device."""

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

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _expected(x, factor):
    # world 1: x times the factor, both in x's dtype, rounded once to it (as NCCL's FuncPreMulSum)
    f = factor if isinstance(factor, torch.Tensor) else torch.tensor(factor, dtype=torch.float64)
    return x.cpu() * f.cpu().to(x.dtype)


def _world_one(rank, size, path, errq, backend):
    _hang_guard()
    try:
        import fastcomms
        import torch.distributed as dist
        from fastcomms import ReduceOp

        os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = "0", "1"
        dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        comm = fastcomms.new_comm(
            backend,
            dev,
            "ops",
            store=dist.FileStore(path, 1),
            timeout=datetime.timedelta(seconds=60),
        )
        for dtype in FLOATS:
            x0 = torch.randn(1000, device=dev).to(dtype)
            for factor in (0.5, 1.0 / 3.0):
                # a number
                x = x0.clone()
                comm.all_reduce(x, ReduceOp.PREMUL_SUM(factor), False)
                assert torch.equal(x.cpu(), _expected(x0, factor)), (dtype, factor)
                # a device scalar, in the dtype and in float32 (cast on the stream)
                for fdt in (dtype, torch.float32):
                    f = torch.zeros((), device=dev, dtype=fdt)
                    x = x0.clone()
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        f.fill_(factor)  # a kernel on the caller's stream: the op sees its value
                        comm.all_reduce(x, ReduceOp.PREMUL_SUM(f), False)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    want = _expected(x0, torch.tensor(factor, dtype=fdt))
                    assert torch.equal(x.cpu(), want), (dtype, fdt, factor)
            # reduce_scatter_single with a device factor, async
            out = torch.empty(1000, device=dev, dtype=dtype)
            f = torch.full((1,), 0.25, device=dev, dtype=dtype)
            comm.reduce_scatter_single(out, x0, ReduceOp.PREMUL_SUM(f), True).wait()
            assert torch.equal(out.cpu(), _expected(x0, 0.25)), dtype
        # refusals: a factor on the host for a CUDA op, two elements, an integer tensor
        x = torch.ones(4, device=dev)
        with pytest.raises(ValueError, match="factor tensor is on cpu"):
            comm.all_reduce(x, ReduceOp.PREMUL_SUM(torch.tensor(2.0)), False)
        with pytest.raises(ValueError, match="must hold one element"):
            comm.all_reduce(x, ReduceOp.PREMUL_SUM(torch.ones(2, device=dev)), False)
        with pytest.raises(TypeError, match="PREMUL_SUM needs a floating-point tensor"):
            comm.all_reduce(
                torch.ones(2, dtype=torch.int32, device=dev), ReduceOp.PREMUL_SUM(2.0), False
            )
        # AVG on integers: NCCL's ncclAvg (sum / 1 here)
        for dtype in (torch.int8, torch.uint8, torch.int32, torch.int64):
            x = torch.randint(0, 100, (64,), device=dev).to(dtype)
            ref = x.clone()
            comm.all_reduce(x, ReduceOp.AVG, False)
            assert torch.equal(x, ref), dtype
        # a batch's pair to self: a copy on the op's stream
        src = torch.randn(4097, device=dev, dtype=torch.bfloat16)
        got = torch.full_like(src, float("nan"))
        b = comm.batch_op_create()
        b.send(src, 0)
        b.recv(got, 0)
        b.issue(False)
        assert torch.equal(got.cpu(), src.cpu())
        b = comm.batch_op_create()
        b.send(src, 0)
        with pytest.raises(ValueError, match="send to self without a matching recv"):
            b.issue(False)
        torch.cuda.synchronize()
        comm.finalize()
        print(f"[{backend}] world 1: PREMUL_SUM number and device factors, integer AVG, self pair")
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_world_one_reduce_ops(backend):
    import fastcomms

    if not fastcomms.is_backend_built(backend):
        pytest.skip(f"this build has no {backend} backend")
    spawn(_world_one, 1, backend, timeout=180)


def _c10d_premul(rank, size, path, errq):
    """torch.distributed's _make_nccl_premul_sum with a device tensor through the registered
    "nvlink" backend (FSDP2's gradient divide): no host sync."""
    _hang_guard()
    try:
        import fastcomms  # noqa: F401  (registers the name)
        import torch.distributed as dist

        torch.cuda.set_device(0)
        dist.init_process_group("nvlink", store=dist.FileStore(path, 1), rank=0, world_size=1)
        dev = torch.device("cuda", 0)
        for dtype in FLOATS:
            x0 = torch.randn(512, device=dev).to(dtype)
            f = torch.tensor(0.125, device=dev, dtype=dtype)
            op = dist._make_nccl_premul_sum(f)
            x = x0.clone()
            out = torch.empty_like(x0)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                dist.all_reduce(x, op=op)
                dist.reduce_scatter_tensor(out, x0, op=op)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert torch.equal(x.cpu(), _expected(x0, 0.125)), dtype
            assert torch.equal(out.cpu(), _expected(x0, 0.125)), dtype
            x = x0.clone()
            dist.all_reduce(x, op=dist._make_nccl_premul_sum(1.0 / 3.0))
            assert torch.equal(x.cpu(), _expected(x0, 1.0 / 3.0)), dtype
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


def test_c10d_premul_sum_device_factor():
    import fastcomms

    if not fastcomms.is_backend_built("nvlink"):
        pytest.skip("this build has no nvlink backend")
    spawn(_c10d_premul, 1, timeout=180)
