# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' ``device_alltoallv_single``: an all-to-all-v whose split sizes are int64 CUDA
tensors, read only on the GPU (NOTE [device all-to-all-v] in
include/fastcomms/cuda/device_a2av.hpp says how the rows move). ``TorchComm`` and the backend
object (``get_backend_impl()``, as torchcomms' NCCLX test calls it) both reach ``issue``.

What the host does per call: argument checks on shapes, dtypes and devices (never on values), and
four kernel launches on the caller's current stream. No device-to-host copy, no synchronize: the
call runs under ``torch.cuda.set_sync_debug_mode("error")`` and inside a CUDA graph, whose
replays read whatever counts were written into the same split tensors since."""

from __future__ import annotations

import datetime

import torch

from . import _C
from ._C import UnsupportedError
from ._options import _ms, _TypeError, _ValueError
from ._work import TorchWork, _DoneWork, _EventWork

__all__ = ["host_splits", "issue", "prepare", "route"]


def _where(c) -> str:
    try:
        return f"[rank {c.rank()}/{c.size()} {c.name()} device_alltoallv_single]"
    except Exception:  # noqa: BLE001 - a Python backend's object: no rank to name
        return "[device_alltoallv_single]"


def _native(c):
    """``c`` if it is a communicator of the extension on a CUDA device; else why not."""
    if c.python_backend() is not None:  # (its name may be anything, "nccl_x" too)
        # Refused rather than silently slow: a Python backend has no device buffers to map.
        raise UnsupportedError(
            f"{_where(c)} runs on fastcomms' built-in CUDA backends (nvlink, nccl), not on a "
            f"backend written in Python ({c.backend()!r})"
        )
    backend = c.backend()
    if backend == "gloo" or not backend.startswith(("nccl", "nvlink")):
        where = _where(c)
        # gloo moves CPU tensors over TCP: there is no GPU to read the counts and no peer memory
        # to write rows into; a host copy of the counts is what all_to_all_v_single does.
        raise UnsupportedError(
            f"{where} needs the GPUs of every rank on one host, mapped into each other (CUDA "
            f"IPC): the {backend} backend has none; use all_to_all_v_single with host split "
            f"sizes, or an nvlink or nccl communicator"
        )
    return c


def _check_args(c, tensors: dict) -> None:
    """What can be judged without a GPU: types, and the split tensors' dtype and shape (the
    extension checks the rest again, devices and contiguity included)."""
    size = c.size()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            where = _where(c)
            extra = (
                " (device_alltoallv_single takes counts as int64 CUDA tensors; "
                "all_to_all_v_single takes lists)"
                if name.endswith("split_sizes")
                else ""
            )
            raise _TypeError(
                f"{where} {name} must be a torch.Tensor, got {type(t).__name__}{extra}"
            )
        if not name.endswith("split_sizes"):
            continue
        if t.dtype != torch.int64:
            where = _where(c)
            raise _TypeError(f"{where} {name} must be an int64 tensor, got {t.dtype}")
        if t.dim() != 1 or t.numel() != size:
            where = _where(c)
            raise _ValueError(
                f"{where} {name} must have shape ({size},) (one count per rank), got "
                f"{tuple(t.shape)}"
            )


def _check_cuda(c, tensors: dict) -> None:
    for name, t in tensors.items():
        if not t.is_cuda:
            raise _ValueError(
                f"{_where(c)} {name} must be a CUDA tensor (the counts are read on the device, "
                f"never by the host), got a {t.device} tensor"
            )


# The dtypes the extension's tensor views carry; any other (complex, int16, uint32, ...) travels
# as its bytes: the exchange copies whole rows, so only the row's byte size matters.
_VIEW_DTYPES = {
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
    torch.bool,
}


def _as_rows(t):
    """``t`` itself, or its bytes with dim 0 kept (one trailing byte dimension)."""
    return t if t.dtype in _VIEW_DTYPES else t.unsqueeze(-1).view(torch.uint8)


def issue(
    c,
    output,
    input,
    output_split_sizes,
    input_split_sizes,
    async_op,
    timeout=None,
    input_index=None,
):
    """Enqueues the exchange on the current stream; returns a TorchWork. ``c`` is the
    extension's communicator (``TorchComm._c``). ``input_index`` (private; fastcomms.moe's):
    an int64 CUDA tensor naming the input row of each row the splits count (NOTE [indexed
    push]), so scattered rows are sent without a packing copy."""
    tensors = {
        "output": output,
        "input": input,
        "output_split_sizes": output_split_sizes,
        "input_split_sizes": input_split_sizes,
    }
    _check_args(c, tensors)
    c = _native(c)
    _check_cuda(c, tensors)
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing and _C._device_alltoallv_info(c) is None:
        # Refused rather than broken: the first call allocates the buffers peers map and trades
        # their handles through the store, which a graph capture cannot hold.
        raise _ValueError(
            f"{_where(c)} the first call on a communicator sets up its buffers collectively "
            f"(device memory, CUDA IPC handles through the store) and cannot run inside a CUDA "
            f"graph capture: make one eager call first, or call "
            f"comm.device_alltoallv_prepare(max_output_bytes) on every rank before capturing"
        )
    td = None if timeout is None else _ms(timeout, _where(c))
    ms = 0 if td is None else int(td / datetime.timedelta(milliseconds=1))
    _C._device_alltoallv_single(
        c, _as_rows(output), _as_rows(input), output_split_sizes, input_split_sizes, ms, input_index
    )
    if not async_op or capturing:
        return TorchWork(_DoneWork())  # ordered on the caller's stream already
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(output.device))
    return TorchWork(_EventWork(event))


def prepare(c, max_output_bytes: int) -> None:
    """Collective, outside any graph capture: (re)makes the communicator's buffers so that a
    rank may receive up to ``max_output_bytes`` (the largest output any rank passes)."""
    where = _where(c)
    if isinstance(max_output_bytes, bool) or not isinstance(max_output_bytes, int):
        raise _TypeError(
            f"{where} max_output_bytes must be an int, got {type(max_output_bytes).__name__}"
        )
    c = _native(c)
    if torch.cuda.is_current_stream_capturing():
        raise _ValueError(f"{where} device_alltoallv_prepare cannot run inside a graph capture")
    _C._device_alltoallv_prepare(c, max_output_bytes)


def route(comm, output, input, output_split_sizes, input_split_sizes, async_op, timeout):
    """NOTE [all_to_all_v_single with CUDA splits]: ``all_to_all_v_single`` given both split
    sizes as CUDA integer tensors takes this path where it serves (an nvlink or nccl communicator
    with every rank on one host; not while torch.compile traces), so the host never reads them:
    the TorchWork, or None for the host path. Every rank must pass splits of the same kind (a
    rank on the host path and one here never meet). Where the setup refuses (ranks on several
    hosts: every rank is refused alike), the communicator remembers it and takes the host path,
    which reads each split tensor with one copy to the host. Sums below the tensors' rows are
    allowed here (the device path leaves the rest of the output as it was). The communicator's
    Python hooks do not see such a call: their all_to_all_v_single arguments carry the split
    sizes as host lists, which only a host read could give."""
    if not (
        isinstance(output_split_sizes, torch.Tensor)
        and isinstance(input_split_sizes, torch.Tensor)
        and output_split_sizes.is_cuda
        and input_split_sizes.is_cuda
    ):
        return None
    if getattr(comm, "_device_a2av_refused", False) or torch.compiler.is_compiling():
        return None
    c = comm._c
    try:
        _native(c)
    except UnsupportedError:
        comm._device_a2av_refused = True
        return None
    if output_split_sizes.dtype != torch.int64:
        output_split_sizes = output_split_sizes.to(torch.int64)
    if input_split_sizes.dtype != torch.int64:
        input_split_sizes = input_split_sizes.to(torch.int64)
    first = _C._device_alltoallv_info(c) is None
    try:
        return issue(c, output, input, output_split_sizes, input_split_sizes, async_op, timeout)
    except UnsupportedError:
        if not first:
            raise
        comm._device_a2av_refused = True  # the setup refused on every rank
        return None


def host_splits(splits) -> list:
    """Split sizes as a list of ints for the host path (a tensor: one copy to the host)."""
    if isinstance(splits, torch.Tensor):
        return [int(x) for x in splits.tolist()]
    return list(splits or ())
