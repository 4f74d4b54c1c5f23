# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""One-sided windows (torchcomms' ``TorchCommWindow``) and their attributes."""

from __future__ import annotations

import dataclasses
import datetime
import enum
import typing

import torch

from . import _C
from ._C import UnsupportedError
from ._options import _ms, _TypeError, _ValueError
from ._work import _DoneWork, _same

if typing.TYPE_CHECKING:
    from ._comm import TorchComm


class TorchCommWinAccessType(enum.Enum):
    """How a peer's window memory is reached (torchcomms' names): UNIFIED, loads and stores from
    this device reach it directly (NVLink peer mappings); SEPARATE, only through put/get."""

    WIN_ACCESS_TYPE_UNIFIED = 0
    WIN_ACCESS_TYPE_SEPARATE = 1


@dataclasses.dataclass(repr=False, eq=False)
class TorchCommWindowAttr:
    """A window's attributes for one peer (``TorchCommWindow.get_attr``)."""

    access_type: TorchCommWinAccessType = TorchCommWinAccessType.WIN_ACCESS_TYPE_SEPARATE

    def __repr__(self) -> str:
        return f"TorchCommWindowAttr(access_type={self.access_type})"


class TorchCommWindow:
    """A one-sided window (torchcomms' TorchCommWindow) of a backend that has them (nvlink, and
    nccl with every rank on one host): every rank registers a CUDA tensor of the same size
    (collective), peers' tensors are mapped here through CUDA IPC. ``put``, ``signal`` and
    ``wait_signal`` are enqueued on the caller's current stream (their TorchWork is complete at
    once). Not for CUDA graph capture. ``hints`` are accepted and unused; ``timeout`` bounds
    ``wait_signal`` (a wait that gives up leaves a TimeoutError for ``check_errors``)."""

    __copy__ = _same  # a copy is the window itself (torchcomms')

    def __deepcopy__(self, memo):
        """torchcomms' deep copy: a new window on the same communicator, holding a clone of the
        registered tensor (the memo maps the tensor to its clone). Collective, as new_window and
        tensor_register are: every rank deep-copies its window together."""
        if id(self) in memo:
            return memo[id(self)]
        new = TorchCommWindow(self._comm)
        if self._tensor is not None:
            clone = self._tensor.clone()
            new.tensor_register(clone)
            memo[id(self._tensor)] = clone
        memo[id(self)] = new
        return new

    def __init__(self, comm: TorchComm, tensor: torch.Tensor | None = None) -> None:
        self._comm = comm
        self._rank, self._size = comm.get_rank(), comm.get_size()
        self._device = comm.get_device()
        self._name = comm.get_name()
        self._w = comm._c.new_window()  # collective; the backend says if it has windows
        self._tensor = self._meta = None  # the tensor if owned; its (dtype, shape, itemsize, numel)
        self._locals = {}  # register_local_buffer's handles -> their tensors
        if tensor is not None:
            self.tensor_register(tensor)

    def _where(self, op: str) -> str:
        return f"[rank {self._rank}/{self._size} {self._name} {op}]"

    def _need(self, op: str) -> torch.Tensor:
        if self._meta is None:
            raise _ValueError(f"{self._where(op)} no tensor is registered; call tensor_register")
        return self._tensor

    def _peer(self, op: str, what: str, q) -> int:
        if isinstance(q, bool) or not isinstance(q, int):
            raise _TypeError(f"{self._where(op)} {what} must be an int, got {type(q).__name__}")
        if not 0 <= q < self._size:
            raise _ValueError(f"{self._where(op)} {what} must be in [0, {self._size}), got {q}")
        return q

    def _options(self, op: str, hints, timeout) -> int:
        """The timeout in ms (0: the communicator's), once the options are checked."""
        if hints is not None and not isinstance(hints, dict):
            raise _TypeError(f"{self._where(op)} hints must be a dict, got {type(hints).__name__}")
        td = _ms(timeout, self._where(op))
        return 0 if td is None else td // datetime.timedelta(milliseconds=1)

    # -- registration ----------------------------------------------------------------------------
    def tensor_register(self, tensor: torch.Tensor, owning: bool = True) -> None:
        """Collective: this rank's buffer (contiguous, on the communicator's device, the same bytes
        on every rank). ``owning=False``: the window keeps no reference (``get_tensor`` is None)."""
        if not isinstance(tensor, torch.Tensor):
            raise _TypeError(f"{self._where('tensor_register')} needs a tensor")
        if tensor.device != self._device or not tensor.is_contiguous():
            got = "a non-contiguous tensor" if tensor.device == self._device else tensor.device
            raise _ValueError(
                f"{self._where('tensor_register')} needs a contiguous tensor on {self._device}, "
                f"got {got}"
            )
        self._w.register_buffer(tensor)  # (refuses a second: already registered)
        self._tensor = tensor if owning else None
        self._meta = (tensor.dtype, list(tensor.shape), tensor.element_size(), tensor.numel())

    def tensor_deregister(self) -> None:
        """Collective: releases the registration once every rank's puts are done."""
        if self._meta is None:
            raise RuntimeError(f"{self._where('tensor_deregister')} no tensor is registered")
        self._w.deregister()
        self._tensor = self._meta = None

    # -- one-sided ops ---------------------------------------------------------------------------
    def put(self, tensor, dst_rank, target_offset_nelems, async_op=False, hints=None, timeout=None):
        """Copies ``tensor`` into ``dst_rank``'s buffer from element ``target_offset_nelems``."""
        self._need("put")
        self._options("put", hints, timeout)
        dtype, _, itemsize, _ = self._meta
        dst_rank = self._peer("put", "dst_rank", dst_rank)
        if tensor.device != self._device or not tensor.is_contiguous():
            raise _ValueError(f"{self._where('put')} needs a contiguous tensor on {self._device}")
        if tensor.dtype != dtype:
            raise _TypeError(
                f"{self._where('put')} tensor is {tensor.dtype}, the window holds {dtype}"
            )
        offset = int(target_offset_nelems)  # (bytes past the window: the C++ window refuses)
        self._w.put(tensor, dst_rank, offset * itemsize)
        return _DoneWork()

    def signal(self, peer_rank, async_op=False, hints=None, timeout=None):
        """Tells ``peer_rank`` that this rank's earlier puts (in stream order) are complete."""
        self._options("signal", hints, timeout)
        self._w.signal(self._peer("signal", "peer_rank", peer_rank))
        return _DoneWork()

    def wait_signal(self, peer_rank, async_op=False, hints=None, timeout=None):
        """Makes later work on the current stream wait for ``peer_rank``'s next signal, for at
        most ``timeout`` (default: the communicator's)."""
        ms = self._options("wait_signal", hints, timeout)
        self._w.wait_signal(self._peer("wait_signal", "peer_rank", peer_rank), ms)
        return _DoneWork()

    def map_remote_tensor(self, rank) -> torch.Tensor:
        """Rank ``rank``'s registered tensor, mapped on this device (for loads and stores)."""
        self._need("map_remote_tensor")
        dtype, shape, _, _ = self._meta
        like = torch.empty(0, dtype=dtype, device=self._device)
        return self._w.remote(self._peer("map_remote_tensor", "rank", rank), shape, like)

    def check_errors(self) -> None:
        """Raises TimeoutError if a wait_signal gave up waiting."""
        self._w.check_errors()

    # -- attributes ------------------------------------------------------------------------------
    def get_attr(self, peer_rank) -> TorchCommWindowAttr:
        """UNIFIED: every peer's buffer is mapped into this device through CUDA IPC."""
        self._peer("get_attr", "peer_rank", peer_rank)
        return TorchCommWindowAttr(TorchCommWinAccessType.WIN_ACCESS_TYPE_UNIFIED)

    def get_size(self) -> int:
        """Bytes of the registered buffer (0 when none)."""
        return self._w.bytes()

    def get_tensor(self) -> torch.Tensor | None:
        """The registered tensor; None when none is, or it was registered with owning=False."""
        return self._tensor

    @property
    def dtype(self):
        """The registered tensor's dtype (None before a registration)."""
        return None if self._meta is None else self._meta[0]

    @property
    def shape(self):
        """The registered tensor's shape as a list (None before a registration)."""
        return None if self._meta is None else list(self._meta[1])

    @property
    def device(self) -> torch.device:
        return self._device

    # -- the device API (torchcomms' get_device_window; docs/device_api.md) ---------------------
    def get_device_window(self, signal_count=-1, counter_count=-1, barrier_count=1) -> int:
        """Collective on the first call (every rank, after ``tensor_register``): a device pointer
        (an int, as torchcomms returns it) to this window's ``fastcomms::device::DeviceWindow``
        (``fastcomms/device/window.hpp``; Triton kernels pass it to ``fastcomms.triton``).
        ``signal_count`` / ``counter_count`` of -1 mean the communicator's size. Later calls
        return the same pointer (the first call's counts stand) until ``tensor_deregister``."""
        op = "get_device_window"
        for what, v in (
            ("signal_count", signal_count),
            ("counter_count", counter_count),
            ("barrier_count", barrier_count),
        ):
            if isinstance(v, bool) or not isinstance(v, int):
                raise _TypeError(f"{self._where(op)} {what} must be an int, got {type(v).__name__}")
        # (no tensor registered: the C++ window refuses)
        return _C.device_window(self._w, signal_count, counter_count, barrier_count)

    def register_local_buffer(self, tensor) -> int:
        """Not collective: a device pointer (int) to a ``RegisteredBuffer`` over ``tensor`` (a
        contiguous tensor on the communicator's device), the source of device ``put``. Needs
        ``get_device_window()`` first. The window keeps the tensor alive until the handle is
        deregistered."""
        op = "register_local_buffer"
        if not isinstance(tensor, torch.Tensor):
            raise _TypeError(f"{self._where(op)} needs a tensor, got {type(tensor).__name__}")
        if tensor.device != self._device or not tensor.is_contiguous():
            got = "a non-contiguous tensor" if tensor.device == self._device else tensor.device
            raise _ValueError(
                f"{self._where(op)} needs a contiguous tensor on {self._device}, got {got}"
            )
        handle = _C.register_local_buffer(self._w, tensor)
        self._locals[handle] = tensor  # kept alive while the handle is
        return handle

    def deregister_local_buffer(self, handle) -> None:
        """Frees a handle from ``register_local_buffer`` (after this device's work)."""
        op = "deregister_local_buffer"
        if isinstance(handle, bool) or not isinstance(handle, int):
            raise _TypeError(
                f"{self._where(op)} handle must be an int, got {type(handle).__name__}"
            )
        _C.deregister_local_buffer(self._w, handle)
        self._locals.pop(handle, None)

    def get_nvlink_address(self, peer, offset=0) -> int:
        """``peer``'s registered buffer, mapped on this device, plus ``offset`` bytes, as an int
        (torchcomms' NCCLX window method)."""
        self._need("get_nvlink_address")
        peer = self._peer("get_nvlink_address", "peer", peer)
        return self.map_remote_tensor(peer).data_ptr() + int(offset)

    def get_multimem_address(self, offset=0):
        """Refused: fastcomms never creates NVLink multicast objects (shared machines must not);
        the device window's ``get_multimem_address`` returns a null pointer likewise."""
        raise UnsupportedError(
            f"{self._where('get_multimem_address')} NVLink multicast (multimem) is not used by "
            "fastcomms; reduce with get_nvlink_address loads instead"
        )

    def _arm_device_faults(self, flags: int) -> None:
        """Tests only (NOTE [device window ordering]): sets the device window's fault bits."""
        _C.arm_device_faults(self._w, int(flags))


