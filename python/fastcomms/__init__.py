# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""fastcomms: a torchcomms-compatible communicator API and a fast Ulysses all-to-all.

Code written for torchcomms runs after ``import fastcomms as torchcomms`` (the parts built so
far: the gloo backend on CPU tensors; see docs/status.md for what has run where).
"""

from __future__ import annotations

import datetime
import enum
import functools
import itertools
import os
import time
import typing
from pkgutil import extend_path

import torch  # noqa: F401  (loads libtorch before the extension)

try:  # torch.compile takes instances of these classes as opaque objects (NOTE [ulysses custom op])
    from torch._opaque_base import OpaqueBase as _OpaqueBase
except ImportError:  # pragma: no cover
    _OpaqueBase = object


_compiled = None  # the module, once a communicator exists


def _compiling() -> bool:  # NOTE [compiled communicator methods]; rebound by _load_compiled
    return torch.compiler.is_compiling()


def _eager_grad() -> bool:
    """NOTE [eager autograd]: torchcomms' ``TORCHCOMMS_PATCH_FOR_COMPILE=1`` makes its eager
    methods differentiable where a tensor of the call needs a gradient; read at each call."""
    return os.environ.get("TORCHCOMMS_PATCH_FOR_COMPILE") == "1"


def _load_compiled():
    """NOTE [compiled communicator methods]: imports ``_compiled`` (its custom op) when the first
    communicator is made, not at import: torch imports this package while it initializes itself
    where a ``torchcomms`` alias points here, and neither ``torch.compiler`` nor
    ``torch.library`` exists then."""
    global _compiled, _compiling
    import importlib

    _register_opaque()  # (its op takes a TorchComm)
    _waits.register()  # NOTE [torchcomms wait ops]
    _compiled = importlib.import_module(f"{__name__}._compiled")  # (the name is bound: None)
    _compiling = torch.compiler.is_compiling
    return _compiled


__path__ = extend_path(__path__, __name__)  # the built extension may live in a build tree


# NOTE [gloo symbols]: torch exports its own, newer Gloo build; our gloo backend links Debian's.
# libfastcomms.so is therefore loaded first, by itself, with RTLD_DEEPBIND: it and the libraries
# it brings (libgloo) resolve their own symbols before anything global, so the two Gloo builds
# never mix (mixing them crashed as soon as two ranks connected). The extension then reuses it.
def _core_library() -> str | None:
    """The path of libfastcomms.so beside the package (None where the extension links it some
    other way)."""
    import glob

    for d in __path__:
        for lib in glob.glob(os.path.join(d, "libfastcomms.so")):
            return lib
    return None


def _load_core() -> None:
    import ctypes

    if lib := _core_library():
        ctypes.CDLL(lib, mode=os.RTLD_NOW | os.RTLD_LOCAL | os.RTLD_DEEPBIND)


_load_core()
from . import _C, _bootstrap  # noqa: E402

__version__ = _C.__version__  # the VERSION file (one literal for CMake, pyproject and Python)
from . import _hook_types as _ht  # noqa: E402
from ._C import AbortedError, BackendError, RedOpType, UnsupportedError, WorkStatus  # noqa: E402
from ._hook_types import *  # noqa: E402,F401,F403  (OpName and the hook argument classes)

# Argument and type errors raised here are the extension's: ValueError / TypeError and RuntimeError
# at once (NOTE [error mapping] in python/src/binding.cpp), as torchcomms raises RuntimeError.
_ValueError, _TypeError = _C.ValueError, _C.TypeError

__all__ = [
    "new_comm",
    "TorchComm",
    "TorchWork",
    "WorkStatus",
    "ReduceOp",
    "RedOpType",
    "CommOptions",
    "ReconfigureOptions",
    "TorchCommWindow",
    "TorchCommWindowAttr",
    "TorchCommWinAccessType",
    "BatchSendRecv",
    "P2POp",
    "P2POpType",
    "BatchP2POptions",
    "Timeout",
    "RemovableHandle",
    "register_backend",
    "TorchCommBackend",
    "is_backend_built",
    "built_backends",
    "nvlink_matrix",
    "get_mem_allocator",
    "AbortedError",
    "BackendError",
    "UnsupportedError",
]
__all__ += _ht.__all__

_DEFAULT_TIMEOUT = datetime.timedelta(seconds=600)
_names = itertools.count()
_op_ids = itertools.count(1)  # NOTE [op ids]


class ReduceOp:
    """A reduction: ``ReduceOp.SUM`` ... and ``ReduceOp.PREMUL_SUM(factor)``; ``.type`` gives
    the RedOpType."""

    # set below, one per RedOpType but PREMUL_SUM (declared for type checkers and IDEs)
    SUM: typing.ClassVar[ReduceOp]
    PRODUCT: typing.ClassVar[ReduceOp]
    MIN: typing.ClassVar[ReduceOp]
    MAX: typing.ClassVar[ReduceOp]
    BAND: typing.ClassVar[ReduceOp]
    BOR: typing.ClassVar[ReduceOp]
    BXOR: typing.ClassVar[ReduceOp]
    AVG: typing.ClassVar[ReduceOp]

    def __init__(self, type: RedOpType, factor: float = 1.0) -> None:  # noqa: A002
        self.type = type
        self.factor = float(factor)

    def __repr__(self) -> str:
        if self.type == RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({self.factor})"
        return f"ReduceOp.{self.type.name}"

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ReduceOp) and other.type == self.type and other.factor == self.factor
        )

    def __hash__(self) -> int:
        return hash((self.type, self.factor))

    @staticmethod
    def PREMUL_SUM(factor: float) -> ReduceOp:  # noqa: N802 (torchcomms' spelling)
        return ReduceOp(RedOpType.PREMUL_SUM, factor)


for _t in (
    RedOpType.SUM,
    RedOpType.PRODUCT,
    RedOpType.MIN,
    RedOpType.MAX,
    RedOpType.BAND,
    RedOpType.BOR,
    RedOpType.BXOR,
    RedOpType.AVG,
):
    setattr(ReduceOp, _t.name, ReduceOp(_t))


def _env_bool(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    if v.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if v.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise _ValueError(f"{name} must be true or false (1/0, yes/no, on/off), got {v!r}")


def _env_timeout() -> datetime.timedelta:
    v = os.environ.get("TORCHCOMM_TIMEOUT_SECONDS")
    if v is None or v == "":
        return _DEFAULT_TIMEOUT
    try:
        seconds = float(v)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise _ValueError(f"TORCHCOMM_TIMEOUT_SECONDS must be a positive number, got {v!r}")
    return datetime.timedelta(seconds=seconds)


class CommOptions:
    """Communicator options as torchcomms spells them. Unset fields take their defaults from
    ``TORCHCOMM_TIMEOUT_SECONDS`` (else 600 s) and ``TORCHCOMM_ABORT_ON_ERROR``. Unlike
    torchcomms, whose abort default is true, fastcomms aborts the process only when asked
    (the argument or the variable): a timeout or an error is an exception by default."""

    def __init__(
        self,
        abort_process_on_timeout_or_error: bool | None = None,
        timeout: datetime.timedelta | None = None,
        store=None,
        hints: dict[str, str] | None = None,
        name: str = "",
        enable_reconfigure: bool = False,
    ) -> None:
        if abort_process_on_timeout_or_error is None:
            abort_process_on_timeout_or_error = _env_bool("TORCHCOMM_ABORT_ON_ERROR", False)
        self.abort_process_on_timeout_or_error = bool(abort_process_on_timeout_or_error)
        self.timeout = _env_timeout() if timeout is None else _ms(timeout)
        self.store = store
        self.hints = dict(hints or {})
        self.name = name
        self.enable_reconfigure = bool(enable_reconfigure)


class TorchWork:
    """A handle on an issued op: ``wait()``, ``is_completed()``, ``status()``. Keeps the op's
    tensors alive until it completes."""

    def __init__(self, work: _C.Work) -> None:
        self._work = work
        self._observer = None  # fn(event, payload), set when something observes the op

    def wait(self) -> None:
        try:
            self._work.wait()
        except TimeoutError as e:
            if self._observer is not None:
                self._observer("timeout", e)
            raise
        if self._observer is not None:
            self._observer("waited", self)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def status(self) -> WorkStatus:
        return self._work.status()

    def wait_blocking(self) -> None:
        """Blocks this thread until the op has finished (``wait()`` on a CUDA backend only
        orders the caller's stream); raises the op's error like ``wait()``."""
        self.wait()
        delay = 1e-5
        while not self._work.is_completed():
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        if self._work.status() != WorkStatus.COMPLETED:
            self.wait()  # rethrows the error that ended it


class RemovableHandle:
    """Returned by the hook registrations; ``remove()`` unregisters (idempotent)."""

    def __init__(self, remover) -> None:
        self._remover = remover

    def remove(self) -> None:
        if self._remover is not None:
            self._remover()
            self._remover = None


class P2POpType(enum.Enum):
    """The kind of a point-to-point op in a batch (torchcomms')."""

    SEND = 1
    RECV = 2


class P2POp:
    """One point-to-point op of a batch: ``P2POp(P2POpType.SEND, tensor, peer)`` as torchcomms;
    "send"/"recv" or the bound ``send``/``recv`` methods are accepted for the type too."""

    def __init__(self, type, tensor: torch.Tensor, peer: int) -> None:  # noqa: A002
        if not isinstance(type, P2POpType):
            name = type if isinstance(type, str) else getattr(type, "__name__", "")
            if name not in ("send", "recv", "isend", "irecv"):
                raise _ValueError(f"P2POp: type must be P2POpType.SEND or RECV, got {type!r}")
            type = P2POpType.SEND if name in ("send", "isend") else P2POpType.RECV  # noqa: A001
        self.type = type
        self.tensor = tensor
        self.peer = int(peer)

    @property
    def is_send(self) -> bool:
        return self.type is P2POpType.SEND


class BatchP2POptions:
    """Options of ``BatchSendRecv.issue`` (torchcomms'): ``timeout`` and ``hints``."""

    def __init__(self) -> None:
        self.timeout: datetime.timedelta | None = None
        self.hints: dict[str, str] = {}


class BatchSendRecv:
    """``comm.batch_op_create()``: collect sends and receives, then ``issue(async_op)``."""

    def __init__(self, comm: TorchComm) -> None:
        self._comm = comm
        self.ops: list[P2POp] = []

    def send(self, tensor: torch.Tensor, dst: int) -> BatchSendRecv:
        self.ops.append(P2POp(P2POpType.SEND, tensor, dst))
        return self

    def recv(self, tensor: torch.Tensor, src: int) -> BatchSendRecv:
        self.ops.append(P2POp(P2POpType.RECV, tensor, src))
        return self

    def issue(self, async_op: bool, options=None, hints=None, timeout=None) -> TorchWork:
        """Issues the batch. ``options`` (torchcomms' BatchP2POptions) may carry ``hints`` and
        ``timeout``."""
        if options is not None:
            hints = getattr(options, "hints", None) or hints
            timeout = getattr(options, "timeout", None) or timeout
        ops = [(op.is_send, op.tensor, op.peer) for op in self.ops]
        comm = self._comm
        if _compiling():  # NOTE [compiled communicator methods]
            return _compiled.batch(comm, ops, hints, timeout, async_op)
        return comm._run(
            _ht.OpName.batch_op_issue,
            lambda: _ht.BatchOpIssuePreHookArgs(len(ops), async_op),
            lambda: TorchWork(comm._c.batch(ops, async_op, _ms(timeout), hints)),
            _ht.BatchOpIssuePostHookArgs,
        )


class _DoneWork:
    """The TorchWork of a stream-ordered op: already ordered on the caller's current stream."""

    def wait(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True

    def status(self) -> WorkStatus:
        return WorkStatus.COMPLETED


class TorchCommWinAccessType(enum.Enum):
    """How a peer's window memory is reached (torchcomms' names): UNIFIED, loads and stores from
    this device reach it directly (NVLink peer mappings); SEPARATE, only through put/get."""

    WIN_ACCESS_TYPE_UNIFIED = 0
    WIN_ACCESS_TYPE_SEPARATE = 1


class TorchCommWindowAttr:
    """A window's attributes for one peer (``TorchCommWindow.get_attr``)."""

    def __init__(self) -> None:
        self.access_type = TorchCommWinAccessType.WIN_ACCESS_TYPE_SEPARATE

    def __repr__(self) -> str:
        return f"TorchCommWindowAttr(access_type={self.access_type})"


class TorchCommWindow:
    """A one-sided window (torchcomms' TorchCommWindow) of a backend that has them (nvlink, and
    nccl with every rank on one host): every rank registers a CUDA tensor of the same size
    (collective), peers' tensors are mapped here through CUDA IPC. ``put`` copies into a peer's
    tensor, ``signal``/``wait_signal`` order a peer's puts before this rank's later work; all are
    enqueued on the caller's current stream
    (their TorchWork is complete at once: the stream orders them). Not for CUDA graph capture.
    ``hints`` are accepted and unused; ``timeout`` bounds ``wait_signal`` (a wait that gives up
    leaves a TimeoutError for ``check_errors`` and the next window call)."""

    # a handle, as the communicator (TorchComm.__copy__)
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        memo[id(self)] = self
        return self

    def __init__(self, comm: TorchComm, tensor: torch.Tensor | None = None) -> None:
        self._comm = comm
        self._rank, self._size = comm.get_rank(), comm.get_size()
        self._device = comm.get_device()
        self._w = comm._c.new_window()  # collective; the backend says if it has windows
        self._tensor = None  # the registered tensor when the window owns it
        self._meta = None  # (dtype, shape, itemsize, numel) of the registered tensor
        if tensor is not None:
            self.tensor_register(tensor)

    def _where(self, op: str) -> str:
        return f"[rank {self._rank}/{self._size} {self._comm.get_name()} {op}]"

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
        """Checks the per-call options; returns the timeout in ms (0: the communicator's)."""
        if hints is not None and not isinstance(hints, dict):
            raise _TypeError(f"{self._where(op)} hints must be a dict, got {type(hints).__name__}")
        td = _ms(timeout, self._where(op))
        return 0 if td is None else td // datetime.timedelta(milliseconds=1)

    # -- registration ----------------------------------------------------------------------------
    def tensor_register(self, tensor: torch.Tensor, owning: bool = True) -> None:
        """Collective: this rank's buffer (a contiguous tensor on the communicator's device, the
        same number of bytes on every rank). ``owning=False``: the window keeps no reference
        (the caller keeps the tensor alive while the window uses it; ``get_tensor`` is None)."""
        if not isinstance(tensor, torch.Tensor):
            raise _TypeError(f"{self._where('tensor_register')} needs a tensor")
        if tensor.device != self._device or not tensor.is_contiguous():
            raise _ValueError(
                f"{self._where('tensor_register')} needs a contiguous tensor on {self._device}, "
                "got "
                + (
                    "a non-contiguous tensor"
                    if tensor.device == self._device
                    else str(tensor.device)
                )
            )
        if self._meta is not None:
            raise RuntimeError(
                f"{self._where('tensor_register')} a tensor is already registered; call "
                "tensor_deregister first"
            )
        self._w.register_buffer(tensor)
        self._tensor = tensor if owning else None
        self._meta = (tensor.dtype, list(tensor.shape), tensor.element_size(), tensor.numel())

    def tensor_deregister(self) -> None:
        """Collective: releases the registration once every rank's puts are done."""
        if self._meta is None:
            raise RuntimeError(f"{self._where('tensor_deregister')} no tensor is registered")
        self._w.deregister()
        self._tensor = None
        self._meta = None

    # -- one-sided ops ---------------------------------------------------------------------------
    def put(self, tensor, dst_rank, target_offset_nelems, async_op=False, hints=None, timeout=None):
        """Copies ``tensor`` into rank ``dst_rank``'s buffer from element
        ``target_offset_nelems`` (elements of the registered tensor's dtype)."""
        self._need("put")
        self._options("put", hints, timeout)
        dtype, _, itemsize, numel = self._meta
        dst_rank = self._peer("put", "dst_rank", dst_rank)
        if tensor.device != self._device or not tensor.is_contiguous():
            raise _ValueError(f"{self._where('put')} needs a contiguous tensor on {self._device}")
        if tensor.dtype != dtype:
            raise _TypeError(
                f"{self._where('put')} tensor is {tensor.dtype}, the window holds {dtype}"
            )
        offset = int(target_offset_nelems)
        if offset < 0 or offset + tensor.numel() > numel:
            raise _ValueError(
                f"{self._where('put')} elements [{offset}, {offset + tensor.numel()}) do not fit "
                f"the window of {numel}"
            )
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
        """Rank ``rank``'s registered tensor, mapped on this device (kernels may read and write
        it directly; pair such writes with signal/wait_signal)."""
        self._need("map_remote_tensor")
        dtype, shape, _, _ = self._meta
        like = torch.empty(0, dtype=dtype, device=self._device)
        return self._w.remote(self._peer("map_remote_tensor", "rank", rank), shape, like)

    def check_errors(self) -> None:
        """Raises TimeoutError if a wait_signal gave up waiting."""
        self._w.check_errors()

    # -- attributes ------------------------------------------------------------------------------
    def get_attr(self, peer_rank) -> TorchCommWindowAttr:
        """How ``peer_rank``'s buffer is reached: UNIFIED (the window maps every peer's buffer
        into this device through CUDA IPC with peer access, over NVLink where the GPUs have it,
        so ``map_remote_tensor`` gives loads and stores)."""
        self._peer("get_attr", "peer_rank", peer_rank)
        attr = TorchCommWindowAttr()
        attr.access_type = TorchCommWinAccessType.WIN_ACCESS_TYPE_UNIFIED
        return attr

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

    # -- the device-side window API (torchcomms' NCCLX path) --------------------------------------
    def _no_device_window(self, op: str):
        raise UnsupportedError(
            f"{self._where(op)} device-side windows (get_device_window, local buffer handles for "
            "kernels that issue RMA themselves) are an NCCLX feature fastcomms does not have; use "
            "map_remote_tensor for direct loads and stores, or put/signal/wait_signal"
        )

    def get_device_window(self, signal_count=-1, counter_count=-1, barrier_count=1):
        self._no_device_window("get_device_window")

    def register_local_buffer(self, tensor):
        self._no_device_window("register_local_buffer")

    def deregister_local_buffer(self, handle):
        self._no_device_window("deregister_local_buffer")


class TorchCommBackend:
    """Base class of backends written in Python (torchcomms' protocol): ``register_backend(name,
    cls)``; ``new_comm(name, device, comm_name)`` makes ``cls()``, calls its ``init(device, name,
    options)`` and returns a TorchComm whose ops call the backend's methods of the same names
    (``all_reduce(tensor, op, async_op)``, ...), each returning None (done) or an object with
    ``wait()``. Methods it leaves out raise UnsupportedError when called."""

    def __init__(self) -> None:
        pass

    def init(self, device, name, options) -> None:
        raise NotImplementedError("a TorchCommBackend must define init(device, name, options)")


_python_backends: dict[str, type] = {}


def register_backend(name: str, cls: type) -> None:
    """Registers a Python backend class under ``name``."""
    if not name:
        raise _ValueError("register_backend: name is empty")
    _python_backends[name] = cls


def _load_entry_point_backends() -> None:
    """Backends installed by other distributions: entry points of the groups
    ``fastcomms.backends`` and ``torchcomms.backends`` (torchcomms' own group)."""
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
    matrix, _why = _C.nvlink_matrix([int(d) for d in devices])
    return matrix


_window_allocators: dict[str, object] = {}


def get_mem_allocator(backend: str):
    """The CUDA allocator for window memory of ``backend`` (torchcomms' ``get_mem_allocator``):
    one per backend per process, for ``torch.cuda.MemPool(allocator)``. On the CUDA backends
    ("nccl", "nvlink") every block it gives is a ``cudaMalloc`` of its own, which CUDA IPC can
    share with the peers whatever ``PYTORCH_CUDA_ALLOC_CONF`` says (NOTE [window memory
    allocator]); any other ``cudaMalloc`` memory registers too. Other backends have no window
    memory of their own: ``UnsupportedError``."""
    if backend not in ("nccl", "nvlink") or not _C.is_backend_built(backend):
        raise UnsupportedError(
            f"get_mem_allocator: backend {backend!r} has no window memory allocator (the CUDA "
            f"backends nccl and nvlink have one; built here: {', '.join(built_backends())})"
        )
    if backend not in _window_allocators:
        lib = _core_library()
        if lib is None:
            raise UnsupportedError("get_mem_allocator: libfastcomms.so is not beside the package")
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            lib, "fastcomms_window_alloc", "fastcomms_window_free"
        )
        _window_allocators[backend] = pluggable.allocator()
    return _window_allocators[backend]


def is_backend_built(name: str) -> bool:
    return _C.is_backend_built(name) or name in _python_backends


def built_backends() -> list[str]:
    return sorted(set(_C.built_backends()) | set(_python_backends))


def _ms(td, where: str = "") -> datetime.timedelta | None:
    """A timeout as the C++ side takes it. One rule everywhere (new_comm, set_timeout, per op,
    windows, monitored_barrier): None means the default, anything else must be positive; under a
    millisecond rounds up to one (the C++ side counts milliseconds, where 0 would read as "the
    default"). ``where`` prefixes the error (rank, communicator, op)."""
    if td is None:
        return None
    if not isinstance(td, datetime.timedelta):
        td = datetime.timedelta(seconds=float(td))
    if td <= datetime.timedelta(0):
        raise _ValueError(f"{where + ' ' if where else ''}timeout must be positive, got {td!r}")
    return max(td, datetime.timedelta(milliseconds=1))


def _op(op) -> tuple[RedOpType, float]:
    if isinstance(op, ReduceOp):
        return op.type, op.factor
    if isinstance(op, RedOpType):
        return op, 1.0
    raise _TypeError(f"op must be a ReduceOp, got {type(op).__name__}")


class ReconfigureOptions:
    """The arguments of ``TorchComm.reconfigure`` as one object (torchcomms' class)."""

    def __init__(self, uuid: int = 0, init_handles=None, timeout=None, hints=None) -> None:
        self.uuid = uuid
        self.init_handles = [] if init_handles is None else init_handles
        self.timeout = timeout
        self.hints = dict(hints or {})


class _Unconfigured:
    """What a communicator made with ``enable_reconfigure=True`` holds until its first
    ``reconfigure``: it knows its name and backend, and every op says to reconfigure first."""

    def __init__(self, backend: str, name: str, timeout, hints) -> None:
        self._backend, self._name, self._timeout, self._hints = backend, name, timeout, hints

    def name(self) -> str:
        return self._name

    def backend(self) -> str:
        return self._backend

    def timeout(self):
        return self._timeout

    def set_timeout(self, td) -> None:
        self._timeout = td

    def hints(self) -> dict:
        return dict(self._hints)

    def set_hints(self, hints) -> None:
        self._hints = dict(hints)

    def is_aborted(self) -> bool:
        return False

    def finalize(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def __getattr__(self, attr):
        raise _ValueError(
            f"[{self._name}] {attr}: this communicator was made with enable_reconfigure=True "
            "and has no ranks until reconfigure(uuid, init_handles) is called"
        )


def _unpickle_comm(backend: str, name: str, where, code_key: str = ""):
    rank, size, device = where
    raise _TypeError(
        f"a TorchComm ({backend} communicator {name!r}, rank {rank} of {size} on {device}) cannot "
        f"be unpickled: it is a handle on another process's connections; make one with "
        f"fastcomms.new_comm"
    )


class TorchComm(_OpaqueBase):
    """A communicator (torchcomms' TorchComm). Collectives take ``async_op`` positionally and
    keyword-only ``hints`` and ``timeout``; each returns a TorchWork."""

    # A communicator (and a window) is a handle on shared state: copying one, or deep-copying an
    # object that holds one (a model), gives the same object back, as torchcomms does.
    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        memo[id(self)] = self
        return self

    def __reduce__(self):
        # A communicator cannot travel to another process: pickling one gives bytes that name it
        # (inductor's graph cache pickles its graphs' inputs to make a key, NOTE [compiled
        # communicator methods]), and unpickling them raises. The key names what a compiled
        # graph may have baked in while tracing: the rank and size (a broadcast's gradient is
        # traced per rank, so ranks must not share a cached graph), the device and the code
        # that compiled calls run (a graph cached by another fastcomms is not reused).
        key = (_compiled or _load_compiled()).code_key()
        try:
            where = (self.get_rank(), self.get_size(), str(self._device))
        except Exception:  # noqa: BLE001 - not configured yet (enable_reconfigure): no ranks
            where = (-1, 0, str(self._device))
        return _unpickle_comm, (self.get_backend(), self.get_name(), where, key)

    def __init__(
        self, c: _C.Comm, device: torch.device, options: CommOptions | None = None
    ) -> None:
        self._c = c
        self._device = device
        self._options = options or CommOptions()
        self._pre_hooks: dict[int, object] = {}
        self._post_hooks: dict[int, object] = {}
        self._observers: dict[int, object] = {}
        self._hook_ids = itertools.count()
        self._reconf_uuids: set[int] = set()  # the uuids reconfigure() has used
        self._refresh_fast()
        (_compiled or _load_compiled()).ensure_token(device)  # NOTE [compiled communicator methods]

    def _refresh_fast(self) -> None:
        """NOTE [process group fast path] (python/src/fast_ops.hpp): the C++ communicator a
        process group over this one may call without Python in between, or None while Python
        must see every op (hooks or observers registered, or no C++ communicator)."""
        c = self._c
        plain = not (self._pre_hooks or self._post_hooks or self._observers)
        self._fast = c._native() if plain and isinstance(c, _C.Comm) else None

    # -- identity and options ------------------------------------------------------------------
    def get_rank(self) -> int:
        return self._c.rank()

    def get_size(self) -> int:
        return self._c.size()

    def get_name(self) -> str:
        return self._c.name()

    def get_device(self) -> torch.device:
        return self._device

    def get_backend(self) -> str:
        return self._c.backend()

    def get_backend_version(self) -> str:
        return self._c.backend_version()

    def get_options(self) -> CommOptions:
        """What this communicator was created with (timeout and hints as they are now)."""
        o = self._options
        return CommOptions(
            o.abort_process_on_timeout_or_error,
            self._c.timeout(),
            o.store,
            self._c.hints(),
            self.get_name(),
            o.enable_reconfigure,
        )

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._c.set_timeout(_ms(timeout))

    def set_hints(self, hints: dict[str, str]) -> None:
        self._c.set_hints(dict(hints))

    def finalize(self) -> None:
        self._run(
            _ht.OpName.finalize,
            _ht.FinalizePreHookArgs,
            self._c.finalize,
            _ht.FinalizePostHookArgs,
        )

    def abort(self) -> None:
        self._c.abort()

    def is_aborted(self) -> bool:
        return self._c.is_aborted()

    def is_abort_supported(self) -> bool:
        """``abort()`` unblocks every waiter on every built-in backend."""
        return True

    def get_backend_impl(self):
        """The backend object under this communicator (an escape hatch, as in torchcomms: no
        compatibility promise): the extension's communicator for built-in backends, the
        ``TorchCommBackend`` instance for Python ones."""
        from ._pybackend import Shim

        return self._c._b if isinstance(self._c, Shim) else self._c

    def unsafe_get_backend(self):
        """Deprecated name of ``get_backend_impl``."""
        import warnings

        warnings.warn(
            "unsafe_get_backend() is deprecated, use get_backend_impl() instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.get_backend_impl()

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not reach it (torch.distributed's gloo
        ``monitored_barrier``), for communicators on CPU: every rank checks in with rank 0, which
        waits at most ``timeout`` (default: the communicator's) for all of them at once and
        releases them only when all arrived. Otherwise rank 0 raises RuntimeError naming the
        missing ranks (every one with ``wait_all_ranks=True``, the lowest otherwise) and the
        others raise when their release does not come within the timeout."""
        op = "monitored_barrier"
        where = f"[rank {self.get_rank()}/{self.get_size()} {self.get_name()} {op}]"
        if self.get_device().type != "cpu":
            raise UnsupportedError(
                f"{where} is for communicators on CPU (gloo), as torch.distributed's; this one "
                f"is on {self.get_device()}"
            )
        timeout = _ms(timeout, where) or self.get_options().timeout
        rank, size = self.get_rank(), self.get_size()
        ms = int(timeout / datetime.timedelta(milliseconds=1))
        token = torch.zeros(1, dtype=torch.int32)
        if rank != 0:
            self.send(token, 0, False, timeout=timeout)
            try:
                self.recv(token, 0, False, timeout=timeout)
            except Exception as e:
                raise RuntimeError(
                    f"{where} rank 0 did not release monitoredBarrier within {ms} ms (another "
                    f"rank failed to reach it, or rank 0 did): {e}"
                ) from e
            return
        works = {
            q: self.recv(torch.zeros(1, dtype=torch.int32), q, True, timeout=timeout)
            for q in range(1, size)
        }
        failed = []
        for q, w in works.items():
            try:
                w.wait()
            except Exception:
                failed.append(q)
                if not wait_all_ranks:
                    break
        if failed:
            if wait_all_ranks:
                who = f"Ranks {', '.join(map(str, failed))} failed"
            else:
                who = f"Rank {failed[0]} failed"
            raise RuntimeError(f"{where} {who} to pass monitoredBarrier in {ms} ms")
        for q in range(1, size):
            self.send(token, q, False, timeout=timeout)

    def get_init_handle(self) -> str:
        """This process's handle for ``reconfigure`` (torchcomms' fault-tolerance API): a string
        that names this communicator object, the same on every call and across reconfigures."""
        handle = getattr(self, "_init_handle", None)
        if handle is None:
            import secrets
            import socket

            handle = f"fastcomms:{self.get_backend()}:{socket.gethostname()}:{os.getpid()}"
            handle += f":{secrets.token_hex(8)}"
            self._init_handle = handle
        return handle

    def reconfigure(self, uuid, init_handles=None, timeout=None, hints=None) -> _DoneWork:
        """Rebuilds this communicator over the ranks whose init handles are listed (torchcomms'
        fault-tolerance API; needs ``new_comm(enable_reconfigure=True)``): every participant
        passes the same ``uuid`` (never used before on this communicator) and the same handles.
        A list gives rank = position of the handle; a set, rank = position in sorted order.
        Ranks left out just stop using the communicator. The old configuration is finalized
        first (an error there, such as a dead peer, aborts it instead). Windows, splits and
        Ulysses groups made before belong to the old configuration. Also takes a
        ``ReconfigureOptions`` as its only argument. Returns a completed work."""
        if isinstance(uuid, ReconfigureOptions):
            uuid, init_handles, timeout, hints = (
                uuid.uuid,
                uuid.init_handles,
                uuid.timeout,
                uuid.hints,
            )
        backend, name = self.get_backend(), self.get_name()
        where = f"[{name} reconfigure uuid={uuid}]"
        if not self._options.enable_reconfigure:
            raise _ValueError(
                f"{where} this communicator was made without enable_reconfigure=True; "
                "reconfigure is for communicators made with it"
            )
        if isinstance(uuid, bool) or not isinstance(uuid, int):
            raise _TypeError(f"{where} uuid must be an int, got {type(uuid).__name__}")
        if uuid < 0:
            raise _ValueError(f"{where} uuid must be non-negative, got {uuid}")
        if uuid in self._reconf_uuids:
            raise _ValueError(f"{where} uuid {uuid} was used before on this communicator")
        if isinstance(init_handles, set | frozenset):
            handles = sorted(init_handles)
        elif isinstance(init_handles, list | tuple):
            handles = list(init_handles)
        else:
            raise _TypeError(
                f"{where} init_handles must be a list or a set of init handles, got "
                f"{type(init_handles).__name__}"
            )
        if not handles or not all(isinstance(h, str) for h in handles):
            raise _ValueError(f"{where} init_handles must be a non-empty list of strings")
        if len(set(handles)) != len(handles):
            raise _ValueError(f"{where} init_handles lists a handle twice: {handles}")
        mine = self.get_init_handle()
        if mine not in handles:
            raise _ValueError(
                f"{where} this rank's handle {mine!r} is not among init_handles; a rank left "
                "out of the new configuration does not call reconfigure"
            )
        prefix = f"fastcomms:{backend}:"
        foreign = [h for h in handles if not h.startswith(prefix)]
        if foreign:
            raise _ValueError(
                f"{where} init_handles must come from get_init_handle() of {backend!r} "
                f"communicators, got {foreign}"
            )
        rank, size = handles.index(mine), len(handles)
        where = f"[rank {rank}/{size} {name} reconfigure uuid={uuid}]"
        td = _ms(timeout, where) if timeout is not None else self._options.timeout
        store = self._options.store
        if store is None:
            raise _ValueError(
                f"{where} the communicator has no store (new_comm(store=...), or MASTER_ADDR "
                "and MASTER_PORT with TORCHCOMM_RANK/SIZE or RANK/WORLD_SIZE set)"
            )
        import hashlib

        import torch.distributed as dist

        space = dist.PrefixStore(f"fastcomms/reconfigure/{name}/{uuid}", store)
        # Every participant must pass the same handles in the same order: each one publishes a
        # digest of its list under its own handle and compares those of the others.
        digest = hashlib.sha256("\n".join(handles).encode()).hexdigest()
        space.set(f"list/{mine}", digest)
        others = [f"list/{h}" for h in handles if h != mine]
        try:
            if others:
                space.wait(others, td)
        except Exception as e:  # noqa: BLE001 (the store's timeout type varies)
            missing = [k[5:] for k in others if not space.check([k])]
            raise TimeoutError(
                f"{where} handles {missing} did not join within {td.total_seconds():g} s: {e}"
            ) from e
        differ = [k[5:] for k in others if space.get(k).decode() != digest]
        if differ:
            raise _ValueError(
                f"{where} the ranks with handles {differ} passed other init_handles (another "
                "set or order) for this uuid"
            )
        try:  # the configuration before (a no-op before the first)
            self._c.finalize()
        except Exception:  # noqa: BLE001 (a broken configuration: abort it instead)
            self._c.abort()
        merged = {**self._options.hints, **(hints or {})}
        dev = self._device
        c = _C.Comm(
            backend,
            rank,
            size,
            dev.type,
            -1 if dev.index is None else dev.index,
            space,
            td,
            self._options.abort_process_on_timeout_or_error,
            name,
            merged,
        )
        c.set_timeout(self._options.timeout)  # the reconfigure timeout was for the rendezvous
        self._c = c
        self._refresh_fast()
        self._reconf_uuids.add(uuid)
        return _DoneWork()

    def _traced(self, method, mutated, inputs, ints, async_op, hints, timeout, op=None):
        """NOTE [compiled communicator methods]: while Dynamo traces a method, the call as a node
        of the graph (its work); eagerly, the differentiable call's result under NOTE [eager
        autograd]; else None: the method makes the plain eager call. ``op``: a reduction, whose
        type goes first in the ints and whose factor is the float."""
        if not (_compiling() or _eager_grad()):
            return None
        floats = ()
        if op is not None:
            n, floats = _compiled.reduction(op)
            ints = (*n, *ints)
        return _compiled.call(self, method, mutated, inputs, ints, floats, hints, timeout, async_op)

    # -- hooks ---------------------------------------------------------------------------------
    # NOTE [python hooks]: hooks run here, where the call's tensors are at hand, as torchcomms
    # calls them: pre-hooks fn(OpName, op_id, <Op>PreHookArgs), post-hooks fn(op_id,
    # <Op>PostHookArgs) once the op is issued. The argument objects are built only when a hook
    # is registered.
    def _run(self, name, pre_args, issue, post=None, post_of=None):
        if not self._pre_hooks and not self._post_hooks and not self._observers:
            return issue()
        # NOTE [op ids]: one sequence for the process, as torchcomms numbers ops across its
        # communicators; finalize takes none (its hooks see 0), so a recorder sees no gap
        op_id = 0 if name is _ht.OpName.finalize else next(_op_ids)
        if self._pre_hooks:
            args = pre_args()
            for fn in list(self._pre_hooks.values()):
                fn(name, op_id, args)
        try:
            result = issue()
        except TimeoutError as e:
            self._notify("timeout", op_id, e)
            raise
        if self._observers:
            work = result if isinstance(result, TorchWork) else None
            if work is not None:
                work._observer = functools.partial(self._notify_work, op_id)
            self._notify("issued", op_id, work)
        if self._post_hooks:
            args = (
                post_of(result)
                if post_of is not None
                else (post or _ht.POST_OF.get(name, _ht.CollectivePostHookArgs))()
            )
            for fn in list(self._post_hooks.values()):
                fn(op_id, args)
        return result

    def _observe(self, fn) -> RemovableHandle:
        """Internal (fastcomms.hooks' flight recorder): ``fn(event, op_id, payload)`` with event
        "issued" (payload: the op's TorchWork, None for ops that return none) once an op is
        issued, "waited" (payload: the work) when a wait on its work returned, and "timeout"
        (payload: the exception) when the op, or a wait on its work, raised TimeoutError. Op
        ids are the hooks' op ids."""
        return self._add_hook(self._observers, fn)

    def _notify(self, event, op_id, payload) -> None:
        for fn in list(self._observers.values()):
            fn(event, op_id, payload)

    def _notify_work(self, op_id, event, payload) -> None:
        self._notify(event, op_id, payload)

    def register_pre_hook(self, fn) -> RemovableHandle:
        """``fn(name: OpName, op_id: int, args)`` before every operation (torchcomms')."""
        return self._add_hook(self._pre_hooks, fn)

    def register_post_hook(self, fn) -> RemovableHandle:
        """``fn(op_id: int, args)`` after every operation is issued (torchcomms')."""
        return self._add_hook(self._post_hooks, fn)

    def register_abort_hook(self, fn) -> RemovableHandle:
        """``fn()`` before this communicator aborts: on ``abort()`` and before a process abort
        that ``abort_process_on_timeout_or_error`` triggers."""
        return RemovableHandle(self._c.register_abort_hook(fn))

    def _add_hook(self, table, fn) -> RemovableHandle:
        if not callable(fn):
            raise _TypeError(f"a hook must be callable, got {type(fn).__name__}")
        key = next(self._hook_ids)
        table[key] = fn
        self._refresh_fast()

        def remove():
            table.pop(key, None)
            self._refresh_fast()

        return RemovableHandle(remove)

    # -- point to point ------------------------------------------------------------------------
    def send(self, tensor, dst, async_op, hints=None, timeout=None) -> TorchWork:
        if (w := self._traced("send", (), (tensor,), (dst,), async_op, hints, timeout)) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.send,
            lambda: _ht.SendPreHookArgs(tensor, dst, async_op),
            lambda: TorchWork(self._c.send(tensor, dst, async_op, _ms(timeout), hints)),
        )

    def recv(self, tensor, src, async_op, hints=None, timeout=None) -> TorchWork:
        if (w := self._traced("recv", (tensor,), (), (src,), async_op, hints, timeout)) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.recv,
            lambda: _ht.RecvPreHookArgs(tensor, src, async_op),
            lambda: TorchWork(self._c.recv(tensor, src, async_op, _ms(timeout), hints)),
        )

    def batch_op_create(self) -> BatchSendRecv:
        return BatchSendRecv(self)

    # -- collectives ---------------------------------------------------------------------------
    def broadcast(self, tensor, root, async_op, hints=None, timeout=None) -> TorchWork:
        if (
            w := self._traced("broadcast", (tensor,), (), (root,), async_op, hints, timeout)
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.broadcast,
            lambda: _ht.BroadcastPreHookArgs(tensor, root, async_op),
            lambda: TorchWork(self._c.broadcast(tensor, root, async_op, _ms(timeout), hints)),
        )

    def all_reduce(self, tensor, op, async_op, hints=None, timeout=None) -> TorchWork:
        if (
            w := self._traced("all_reduce", (tensor,), (), (), async_op, hints, timeout, op)
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        t, f = _op(op)
        return self._run(
            _ht.OpName.all_reduce,
            lambda: _ht.AllReducePreHookArgs(tensor, async_op, op),
            lambda: TorchWork(self._c.all_reduce(tensor, t, f, async_op, _ms(timeout), hints)),
        )

    def reduce(self, tensor, root, op, async_op, hints=None, timeout=None) -> TorchWork:
        if (
            w := self._traced("reduce", (tensor,), (), (root,), async_op, hints, timeout, op)
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        t, f = _op(op)
        return self._run(
            _ht.OpName.reduce,
            lambda: _ht.ReducePreHookArgs(tensor, root, async_op, op),
            lambda: TorchWork(self._c.reduce(tensor, root, t, f, async_op, _ms(timeout), hints)),
        )

    def all_gather(self, tensor_list, tensor, async_op, hints=None, timeout=None):
        return self._all_gather(False, tensor_list, tensor, async_op, hints, timeout)

    def all_gather_v(self, tensor_list, tensor, async_op, hints=None, timeout=None):
        return self._all_gather(True, tensor_list, tensor, async_op, hints, timeout)

    def _all_gather(self, v, tensor_list, tensor, async_op, hints, timeout):
        """all_gather and (``v``: sizes may differ per rank) all_gather_v."""
        method = "all_gather_v" if v else "all_gather"
        if (
            w := self._traced(method, tensor_list, (tensor,), (), async_op, hints, timeout)
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        outs = list(tensor_list)
        pre = _ht.AllGatherVPreHookArgs if v else _ht.AllGatherPreHookArgs
        return self._run(
            getattr(_ht.OpName, method),
            lambda: pre(tensor, outs, async_op),
            lambda: TorchWork(self._c.all_gather(outs, tensor, v, async_op, _ms(timeout), hints)),
        )

    def all_gather_single(self, output, input, async_op, hints=None, timeout=None):  # noqa: A002
        if (
            w := self._traced(
                "all_gather_single", (output,), (input,), (), async_op, hints, timeout
            )
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.all_gather_single,
            lambda: _ht.AllGatherSinglePreHookArgs(input, output, async_op),
            lambda: TorchWork(
                self._c.all_gather_single(output, input, async_op, _ms(timeout), hints)
            ),
        )

    def reduce_scatter(self, output, input_list, op, async_op, hints=None, timeout=None):
        return self._reduce_scatter(False, output, input_list, op, async_op, hints, timeout)

    def reduce_scatter_v(self, output, input_list, op, async_op, hints=None, timeout=None):
        return self._reduce_scatter(True, output, input_list, op, async_op, hints, timeout)

    def _reduce_scatter(self, v, output, input_list, op, async_op, hints, timeout):
        """reduce_scatter and (``v``: sizes may differ per rank) reduce_scatter_v."""
        method = "reduce_scatter_v" if v else "reduce_scatter"
        ins = list(input_list)
        if (
            w := self._traced(method, (output,), ins, (), async_op, hints, timeout, op)
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        t, f = _op(op)
        pre = _ht.ReduceScatterVPreHookArgs if v else _ht.ReduceScatterPreHookArgs
        return self._run(
            getattr(_ht.OpName, method),
            lambda: pre(ins, output, async_op, op),
            lambda: TorchWork(
                self._c.reduce_scatter(output, ins, t, f, v, async_op, _ms(timeout), hints)
            ),
        )

    def reduce_scatter_single(self, output, input, op, async_op, hints=None, timeout=None):  # noqa: A002
        if (
            w := self._traced(
                "reduce_scatter_single", (output,), (input,), (), async_op, hints, timeout, op
            )
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        t, f = _op(op)
        return self._run(
            _ht.OpName.reduce_scatter_single,
            lambda: _ht.ReduceScatterSinglePreHookArgs(input, output, async_op, op),
            lambda: TorchWork(
                self._c.reduce_scatter_single(output, input, t, f, async_op, _ms(timeout), hints)
            ),
        )

    def all_to_all_single(self, output, input, async_op, hints=None, timeout=None):  # noqa: A002
        if (
            w := self._traced(
                "all_to_all_single", (output,), (input,), (), async_op, hints, timeout
            )
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.all_to_all_single,
            lambda: _ht.AllToAllSinglePreHookArgs(input, output, async_op),
            lambda: TorchWork(
                self._c.all_to_all_single(output, input, async_op, _ms(timeout), hints)
            ),
        )

    def all_to_all_v_single(
        self,
        output,
        input,  # noqa: A002
        output_split_sizes,
        input_split_sizes,
        async_op,
        hints=None,
        timeout=None,
    ):
        n = [*(output_split_sizes or ()), *(input_split_sizes or ())]
        if (
            w := self._traced(
                "all_to_all_v_single", (output,), (input,), n, async_op, hints, timeout
            )
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        outs = list(output_split_sizes or [])
        ins = list(input_split_sizes or [])
        return self._run(
            _ht.OpName.all_to_all_v_single,
            lambda: _ht.AllToAllVSinglePreHookArgs(input, output, ins, outs, async_op),
            lambda: TorchWork(
                self._c.all_to_all_v_single(output, input, outs, ins, async_op, _ms(timeout), hints)
            ),
        )

    def all_to_all(self, output_tensor_list, input_tensor_list, async_op, hints=None, timeout=None):
        if (
            w := self._traced(
                "all_to_all", output_tensor_list, input_tensor_list, (), async_op, hints, timeout
            )
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        outs, ins = list(output_tensor_list), list(input_tensor_list)
        return self._run(
            _ht.OpName.all_to_all,
            lambda: _ht.AllToAllPreHookArgs(ins, outs, async_op),
            lambda: TorchWork(self._c.all_to_all(outs, ins, async_op, _ms(timeout), hints)),
        )

    def barrier(self, async_op, hints=None, timeout=None) -> TorchWork:
        if (w := self._traced("barrier", (), (), (), async_op, hints, timeout)) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.barrier,
            lambda: _ht.BarrierPreHookArgs(async_op),
            lambda: TorchWork(self._c.barrier(async_op, _ms(timeout), hints)),
        )

    def scatter(self, output_tensor, input_tensor_list, root, async_op, hints=None, timeout=None):
        ins = list(input_tensor_list or [])
        if (
            w := self._traced("scatter", (output_tensor,), ins, (root,), async_op, hints, timeout)
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.scatter,
            lambda: _ht.ScatterPreHookArgs(output_tensor, ins, root, async_op),
            lambda: TorchWork(
                self._c.scatter(output_tensor, ins, root, async_op, _ms(timeout), hints)
            ),
        )

    def gather(self, output_tensor_list, input_tensor, root, async_op, hints=None, timeout=None):
        outs = list(output_tensor_list or [])
        if (
            w := self._traced("gather", outs, (input_tensor,), (root,), async_op, hints, timeout)
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.gather,
            lambda: _ht.GatherPreHookArgs(input_tensor, outs, root, async_op),
            lambda: TorchWork(
                self._c.gather(outs, input_tensor, root, async_op, _ms(timeout), hints)
            ),
        )

    def gather_single(self, output, input, root, async_op, hints=None, timeout=None):  # noqa: A002
        if (
            w := self._traced(
                "gather_single", (output,), (input,), (root,), async_op, hints, timeout
            )
        ) is not None:
            return w  # NOTE [compiled communicator methods]
        return self._run(
            _ht.OpName.gather_single,
            lambda: _ht.GatherSinglePreHookArgs(input, output, root, async_op),
            lambda: TorchWork(
                self._c.gather_single(output, input, root, async_op, _ms(timeout), hints)
            ),
        )

    # -- structure -----------------------------------------------------------------------------
    def split(self, ranks, name, hints=None, timeout=None) -> TorchComm | None:
        """Collective over this communicator (torchcomms' colour split): every rank passes the
        ranks of the group it joins (lists differ across groups and must be disjoint); ``[]``
        joins none and returns None; a non-empty list without the caller raises."""
        ranks = [int(r) for r in ranks]
        if ranks and self.get_rank() not in ranks:
            raise _ValueError(
                f"[rank {self.get_rank()}/{self.get_size()} {self.get_name()} split] ranks "
                f"{ranks} does not contain this rank; pass [] to join no group"
            )

        def issue():
            sub = self._c.split(ranks, name, _ms(timeout), hints)
            if sub is None:
                return None
            o = self._options
            return TorchComm(
                sub,
                self._device,
                CommOptions(
                    o.abort_process_on_timeout_or_error, sub.timeout(), o.store, sub.hints(), name
                ),
            )

        return self._run(
            _ht.OpName.split,
            lambda: _ht.SplitPreHookArgs(list(ranks), name),
            issue,
            post_of=_ht.SplitPostHookArgs,
        )

    def tensor_register(self, tensor: torch.Tensor) -> None:
        """Registers ``tensor``'s memory with the backend, so later ops on it can move without
        staging (torchcomms' ``TorchComm.tensor_register``; on nccl and nvlink NCCL's
        ``ncclCommRegister``, NOTE [nccl memory registration]). Local, not collective; call
        ``tensor_deregister(tensor)`` before freeing it (finalize drops what is left). The gloo
        backend has none: ``UnsupportedError``, as torchcomms' gloo raises."""
        self._c.tensor_register(tensor)

    def tensor_deregister(self, tensor: torch.Tensor) -> None:
        """Drops the registration ``tensor_register(tensor)`` made."""
        self._c.tensor_deregister(tensor)

    def get_mem_allocator(self):
        """The allocator for this backend's window memory (``get_mem_allocator(backend)``)."""
        return get_mem_allocator(self.get_backend())

    @property
    def mem_allocator(self):
        """Alias of ``get_mem_allocator()`` (torchcomms keeps it for older code)."""
        return self.get_mem_allocator()

    def new_window(self, tensor=None) -> TorchCommWindow:
        return self._run(
            _ht.OpName.new_window,
            _ht.NewWindowPreHookArgs,
            lambda: TorchCommWindow(self, tensor),
            _ht.NewWindowPostHookArgs,
        )

    def ulysses_transport(self, transport="auto", *, require_nvlink=False):
        """Collective: the Ulysses transport this communicator gives a
        ``fastcomms.ulysses.UlyssesGroup``, as ``(transport, kind, reason)``: the backend's own
        engine where it lends one (nvlink), else NVLink peer-to-peer or the collective path as
        ``transport`` ("auto", "nvlink", "collective") and the machine allow."""
        return self._c.select_transport(str(transport), bool(require_nvlink))


# torch.compile passes communicators through as opaque objects and evaluates these two members on
# the real object while tracing (NOTE [ulysses custom op], NOTE [functional over a communicator]);
# each asks the module that owns the mapping, imported on first use.
def _ulysses_group(self):
    from .ulysses import _ulysses_group_of

    return _ulysses_group_of(self)


def _process_group_name(self):
    from .functional import _process_group_name_of

    return _process_group_name_of(self)


TorchComm._ulysses_group = property(_ulysses_group)
TorchComm._process_group_name = property(_process_group_name)

# The communicator's operations (its methods of those names; the "fake" backend's ops too)
_COLLECTIVE_METHODS = (
    "send",
    "recv",
    "broadcast",
    "all_reduce",
    "reduce",
    "all_gather",
    "all_gather_v",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_v",
    "reduce_scatter_single",
    "all_to_all_single",
    "all_to_all_v_single",
    "all_to_all",
    "barrier",
    "scatter",
    "gather",
    "gather_single",
)
# NOTE [compiled communicator methods]: the methods whose bodies Dynamo traces
_COMPILED_METHODS = (*_COLLECTIVE_METHODS, "batch_op_create")


def _register_opaque() -> None:
    """TorchComm as an opaque reference type of torch.compile. Tried at import and again by
    ``_load_compiled``: where torch imports this package while it initializes itself (a
    ``torchcomms`` alias), torch's opaque-type registry is not importable yet, and the module
    that torch imports later is a fresh one."""
    try:
        from torch._library.opaque_object import MemberType, is_opaque_type, register_opaque_type
    except ImportError:  # an older torch, or torch still initializing: not traceable (yet)
        return
    if is_opaque_type(TorchComm):
        return
    register_opaque_type(
        TorchComm,
        typ="reference",
        members={
            "_ulysses_group": MemberType.USE_REAL,
            "_process_group_name": MemberType.USE_REAL,
            # NOTE [compiled communicator methods]: constants while tracing, and the methods
            # whose bodies Dynamo traces
            **dict.fromkeys(
                ("get_rank", "get_size", "get_name", "get_backend", "get_device"),
                MemberType.USE_REAL,
            ),
            **dict.fromkeys(
                (*_COMPILED_METHODS, "_traced", "_all_gather", "_reduce_scatter"),
                MemberType.INLINED,
            ),
        },
    )


_register_opaque()


def _new_reconfigurable(backend, device, name, opts, hints, store) -> TorchComm:
    """new_comm(enable_reconfigure=True): no ranks and no rendezvous until reconfigure()."""
    if not _C.is_backend_built(backend):
        raise UnsupportedError(
            f"new_comm: enable_reconfigure=True needs a built-in backend "
            f"({', '.join(b for b in ('gloo', 'nccl', 'nvlink') if _C.is_backend_built(b))}), "
            f"got {backend!r}"
        )
    name = name or f"{backend}_{next(_names)}"
    if store is None:  # as new_comm does without a store, where a launcher says enough
        try:
            launch = _bootstrap.detect()
            if launch is not None:
                store = _bootstrap.default_store(launch, opts.timeout)
        except _bootstrap.LaunchError as e:
            raise _ValueError(str(e)) from None
    options = CommOptions(
        opts.abort_process_on_timeout_or_error, opts.timeout, store, hints, name, True
    )
    return TorchComm(_Unconfigured(backend, name, opts.timeout, hints), device, options)


# (rank, size) that new_comm takes instead of the environment's (NOTE [launchers])
_rank_size_override = _bootstrap.rank_size_override


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device without an index becomes cuda:(rank % device count), as torchcomms' CUDA
    backends resolve it (every rank of a node on its own GPU without a set_device call); where
    the rank is not known yet, the current device."""
    if device.type != "cuda" or device.index is not None:
        return device
    try:
        launch = _bootstrap.detect()
    except _bootstrap.LaunchError:
        launch = None
    if launch is None:
        return torch.device("cuda", torch.cuda.current_device())
    rank = launch.rank if launch.local_rank is None else launch.local_rank
    return torch.device("cuda", rank % max(1, torch.cuda.device_count()))


def new_comm(
    backend: str,
    device,
    name: str | None = None,
    abort_process_on_timeout_or_error=None,
    timeout=None,
    is_high_priority_stream=None,
    store=None,
    enable_reconfigure=False,
    hints=None,
) -> TorchComm:
    """Creates a communicator (collective over the ranks that share the store). The positional
    order is torchcomms' Python binding's: ``new_comm(backend, device, name, ...)``."""
    opts = CommOptions(abort_process_on_timeout_or_error, timeout, store, hints, name or "")
    timeout, abort = opts.timeout, opts.abort_process_on_timeout_or_error
    hints = dict(hints or {})
    if is_high_priority_stream:
        hints.setdefault("nccl.high_priority", "1")
    device = _indexed(torch.device(device))
    if not _C.is_backend_built(backend) and backend not in _python_backends:
        _load_entry_point_backends()
    if enable_reconfigure:
        return _new_reconfigurable(backend, device, name, opts, hints, store)
    if backend in _python_backends:
        from ._pybackend import Shim

        opts.hints = hints
        opts.name = name or f"{backend}_{next(_names)}"
        impl = _python_backends[backend]()
        impl.init(device, opts.name, opts)
        return TorchComm(Shim(impl, backend, opts.name, opts, ReduceOp), device, opts)
    given_store = store
    try:
        launch = _bootstrap.required()
        if store is None:
            store = _bootstrap.default_store(launch, timeout)
    except _bootstrap.LaunchError as e:
        raise _ValueError(str(e)) from None
    rank, size = launch.rank, launch.size
    name = name or f"{backend}_{next(_names)}"
    try:
        impl = _C.Comm(
            backend,
            rank,
            size,
            device.type,
            -1 if device.index is None else device.index,
            store,
            timeout,
            abort,
            name,
            hints,
        )
    except Exception as e:
        e.add_note(
            f"fastcomms: this process is {launch.describe()}"
            if given_store is None
            else f"fastcomms: rank {rank} and size {size} from {launch.source} ({launch.launcher});"
            " the store was given"
        )
        raise
    return TorchComm(impl, device, CommOptions(abort, timeout, store, hints, name))


# torchcomms' "fake" backend: one rank, every op done at once (fastcomms/_fake.py)
from ._fake import FakeBackend as _FakeBackend  # noqa: E402

register_backend("fake", _FakeBackend)


class Timeout(datetime.timedelta):
    """torchcomms' Timeout: a ``datetime.timedelta`` (fastcomms takes any timedelta where a
    timeout goes)."""


# as after `import torchcomms`: its hooks and objcol modules are attributes of the package
from . import (  # noqa: E402,F401
    _waits,  # noqa: E402
    hooks,
    objcol,
)

_waits.register()  # NOTE [torchcomms wait ops] (again when the first communicator is made)


def _register_nvlink_name() -> bool:
    """NOTE [nvlink as a torch.distributed backend] (fastcomms/device_mesh.py): registers "nvlink"
    with torch.distributed where this build has it; False while torch's registry does not exist
    yet (torch.distributed is still being imported)."""
    import sys

    registry = getattr(sys.modules.get("torch.distributed.distributed_c10d"), "Backend", None)
    if registry is None or not hasattr(registry, "register_backend"):
        return False
    if _C.is_backend_built("nvlink") and "nvlink" not in registry.backend_list:
        registry.register_backend("nvlink", _nvlink_for_torch, extended_api=True, devices=["cuda"])
    return True


def _nvlink_for_torch(opts, backend_options=None):
    """torch's extended creator for the "nvlink" backend name."""
    from .device_mesh import _create_for_torch

    return _create_for_torch("nvlink", opts)


def _register_with_torch() -> None:
    """torch may import this package while it imports torch.distributed (torch's torchcomms
    switch finding a `torchcomms` alias): then the name is registered at the first import after
    torch's registry exists, by a finder that loads nothing and is inert afterwards."""
    import importlib.abc
    import sys

    if _register_nvlink_name() or "torch.distributed.distributed_c10d" not in sys.modules:
        return

    class _WhenTorchDistributedIsWhole(importlib.abc.MetaPathFinder):
        done = False

        def find_spec(self, name, path=None, target=None):
            if not self.done:
                self.done = _register_nvlink_name()
            return None  # loads nothing; stays in place (removing it mid-import skips a finder)

    sys.meta_path.insert(0, _WhenTorchDistributedIsWhole())


_register_with_torch()
