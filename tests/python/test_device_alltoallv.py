# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""``device_alltoallv_single`` on a machine without a GPU (issue 52; the GPU tier is
test_device_alltoallv_gpu.py): argument checks that need no device (split sizes as int64 tensors
of one count per rank), a clear UnsupportedError on gloo from the communicator and from the
backend object torchcomms' test calls, and all_to_all_v_single with split sizes as tensors on the
host path. One process, a world of one over a FileStore."""

import datetime

import pytest
import torch


@pytest.fixture
def gloo_comm(tmp_path, monkeypatch):
    import fastcomms
    import torch.distributed as dist

    monkeypatch.setenv("TORCHCOMM_RANK", "0")
    monkeypatch.setenv("TORCHCOMM_SIZE", "1")
    comm = fastcomms.new_comm(
        "gloo",
        "cpu",
        "a2av_cpu",
        store=dist.FileStore(str(tmp_path / "store"), 1),
        timeout=datetime.timedelta(seconds=30),
    )
    yield comm
    comm.finalize()


def _args(n=4):
    x = torch.arange(n * 3, dtype=torch.float32).reshape(n, 3)
    return torch.empty_like(x), x, torch.tensor([n]), torch.tensor([n])


def test_split_sizes_are_checked_before_the_backend(gloo_comm):
    out, x, os_, is_ = _args()
    with pytest.raises(TypeError, match=r"input_split_sizes must be a torch.Tensor.*int64 CUDA"):
        gloo_comm.device_alltoallv_single(out, x, os_, [4], False)
    with pytest.raises(TypeError, match=r"\[rank 0/1 a2av_cpu device_alltoallv_single\] "):
        gloo_comm.device_alltoallv_single(out, x, os_.int(), is_, False)
    with pytest.raises(
        TypeError, match="output_split_sizes must be an int64 tensor, got torch.int32"
    ):
        gloo_comm.device_alltoallv_single(out, x, os_.int(), is_, False)
    with pytest.raises(
        ValueError, match=r"must have shape \(1,\) \(one count per rank\), got \(2,\)"
    ):
        gloo_comm.device_alltoallv_single(out, x, os_, torch.tensor([2, 2]), False)
    with pytest.raises(TypeError, match="output must be a torch.Tensor"):
        gloo_comm.device_alltoallv_single(None, x, os_, is_, False)


def test_gloo_refuses_saying_why(gloo_comm):
    import fastcomms

    out, x, os_, is_ = _args()
    with pytest.raises(fastcomms.UnsupportedError, match="the gloo backend has none"):
        gloo_comm.device_alltoallv_single(out, x, os_, is_, False)
    # torchcomms' NCCLX test calls it on the backend object
    impl = gloo_comm.get_backend_impl()
    with pytest.raises(fastcomms.UnsupportedError, match="CUDA IPC"):
        impl.device_alltoallv_single(out, x, os_, is_, False)
    with pytest.raises(fastcomms.UnsupportedError, match="gloo"):
        gloo_comm.device_alltoallv_prepare(1 << 20)
    with pytest.raises(TypeError, match="max_output_bytes must be an int"):
        gloo_comm.device_alltoallv_prepare(1.5)


def test_all_to_all_v_single_with_tensor_splits_on_the_host_path(gloo_comm):
    out, x, os_, is_ = _args()
    gloo_comm.all_to_all_v_single(out, x, os_, is_, False)  # CPU tensors: the host path
    assert torch.equal(out, x)
    out2 = torch.zeros_like(x)
    gloo_comm.all_to_all_v_single(out2, x, [4], [4], False)
    assert torch.equal(out2, x)


def test_signature_matches_torchcomms():
    import inspect

    import fastcomms

    params = list(inspect.signature(fastcomms.TorchComm.device_alltoallv_single).parameters)
    assert params[:6] == [
        "self",
        "output",
        "input",
        "output_split_sizes",
        "input_split_sizes",
        "async_op",
    ]
    assert callable(fastcomms._C.Comm.device_alltoallv_single)