def transport_counts(n: int) -> tuple[int, int, int]:
    """(signal_count, counter_count, barrier_count) of a device transport of n ranks (NOTE
    [device transport ids] in fastcomms/device/transport.hpp)."""
    return 2 * n + 2, 2 * n + n * n, n


def store_window(rank, size, device, store_dir, name="window", timeout=None, tensor=None):
    """Collective over ``store_dir`` (a folder every rank of the group sees): a
    ``TorchCommWindow`` with no communicator, for ranks that cannot share an NCCL communicator
    (MPS clients of one GPU, which NCCL refuses) but may share CUDA IPC windows and their device
    API (NOTE [store windows]). ``timeout`` (``datetime.timedelta``, default 600 s) bounds store
    waits and device waits. Deep copies are not offered (there is no communicator)."""
    device = torch.device(device)
    if device.type != "cuda" or device.index is None:
        raise _ValueError(f"[rank {rank}/{size} {name} store_window] needs a cuda:N device")
    ms = 600_000 if timeout is None else timeout // datetime.timedelta(milliseconds=1)
    self = TorchCommWindow.__new__(TorchCommWindow)
    self._comm = None
    self._rank, self._size, self._device, self._name = rank, size, device, name
    self._w = _C.store_window(rank, size, device.index, str(store_dir), name, ms)
    self._tensor = self._meta = None
    self._locals = {}
    if tensor is not None:
        self.tensor_register(tensor)
    return self
