# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""GPU tier of the process-group integration (issue 15): the CPU tier's checks of
test_device_mesh.py (torch.distributed functions, functional collectives, DDP, FSDP2 over a
DeviceMesh, tensor parallelism, a compiled fullgraph forward and backward) on the nccl and nvlink
backends against torch's own NCCL group on the same data, the process group's C++ fast path
(NOTE [process group fast path]), plus a compiled step captured in a CUDA graph. World 2, one
process per GPU. Skipped (saying why) without two GPUs."""

import os
import traceback

import pytest
import torch
from conftest import _hang_guard, gpu_rank, spawn

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs 2 CUDA devices (the GPU tier runs in scripts/gpu.sh)",
)

BODIES = (
    "process_group_ops",
    "process_group_fast_path",
    "ddp_and_fsdp2",
    "tensor_parallel",
    "functional_compiled",
    "compiled_step_in_cuda_graph",
)


def _worker(rank, size, path, errq, backend):
    # two inductor compiles on a cold cache: more than the usual hang guard
    os.environ["FASTCOMMS_TEST_HANG_S"] = str(
        max(360, int(os.environ.get("FASTCOMMS_TEST_HANG_S", 0)))
    )
    _hang_guard()
    try:
        import test_device_mesh as bodies
        import torch.distributed as dist

        _, comm = gpu_rank(rank, size, path, backend, "pg", timeout_s=120)
        for name in BODIES:
            try:
                getattr(bodies, name)(comm, rank, size)
            except BaseException as e:
                raise AssertionError(f"{name} on {backend}") from e
        torch.cuda.synchronize()
        comm.finalize()
        dist.destroy_process_group()
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise


@pytest.mark.parametrize("backend", ["nccl", "nvlink"])
def test_process_groups_on_gpu_backends(backend):
    spawn(_worker, 2, backend, timeout=400)
