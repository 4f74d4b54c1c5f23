# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Object collectives over a TorchComm, with torchcomms' signatures: Python objects travel as
bytes (``torch.save``), sizes first so every rank sizes its buffers before the bytes move.

``weights_only=True`` (the default) loads with ``torch.load(weights_only=True)``: tensors,
numbers, strings and containers of them load; anything else (a pickled class, which would run
code on the receiving rank) is refused unless ``weights_only=False`` is passed."""

from __future__ import annotations

import io
from datetime import timedelta
from typing import Any

import torch

__all__ = [
    "all_gather_object",
    "gather_object",
    "send_object_list",
    "recv_object_list",
    "broadcast_object_list",
    "scatter_object_list",
]


def _to_bytes(obj: object) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _to_tensor(data: bytes, size: int, comm) -> torch.Tensor:
    """``data`` in a uint8 tensor of ``size`` bytes (at least 1, zero padded) on comm's device."""
    t = torch.zeros(max(size, 1), dtype=torch.uint8, device=comm.get_device())
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def _int64(comm, values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=comm.get_device())


def _fill(object_list: list[Any], chunks, sizes: list[int], weights_only: bool) -> None:
    """``object_list[i]``: the object in the first ``sizes[i]`` bytes of ``chunks[i]``."""
    for i, (t, size) in enumerate(zip(chunks, sizes, strict=False)):
        data = t[:size].cpu().numpy().tobytes()
        object_list[i] = torch.load(io.BytesIO(data), weights_only=weights_only)


def _gathered_sizes(comm, obj: object, timeout) -> tuple[list[int], torch.Tensor]:
    """Every rank's byte count, and ``obj``'s bytes padded to the largest."""
    data = _to_bytes(obj)
    out = _int64(comm, [0] * comm.get_size())
    comm.all_gather_single(out, _int64(comm, [len(data)]), False, timeout=timeout)
    sizes = out.tolist()
    return sizes, _to_tensor(data, max(sizes), comm)


def _move(comm, move, object_list: list[Any], sending: bool, weights_only=True) -> None:
    """Moves ``object_list`` with ``move(tensor)``: its byte counts, then its bytes in one buffer;
    the receiving side fills its list."""
    blobs = [_to_bytes(o) for o in object_list] if sending else []
    sizes = _int64(comm, [len(b) for b in blobs] if sending else [0] * len(object_list))
    move(sizes)
    sizes = sizes.tolist()
    data = _to_tensor(b"".join(blobs), sum(sizes), comm)
    move(data)
    if not sending:
        _fill(object_list, data[: sum(sizes)].split(sizes), sizes, weights_only)


def all_gather_object(
    comm,
    object_list: list[Any],
    obj: object,
    timeout: timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """Fills ``object_list`` (one slot per rank) with every rank's ``obj``."""
    n = comm.get_size()
    if len(object_list) != n:
        raise ValueError(
            f"all_gather_object: object_list must have {n} slots, got {len(object_list)}"
        )
    sizes, mine = _gathered_sizes(comm, obj, timeout)
    out = _to_tensor(b"", mine.numel() * n, comm)
    comm.all_gather_single(out, mine, False, timeout=timeout)
    _fill(object_list, out.chunk(n), sizes, weights_only)


def gather_object(
    comm,
    obj: object,
    root: int,
    object_gather_list: list[Any] | None = None,
    timeout: timedelta | None = None,
    weights_only: bool = True,
) -> None:
    """On ``root``, fills ``object_gather_list`` (one slot per rank) with every rank's ``obj``."""
    n, me = comm.get_size(), comm.get_rank()
    if me == root and (object_gather_list is None or len(object_gather_list) != n):
        raise ValueError(f"gather_object: the root needs an object_gather_list of {n} slots")
    sizes, mine = _gathered_sizes(comm, obj, timeout)
    outs = [_to_tensor(b"", mine.numel(), comm) for _ in range(n)] if me == root else []
    comm.gather(outs, mine, root, False, timeout=timeout)
    if me == root:
        _fill(object_gather_list, outs, sizes, weights_only)


def send_object_list(comm, object_list: list[Any], dst: int, timeout: timedelta | None = None):
    """Sends every object of ``object_list`` to ``dst`` (which calls recv_object_list with a list
    of the same length)."""
    _move(comm, lambda t: comm.send(t, dst, False, timeout=timeout), object_list, True)


def recv_object_list(
    comm,
    object_list: list[Any],
    src: int,
    timeout: timedelta | None = None,
    weights_only: bool = True,
):
    """Fills ``object_list`` with the objects ``src`` sent with send_object_list."""
    move = lambda t: comm.recv(t, src, False, timeout=timeout)  # noqa: E731
    _move(comm, move, object_list, False, weights_only)


def broadcast_object_list(
    comm,
    object_list: list[Any],
    root: int,
    timeout: timedelta | None = None,
    weights_only: bool = True,
):
    """Replaces ``object_list`` on every rank with ``root``'s (the lists have the same length)."""
    move = lambda t: comm.broadcast(t, root, False, timeout=timeout)  # noqa: E731
    _move(comm, move, object_list, comm.get_rank() == root, weights_only)


def scatter_object_list(
    comm,
    root: int,
    scatter_object_output_list: list[Any],
    scatter_object_input_list: list[Any] | None = None,
    timeout: timedelta | None = None,
    weights_only: bool = True,
):
    """Rank q receives ``scatter_object_input_list[q]`` (given on ``root``) in
    ``scatter_object_output_list[0]``."""
    n, me = comm.get_size(), comm.get_rank()
    if not scatter_object_output_list:
        raise ValueError("scatter_object_list: scatter_object_output_list needs one slot")
    if me == root and (scatter_object_input_list is None or len(scatter_object_input_list) != n):
        raise ValueError(f"scatter_object_list: the root needs {n} input objects")
    blobs = [_to_bytes(o) for o in scatter_object_input_list] if me == root else []
    sizes = _int64(comm, [len(b) for b in blobs] if me == root else [0] * n)
    comm.broadcast(sizes, root, False, timeout=timeout)
    sizes = sizes.tolist()
    width = max(sizes)
    out = _to_tensor(b"", width, comm)
    comm.scatter(out, [_to_tensor(b, width, comm) for b in blobs], root, False, timeout=timeout)
    _fill(scatter_object_output_list, [out], sizes[me : me + 1], weights_only)
