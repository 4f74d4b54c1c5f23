# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier, one GPU: the NaN check on CUDA tensors (NOTE [NaN check on the device]) syncs no
host: a call with a clean tensor and one with a NaN run under torch's sync debug mode set to
raise on any synchronizing call; the NaN is raised by the communicator's next call, with
torchcomms' message; calls through the process group's C++ path are checked too. Inside a CUDA
graph capture the check stands aside (capture and replay raise nothing; eager calls after it are
checked). Skipped (saying why) without a CUDA device."""

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


def _world1_comm(backend, name, path):
    """A one-rank communicator on GPU 0 (a FileStore at ``path``)."""
    import fastcomms
    import torch.distributed as dist

    os.environ["TORCHCOMM_RANK"], os.environ["TORCHCOMM_SIZE"] = "0", "1"
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=60)
    return fastcomms.new_comm(backend, dev, name, store=dist.FileStore(path, 1), timeout=timeout)


def _nan_worker(rank, size, path, errq, backend):
    _hang_guard()
    try:
        import torch.distributed as dist
        from fastcomms import ReduceOp
        from fastcomms.device_mesh import _create_torchcomm_process_group
        from fastcomms.hooks import NanCheckHook

        comm = _world1_comm(backend, "nan", path)
        dev = torch.device("cuda", 0)
        check = NanCheckHook(check_inputs=True, check_outputs=True)
        check.register_with_comm(comm)
        assert comm._fast is not None  # the C++ paths stay on
        good = torch.ones(1 << 16, device=dev)
        bad = torch.ones(1 << 16, device=dev)
        bad[12345] = float("nan")
        comm.all_reduce(good, ReduceOp.SUM, False)  # warm-up (allocations, NCCL setup)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            comm.all_reduce(good, ReduceOp.SUM, False)
            comm.all_reduce(bad, ReduceOp.SUM, False)  # its own op runs: no host sync here
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        msg = r"NaN detected in input tensor for 'all_reduce' on comm 'nan': \(65536,\) float32"
        with pytest.raises(RuntimeError, match=msg):
            comm.barrier(False)  # the next call reads the flag
        comm.barrier(False)  # reported once
        torch.cuda.synchronize()
        pg = _create_torchcomm_process_group(comm, "nan_pg")
        bad2 = torch.full((8,), float("nan"), device=dev)
        dist.all_reduce(bad2, group=pg)  # the process group's C++ path is checked too
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="NaN detected in input tensor for 'all_reduce'"):
            comm.all_reduce(good, ReduceOp.SUM, False)
        check.unregister()
        comm.all_reduce(bad, ReduceOp.SUM, False)
        torch.cuda.synchronize()
        comm.barrier(False)  # unregistered: nothing raised
        comm.finalize()
    except Exception:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_nan_check_on_the_device_syncs_no_host(backend):
    spawn(_nan_worker, 1, backend)


def _capture_worker(rank, size, path, errq):
    """NOTE [NaN check on the device] inside a CUDA graph capture: the check neither queues nor
    queries while the stream captures (a capture may not read a flag back), so capturing and
    replaying an all_reduce of a NaN tensor raises nothing; eager calls after it are checked
    again."""
    _hang_guard()
    try:
        from fastcomms import ReduceOp
        from fastcomms.hooks import NanCheckHook

        comm = _world1_comm("nccl", "nan_graph", path)
        dev = torch.device("cuda", 0)
        check = NanCheckHook(check_inputs=True, check_outputs=True)
        check.register_with_comm(comm)
        good = torch.ones(1 << 12, device=dev)
        bad = torch.ones(1 << 12, device=dev)
        bad[7] = float("nan")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            comm.all_reduce(good, ReduceOp.SUM, False)  # warm-up on the capture's side stream
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            comm.all_reduce(bad, ReduceOp.SUM, False)
        for _ in range(2):
            g.replay()
        torch.cuda.synchronize()
        comm.barrier(False)  # nothing pending from the capture: no error
        comm.all_reduce(bad, ReduceOp.SUM, False)  # eager again: checked
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="NaN detected in input tensor for 'all_reduce'"):
            comm.barrier(False)
        check.unregister()
        comm.finalize()
    except Exception:
        errq.put((rank, traceback.format_exc()))
        raise


def test_nan_check_skips_graph_capture():
    spawn(_capture_worker, 1)
