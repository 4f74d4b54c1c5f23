# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Object collectives over a TorchComm, with torchcomms' signatures: Python objects travel as
bytes (``torch.save``), sizes first so every rank sizes its buffers before the bytes move.

``weights_only=True`` (the default) loads with ``torch.load(weights_only=True)``: tensors,
numbers, strings and containers of them load; anything else (a pickled class, which would run
code on the receiving rank) is refused unless ``weights_only=False`` is passed."""

from __future__ import annotations

import io
import itertools
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
    """`data` in a uint8 tensor of `size` bytes (zero padded) on the communicator's device."""
    t = torch.zeros(max(size, 1), dtype=torch.uint8)
    if data:
        t[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t.to(comm.get_device())


def _bytes(comm, size: int) -> torch.Tensor:
    """An uninitialized uint8 tensor of `size` bytes (at least 1) on the communicator's device."""
    return torch.empty(max(size, 1), dtype=torch.uint8, device=comm.get_device())


def _int64(comm, values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=comm.get_device())


def _from_tensor(t: torch.Tensor, size: int, weights_only: bool) -> object:
    data = t[:size].cpu().numpy().tobytes()
    return torch.load(io.BytesIO(data), weights_only=weights_only)


def _unpack(object_list: list[Any], data: torch.Tensor, sizes: list[int], weights_only) -> None:
    """Fills ``object_list`` with the objects packed one after another in ``data``."""
    for i, (off, s) in enumerate(zip(itertools.accumulate([0, *sizes]), sizes, strict=False)):
        object_list[i] = _from_tensor(data[off : off + s], s, weights_only)


def _sizes(comm, mine: int, timeout) -> list[int]:
    """Every rank's byte count."""
    out = _int64(comm, [0] * comm.get_size())
    comm.all_gather_single(out, _int64(comm, [mine]), False, timeout=timeout)
    return out.tolist()


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
    data = _to_bytes(obj)
    sizes = _sizes(comm, len(data), timeout)
    width = max(max(sizes), 1)
    out = _bytes(comm, width * n)
    comm.all_gather_single(out, _to_tensor(data, width, comm), False, timeout=timeout)
    for q in range(n):
        object_list[q] = _from_tensor(out[q * width : (q + 1) * width], sizes[q], weights_only)


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
    data = _to_bytes(obj)
    sizes = _sizes(comm, len(data), timeout)
    width = max(max(sizes), 1)
    outs = [_bytes(comm, width) for _ in range(n)] if me == root else []
    comm.gather(outs, _to_tensor(data, width, comm), root, False, timeout=timeout)
    if me == root:
        for q in range(n):
            object_gather_list[q] = _from_tensor(outs[q], sizes[q], weights_only)


def send_object_list(comm, object_list: list[Any], dst: int, timeout: timedelta | None = None):
    """Sends every object of ``object_list`` to ``dst`` (which calls recv_object_list with a list
    of the same length)."""
    blobs = [_to_bytes(o) for o in object_list]
    sizes = _int64(comm, [len(b) for b in blobs])
    comm.send(sizes, dst, False, timeout=timeout)
    total = int(sizes.sum())
    comm.send(_to_tensor(b"".join(blobs), total, comm), dst, False, timeout=timeout)


def recv_object_list(
    comm,
    object_list: list[Any],
    src: int,
    timeout: timedelta | None = None,
    weights_only: bool = True,
):
    """Fills ``object_list`` with the objects ``src`` sent with send_object_list."""
    sizes = _int64(comm, [0] * len(object_list))
    comm.recv(sizes, src, False, timeout=timeout)
    sizes_l = sizes.tolist()
    data = _bytes(comm, sum(sizes_l))
    comm.recv(data, src, False, timeout=timeout)
    _unpack(object_list, data, sizes_l, weights_only)


def broadcast_object_list(
    comm,
    object_list: list[Any],
    root: int,
    timeout: timedelta | None = None,
    weights_only: bool = True,
):
    """Replaces ``object_list`` on every rank with ``root``'s (the lists have the same length)."""
    me = comm.get_rank()
    blobs = [_to_bytes(o) for o in object_list] if me == root else []
    sizes = _int64(comm, [len(b) for b in blobs] if me == root else [0] * len(object_list))
    comm.broadcast(sizes, root, False, timeout=timeout)
    sizes_l = sizes.tolist()
    total = sum(sizes_l)
    data = _to_tensor(b"".join(blobs), total, comm) if me == root else _bytes(comm, total)
    comm.broadcast(data, root, False, timeout=timeout)
    if me != root:
        _unpack(object_list, data, sizes_l, weights_only)


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
    sizes_l = sizes.tolist()
    width = max(max(sizes_l), 1)
    ins = [_to_tensor(b, width, comm) for b in blobs] if me == root else []
    out = _bytes(comm, width)
    comm.scatter(out, ins, root, False, timeout=timeout)
    scatter_object_output_list[0] = _from_tensor(out, sizes_l[me], weights_only)
