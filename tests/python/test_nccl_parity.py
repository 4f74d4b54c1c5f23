# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""NCCL parity with torchcomms that shows on a machine with no GPU (issue 51): get_nccl_comm_ptr on
a backend that has no NCCL communicator raises AttributeError as torchcomms' does, nccl-lazy is a
built backend, and a config hint of the wrong type raises ValueError naming it before a device is
touched (NOTE [nccl config hints]). The GPU side is test_nccl_parity_gpu.py."""

import os

import fastcomms
import pytest
import torch.distributed as dist


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    return dist.FileStore(os.path.join(tmp_path, "store"), 1)


def test_get_nccl_comm_ptr_raises_on_gloo(one_rank):
    comm = fastcomms.new_comm("gloo", "cpu", "no_nccl", store=one_rank)
    try:
        # torchcomms binds it on TorchCommNCCL only: gloo's object has no such attribute.
        with pytest.raises(AttributeError, match="'gloo' backend has no NCCL communicator"):
            comm.get_backend_impl().get_nccl_comm_ptr()
        with pytest.raises(AttributeError, match="get_nccl_comm_ptr"):
            comm.get_nccl_comm_ptr()
    finally:
        comm.finalize()


def test_get_nccl_comm_ptr_raises_on_a_python_backend(one_rank):
    class Plain(fastcomms.TorchCommBackend):
        def init(self, device, name, options):
            self.device, self.name = device, name

        def get_rank(self):
            return 0

        def get_size(self):
            return 1

        def finalize(self):
            pass

    fastcomms.register_backend("plain_py_nccl_parity", Plain)
    comm = fastcomms.new_comm("plain_py_nccl_parity", "cpu", "plain")
    with pytest.raises(AttributeError):
        comm.get_nccl_comm_ptr()
    comm.finalize()


@pytest.mark.skipif(not fastcomms.is_backend_built("nccl"), reason="this build has no nccl")
def test_nccl_lazy_is_built():
    assert "nccl-lazy" in fastcomms.built_backends()
    assert fastcomms.is_backend_built("nccl-lazy")


@pytest.mark.skipif(not fastcomms.is_backend_built("nccl"), reason="this build has no nccl")
@pytest.mark.parametrize("backend", ["nccl", "nccl-lazy"])
@pytest.mark.parametrize(
    ("hints", "says"),
    [
        ({"minCTAs": "four"}, "hint minCTAs must be an integer, got 'four'"),
        ({"cga_cluster_size": "2x"}, "hint cga_cluster_size must be an integer, got '2x'"),
        ({"is_high_priority_stream": "maybe"}, "hint is_high_priority_stream must be a bool"),
        ({"max_event_pool_size": "-3"}, "hint max_event_pool_size must be an unsigned integer"),
    ],
)
def test_wrong_hint_types_raise(one_rank, backend, hints, says):
    # Parsed before the device is looked at, so the refusal shows on a CPU-only machine too.
    with pytest.raises(ValueError, match=says):
        fastcomms.new_comm(backend, "cpu", f"bad_{backend}", store=one_rank, hints=hints)


@pytest.mark.skipif(not fastcomms.is_backend_built("nccl"), reason="this build has no nccl")
def test_blocking_0_is_unsupported(one_rank):
    with pytest.raises(fastcomms.UnsupportedError, match="hint blocking=0"):
        fastcomms.new_comm("nccl", "cpu", "nonblocking", store=one_rank, hints={"blocking": "0"})


@pytest.mark.skipif(not fastcomms.is_backend_built("nccl"), reason="this build has no nccl")
def test_unknown_hint_warns_then_device_refused(one_rank, capfd):
    # torchcomms logs an unknown key and goes on; here the CPU device then stops the nccl backend.
    with pytest.raises(ValueError, match="serves CUDA devices"):
        fastcomms.new_comm(
            "nccl", "cpu", "unknown_hint", store=one_rank, hints={"notAnNcclKey": "1"}
        )
    err = capfd.readouterr().err
    assert (
        "NCCL hint 'notAnNcclKey' is not supported in this NCCL version, ignoring for comm "
        "'unknown_hint'" in err
    ), err
