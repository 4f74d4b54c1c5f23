# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The backend registry: the built-in backends (the extension's), Python backends
(``register_backend``, the ``fastcomms.backends`` / ``torchcomms.backends`` entry points), and
what the machine offers them (``nvlink_matrix``, ``get_mem_allocator``)."""

from __future__ import annotations

import torch

from . import _C, _native
from ._C import UnsupportedError
from ._options import _TypeError, _ValueError


class TorchCommBackend:
    """Base class of backends written in Python (torchcomms' protocol): ``new_comm`` makes
    ``cls()`` and calls ``init(device, name, options)``; the TorchComm's ops call the methods of
    the same names, each returning None (done) or an object with ``wait()``; missing ones raise
    UnsupportedError."""

    def init(self, device, name, options) -> None:
        raise NotImplementedError("a TorchCommBackend must define init(device, name, options)")


_python_backends: dict[str, type] = {}


def register_backend(name: str, cls: type) -> None:
    """Registers a Python backend class under ``name``."""
    if not name:
        raise _ValueError("register_backend: name is empty")
    _python_backends[name] = cls


def _load_entry_point_backends() -> None:
    """Backends installed by other distributions (entry points, torchcomms' group too)."""
    from importlib.metadata import entry_points

    for group in ("fastcomms.backends", "torchcomms.backends"):
        for ep in entry_points(group=group):
            if ep.name in _python_backends or _C.is_backend_built(ep.name):
                continue
            obj = ep.load()  # importing the module may register it itself
            if ep.name not in _python_backends and isinstance(obj, type):
                register_backend(ep.name, obj)  # `name = module:BackendClass`


def nvlink_matrix(devices) -> dict[tuple[int, int], bool] | None:
    """NVML's answer pair by pair for these CUDA ordinals: ``{(a, b): joined}``, or None when
    NVML cannot answer (no NVML, no CUDA layer); never a guess."""
    return _C.nvlink_matrix([int(d) for d in devices])[0]  # (matrix, why)


_window_allocators: dict[str, object] = {}  # one per backend per process


def get_mem_allocator(backend: str):
    """The CUDA allocator for window memory of "nccl" or "nvlink" (torchcomms'), for
    ``torch.cuda.MemPool(allocator)``: each block its own ``cudaMalloc``, which CUDA IPC can
    share whatever ``PYTORCH_CUDA_ALLOC_CONF`` says (NOTE [window memory allocator])."""
    if backend not in ("nccl", "nvlink") or not _C.is_backend_built(backend):
        raise UnsupportedError(
            f"get_mem_allocator: backend {backend!r} has no window memory allocator (the CUDA "
            f"backends nccl and nvlink have one; built here: {', '.join(built_backends())})"
        )
    if backend not in _window_allocators:
        if (lib := _native.core_library()) is None:
            raise UnsupportedError("get_mem_allocator: libfastcomms.so is not beside the package")
        alloc, free = "fastcomms_window_alloc", "fastcomms_window_free"
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(lib, alloc, free)
        _window_allocators[backend] = pluggable.allocator()
    return _window_allocators[backend]


def native_comm(
    backend: str, rank: int, size: int, device: torch.device, store, options
) -> _C.Comm:
    """Collective: the extension's communicator of a built-in backend (the options' timeout
    bounds the rendezvous)."""
    o, index = options, -1 if device.index is None else device.index
    timeout, abort = o.timeout, o.abort_process_on_timeout_or_error
    return _C.Comm(backend, rank, size, device.type, index, store, timeout, abort, o.name, o.hints)


def is_backend_built(name: str) -> bool:
    return _C.is_backend_built(name) or name in _python_backends


def _is_backend_registered(name: str) -> bool:
    """torchcomms' ``_comms._is_backend_registered(name)``: whether ``new_comm(name, ...)`` finds a
    backend of that name now (built in, or registered with ``register_backend``); entry points
    not yet loaded are not asked, as torchcomms' factory does not load libraries to answer."""
    if not isinstance(name, str):
        raise _TypeError(f"_is_backend_registered: name must be a str, got {type(name).__name__}")
    return _C.is_backend_built(name) or name in _python_backends


def built_backends() -> list[str]:
    return sorted(set(_C.built_backends()) | set(_python_backends))
