# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""``TorchComm`` (torchcomms' communicator) and ``new_comm``. The collective and point-to-point
methods are written from the table in ``_ops`` (NOTE [operation table])."""

from __future__ import annotations

import datetime
import functools
import importlib
import itertools
import os
import warnings

import torch

from . import (
    _C,
    _allgather_p,
    _bootstrap,
    _device_a2av,
    _ops,
    _reconfigure,
    _registry,
    _torch_compat,
    _waits,
)
from . import _hook_types as _ht
from ._C import UnsupportedError
from ._hook_types import OpName as _OpName
from ._hook_types import RemovableHandle
from ._ops import _hooked
from ._options import CommOptions, ReduceOp, _ms, _TypeError, _ValueError
from ._p2p import BatchSendRecv
from ._registry import get_mem_allocator, is_backend_built
from ._torch_compat import OpaqueBase as _TorchOpaqueBase  # NOTE [ulysses custom op]
from ._window import TorchCommWindow
from ._work import _DoneWork, _same


class _OpaqueBase(_TorchOpaqueBase):
    """The base of the classes whose instances are op arguments (TorchComm, UlyssesGroup).

    NOTE [opaque arguments and __torch_function__]: before it runs an op called from Python,
    torch looks up ``__torch_function__`` on every argument that is not a tensor; on an object
    without one, the failed lookup builds and drops an AttributeError each time (9 us of a 46 us
    ``comm_call_`` on the 2-core CPU machine, docs/benchmarks.md). Torch's own marker for "no
    override" answers the lookup at once; torch and Dynamo dispatch as for an object without it.
    (``torch.overrides.is_tensor_like``, which asks only whether the attribute exists, answers
    True for these objects.)"""

    __torch_function__ = torch._C._disabled_torch_function_impl


# NOTE [communicator attachments]: what a module above this one keeps per communicator (the
# UlyssesGroup fastcomms._ulysses makes for it, the process group fastcomms.functional registers
# for it) is held by the communicator, in ``TorchComm._attached``, made on first use by the
# factory the owning module put in ATTACHMENTS when it was imported (its kind -> fn(comm)). So no
# table keyed by a communicator outlives it. finalize() lets go of them, destroying those with a
# destroy() (collective, as finalize is); abort() lets go of them without a call (a peer may be
# gone). reconfigure() lets go of those with a _release() (a UlyssesGroup: its table entries,
# async lane and lend ring belong to the configuration before), calling it (local: a peer may be
# left out of the new configuration); the next use makes them anew over the new one.
# torch.compile reads `_ulysses_group` and `_process_group_name` of every communicator it traces,
# whether or not the program imported their modules: a kind not registered yet imports its module
# (PROVIDERS; NOTE [no import circles]: a deferred import, said so on its line).
ATTACHMENTS: dict[str, object] = {}
PROVIDERS = {"ulysses": "_ulysses", "process_group_name": "functional"}

_names = itertools.count()
_keys = itertools.count()  # a communicator's key for its hooks' calls (NOTE [one hook registry])
_compiled = None  # the module, once a communicator exists


def _compiling() -> bool:  # NOTE [compiled communicator methods]; rebound by _load_compiled
    return torch.compiler.is_compiling()


# os.environ's own table and the variable's key in it, encoded once: the unset case (the common
# one) is one lookup, where os.environ.get costs about 1 µs, half a method's Python cost.
_ENVIRON = getattr(os.environ, "_data", None)
_PATCH_KEY = os.environ.encodekey("TORCHCOMMS_PATCH_FOR_COMPILE")


def _eager_grad() -> bool:
    """NOTE [eager autograd]: torchcomms' ``TORCHCOMMS_PATCH_FOR_COMPILE=1`` (or ``true``, any
    case, as torchcomms reads it) makes its eager methods differentiable where a tensor of the
    call needs a gradient; read at each call."""
    if _ENVIRON is not None and _PATCH_KEY not in _ENVIRON:
        return False
    return os.environ.get("TORCHCOMMS_PATCH_FOR_COMPILE", "").lower() in ("1", "true")


def _load_compiled():
    """NOTE [compiled communicator methods]: imports ``_compiled`` with the first communicator:
    torch may import this package (a ``torchcomms`` alias) before torch.library exists."""
    global _compiled, _compiling
    _register_opaque()  # (its op takes a TorchComm)
    _waits.register()  # NOTE [torchcomms wait ops]
    # NOTE [torchcomms method ops]; both modules import this one: imported here, not above it, as
    # torch may import this package before torch.library exists (a torchcomms alias)
    ops = importlib.import_module(f"{__package__}._torchcomms_ops")  # deferred: torch's init
    if ops.register():
        ops.finish()
    _compiled = importlib.import_module(f"{__package__}._compiled")  # deferred: torch's init
    _compiling = torch.compiler.is_compiling
    return _compiled


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

    __copy__ = __deepcopy__ = _same  # a handle on shared state

    def __reduce__(self):
        # Bytes that name the communicator, for inductor's graph-cache key (NOTE [compiled
        # communicator methods]); unpickling them raises. The key holds what a graph may bake in:
        # rank and size (a broadcast's gradient is traced per rank), device, and code digest.
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
        self._key = next(_keys)
        # NOTE [one hook registry]: the hooks this communicator registered with its C++ one,
        # key -> [kind, callback, remover], kept to move them to the one reconfigure makes
        self._hooks: dict[int, list] = {}
        self._cpp_hooks: dict[int, object] = {}  # key -> attach(c), C++ hooks (_attach_cpp)
        self._hooked = False  # a pre- or post-hook is registered
        self._reconf_uuids: set[int] = set()  # the uuids reconfigure() has used
        self._attached: dict[str, object] = {}  # NOTE [communicator attachments]
        self._refresh_fast()
        (_compiled or _load_compiled()).ensure_token(device)  # NOTE [compiled communicator methods]

    def _refresh_fast(self) -> None:
        """NOTE [process group fast path]: the C++ communicator a process group may call directly
        (its Python pre- and post-hooks see the call there: NOTE [hooks on the fast path]), or
        None for a Python backend (NOTE [python backend trampoline])."""
        c = self._c if isinstance(self._c, _C.Comm) and self._c.python_backend() is None else None
        self._hooked = any(kind != "abort" for kind, _, _ in self._hooks.values())
        self._fast = c  # (the compiled calls' C++ kernel's too: NOTE [compiled calls in C++])

    def _rebind(self, c) -> None:
        """Reconfigure: ``c`` replaces the C++ communicator; the hooks move to it, and so do the
        C++ hooks attached through _attach_cpp (the flight recorder, the NaN check, clog)."""
        self._c = c
        for h in self._hooks.values():
            h[2] = self._register(h[0], h[1])
        if isinstance(c, _C.Comm):
            for attach in list(self._cpp_hooks.values()):
                attach(c)
        self._refresh_fast()

    def _attach_cpp(self, attach) -> RemovableHandle:
        """A hook written in C++: ``attach(c)`` registers it on the C++ communicator ``c``, now
        and on each one reconfigure makes; the handle stops the re-attaching (the hook's own
        detach removes what it registered)."""
        key = next(_keys)
        self._cpp_hooks[key] = attach
        if isinstance(self._c, _C.Comm):
            attach(self._c)
        return RemovableHandle(lambda: self._cpp_hooks.pop(key, None))

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
        o, c = self._options, self._c
        abort, reconfigurable = o.abort_process_on_timeout_or_error, o.enable_reconfigure
        return CommOptions(abort, c.timeout(), o.store, c.hints(), c.name(), reconfigurable)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._c.set_timeout(_ms(timeout))
        impl = self._c.python_backend() if isinstance(self._c, _C.Comm) else None
        if impl is not None and hasattr(impl, "set_timeout"):  # torchcomms' protocol passes it on
            impl.set_timeout(timeout)

    def set_hints(self, hints: dict[str, str]) -> None:
        self._c.set_hints(dict(hints))

    def finalize(self) -> None:
        self._detach(destroy=True)  # NOTE [communicator attachments]: before the comm goes
        _hooked(self, _OpName.finalize, _ht.FinalizePreHookArgs, self._c.finalize)

    def abort(self) -> None:
        self._detach(destroy=False)
        self._c.abort()

    def _attachment(self, kind: str):
        """NOTE [communicator attachments]: this communicator's ``kind``, made on first use."""
        a = self._attached.get(kind)
        if a is None:
            if kind not in ATTACHMENTS and kind in PROVIDERS:  # registers its factory
                importlib.import_module(f"{__package__}.{PROVIDERS[kind]}")  # deferred: compile
            make = ATTACHMENTS.get(kind)
            if make is None:
                raise RuntimeError(
                    f"fastcomms: no module registered a communicator's {kind!r} (import the "
                    f"module that provides it first)"
                )
            a = self._attached[kind] = make(self)
        return a

    def _detach(self, destroy: bool, release: bool = False) -> None:
        """finalize (``destroy``), abort, or reconfigure (``release``): NOTE [communicator
        attachments]."""
        if release:
            gone = {k: a for k, a in self._attached.items() if callable(getattr(a, "_release", 0))}
            self._attached = {k: a for k, a in self._attached.items() if k not in gone}
            for a in gone.values():
                a._release()
            return
        attached, self._attached = self._attached, {}
        for a in attached.values() if destroy else ():
            if callable(getattr(a, "destroy", None)):
                a.destroy()

    def is_aborted(self) -> bool:
        return self._c.is_aborted()

    def is_abort_supported(self) -> bool:
        """``abort()`` unblocks every waiter on every built-in backend."""
        return True

    def get_backend_impl(self):
        """The backend object under this communicator (torchcomms' escape hatch): the extension's
        communicator, or the ``TorchCommBackend`` instance of a Python backend."""
        impl = self._c.python_backend() if isinstance(self._c, _C.Comm) else None
        return self._c if impl is None else impl

    def get_nccl_comm_ptr(self) -> int:
        """The NCCL communicator (``ncclComm_t``) as an int, for torch's symmetric memory and other
        NCCL users: ``get_backend_impl().get_nccl_comm_ptr()``, where torchcomms has it (its nccl
        backend's object; fastcomms' nvlink gives its inner nccl communicator's). 0 once aborted
        or finalized; ``AttributeError`` on the other backends, nccl-lazy included, as there."""
        return self.get_backend_impl().get_nccl_comm_ptr()

    def unsafe_get_backend(self):
        """Deprecated name of ``get_backend_impl``."""
        warnings.warn(
            "unsafe_get_backend() is deprecated, use get_backend_impl() instead",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.get_backend_impl()

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False) -> None:
        """torch.distributed's gloo ``monitored_barrier`` (CPU): rank 0 waits at most ``timeout``
        for every rank's check-in, then releases them all, or raises RuntimeError naming the
        missing ranks (all with ``wait_all_ranks=True``); the others raise without a release."""
        rank, size = self.get_rank(), self.get_size()
        where = f"[rank {rank}/{size} {self.get_name()} monitored_barrier]"
        if self.get_device().type != "cpu":
            raise UnsupportedError(
                f"{where} is for communicators on CPU (gloo), as torch.distributed's; this one "
                f"is on {self.get_device()}"
            )
        timeout = _ms(timeout, where) or self.get_options().timeout
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
            q: self.recv(torch.zeros_like(token), q, True, timeout=timeout) for q in range(1, size)
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
            who = f"Ranks {', '.join(map(str, failed))}" if wait_all_ranks else f"Rank {failed[0]}"
            raise RuntimeError(f"{where} {who} failed to pass monitoredBarrier in {ms} ms")
        for q in range(1, size):
            self.send(token, q, False, timeout=timeout)

    def get_init_handle(self) -> str:
        """This communicator's handle for ``reconfigure`` (stable across calls and reconfigures)."""
        return _reconfigure.init_handle(self)

    def reconfigure(self, uuid, init_handles=None, timeout=None, hints=None) -> _DoneWork:
        """Rebuilds this communicator over the ranks whose init handles are listed (torchcomms'
        fault-tolerance API, docs/torchcomms.md; needs ``new_comm(enable_reconfigure=True)``):
        every participant passes the same new ``uuid`` and handles (a list: rank = position; a
        set: sorted). Also takes a ``ReconfigureOptions``. Returns a completed work."""
        return _reconfigure.reconfigure(self, uuid, init_handles, timeout, hints)

    # -- hooks (NOTE [one hook registry]) -------------------------------------------------------
    def register_pre_hook(self, fn) -> RemovableHandle:
        """``fn(name: OpName, op_id: int, args)`` before every operation (torchcomms')."""
        return self._add_hook("pre", fn)

    def register_post_hook(self, fn) -> RemovableHandle:
        """``fn(op_id: int, args)`` after every operation is issued (torchcomms')."""
        return self._add_hook("post", fn)

    def register_abort_hook(self, fn) -> RemovableHandle:
        """``fn()`` before this communicator aborts: on ``abort()`` and before a process abort
        that ``abort_process_on_timeout_or_error`` triggers."""
        return self._add_hook("abort", fn)

    def _register(self, kind: str, cb):
        """``cb`` in the C++ communicator's registry; its remover. A C++
        communicator's pre/post callbacks get the fast path's arguments too (NOTE [hooks on the
        fast path])."""
        register = getattr(self._c, f"register_{kind}_hook")
        return (
            register(cb, True) if kind != "abort" and isinstance(self._c, _C.Comm) else register(cb)
        )

    def _add_hook(self, kind: str, fn) -> RemovableHandle:
        if not callable(fn):
            raise _TypeError(f"a hook must be callable, got {type(fn).__name__}")
        keys = []
        for k, cb in _ops.callbacks(self._key, kind, fn):
            keys.append(next(_keys))
            self._hooks[keys[-1]] = [k, cb, self._register(k, cb)]
        self._refresh_fast()

        def remove():
            for key in keys:
                if (h := self._hooks.pop(key, None)) is not None:
                    h[2]()
            self._refresh_fast()

        return RemovableHandle(remove)

    # -- operations: written from _ops.OPS below the class, declared for type checkers ---------
    send: _ops.Method
    recv: _ops.Method
    broadcast: _ops.Method
    all_reduce: _ops.Method
    reduce: _ops.Method
    all_gather: _ops.Method
    all_gather_v: _ops.Method
    all_gather_single: _ops.Method
    reduce_scatter: _ops.Method
    reduce_scatter_v: _ops.Method
    reduce_scatter_single: _ops.Method
    all_to_all_single: _ops.Method
    all_to_all_v_single: _ops.Method
    all_to_all: _ops.Method
    barrier: _ops.Method
    scatter: _ops.Method
    gather: _ops.Method
    gather_single: _ops.Method
    _batch_op_issue: _ops.Method

    def batch_op_create(self) -> BatchSendRecv:
        return BatchSendRecv(self)

    def device_alltoallv_single(
        self,
        output,
        input,
        output_split_sizes,
        input_split_sizes,
        async_op,
        hints=None,
        timeout=None,
    ):
        """torchcomms' all-to-all-v with split sizes as int64 CUDA tensors of ``get_size()``
        counts (rows of dim 0), read on the GPU only: no host sync, capturable in a CUDA graph
        (replays read the counts in the same tensors). Offsets are prefix sums of the counts;
        the sums may be below the tensors' rows (the rest is left as it was). A count that does
        not fit (the output, the input, the receive buffers sized at the first call or by
        ``device_alltoallv_prepare``) or does not match the sender's is flagged on the device and
        raised by the next call on this communicator; nothing is written past any buffer. On the
        nvlink and nccl backends with every rank on one host; elsewhere UnsupportedError."""
        return _device_a2av.issue(
            self._c, output, input, output_split_sizes, input_split_sizes, async_op, timeout
        )

    def device_alltoallv_prepare(self, max_output_bytes: int) -> None:
        """Collective, outside graph capture: sizes the buffers of ``device_alltoallv_single``
        for outputs of up to ``max_output_bytes`` (the largest any rank passes). Optional: the
        first call sizes them from its outputs; call this first when that call is captured."""
        _device_a2av.prepare(self._c, max_output_bytes)

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
            if (sub := self._c.split(ranks, name, _ms(timeout), hints)) is None:
                return None
            abort, store = self._options.abort_process_on_timeout_or_error, self._options.store
            return TorchComm(
                sub, self._device, CommOptions(abort, sub.timeout(), store, sub.hints(), name)
            )

        return _hooked(self, _OpName.split, lambda: _ht.SplitPreHookArgs(list(ranks), name), issue)

    def tensor_register(self, tensor: torch.Tensor) -> None:
        """Registers ``tensor``'s memory with the backend (NCCL's ``ncclCommRegister``, NOTE [nccl
        memory registration]); local. gloo raises ``UnsupportedError``, as torchcomms' does."""
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

    def get_device_transport(self) -> int:
        """Collective on the first call: a device pointer (an int, as torchcomms returns it) to
        this communicator's device transport: a ``fastcomms::device::DeviceWindow`` of its own
        over 1 MiB per rank, for the block-cooperative ``transport_send`` / ``transport_recv``
        (a staging slot per sender), ``transport_signal`` / ``transport_wait_signal``,
        ``transport_barrier`` (pairwise) and the properties (``fastcomms/device/transport.hpp``,
        ``fastcomms.triton``; NOTE [device transport ids]). Cached for the communicator's life.
        Needs CUDA IPC between every rank (nvlink, or nccl on one host); gloo raises
        UnsupportedError."""
        t = getattr(self, "_device_transport", None)
        if t is not None:
            return t[2]
        if self.get_device().type != "cuda":
            raise UnsupportedError(
                f"[rank {self.get_rank()}/{self.get_size()} {self.get_name()} "
                f"get_device_transport] backend '{self.get_backend()}' runs on "
                f"{self.get_device()}: the device API maps peers' GPU memory into kernels through "
                "CUDA IPC, so it needs a CUDA backend (nvlink, or nccl with every rank on one host)"
            )
        from ._window import transport_counts

        buf = torch.zeros(1 << 20, dtype=torch.uint8, device=self.get_device())
        win = self.new_window(buf)
        ptr = win.get_device_window(*transport_counts(self.get_size()))
        self._device_transport = (win, buf, ptr)
        return ptr

    def new_window(self, tensor=None) -> TorchCommWindow:
        issue = functools.partial(TorchCommWindow, self, tensor)
        return _hooked(self, _OpName.new_window, _ht.NewWindowPreHookArgs, issue)

    # NOTE [persistent all-gather]
    all_gather_p_init = _allgather_p.all_gather_p_init
    all_gather_p_exec = _allgather_p.all_gather_p_exec
    all_gather_p_free = _allgather_p.all_gather_p_free

    def ulysses_transport(self, transport="auto", *, require_nvlink=False):
        """Collective: the ``(transport, kind, reason)`` this communicator gives a UlyssesGroup
        (the backend's own engine, NVLink peer-to-peer or the collective path)."""
        return self._c.select_transport(str(transport), bool(require_nvlink))

    # torch.compile passes communicators through as opaque objects and evaluates these two
    # members on the real object while tracing (NOTE [ulysses custom op], NOTE [functional over a
    # communicator]); each is an attachment (NOTE [communicator attachments]) its module makes.
    @property
    def _ulysses_group(self):
        return self._attachment("ulysses")

    @property
    def _process_group_name(self):
        return self._attachment("process_group_name")


_METHODS = _ops.methods(globals())  # NOTE [operation table]
for _name, _fn in _METHODS.items():
    setattr(TorchComm, _name, _fn)


def _register_opaque() -> None:
    """TorchComm as an opaque reference type of torch.compile; again in ``_load_compiled`` where
    torch imported this package while initializing itself (a ``torchcomms`` alias)."""
    MemberType = _torch_compat.member_type()
    if MemberType is None:  # an older torch, or torch still initializing: not traceable (yet)
        return
    _torch_compat.register_symbolic_class(
        TorchComm,
        {
            "_ulysses_group": MemberType.USE_REAL,
            "_process_group_name": MemberType.USE_REAL,
            # NOTE [compiled communicator methods]: constants while tracing, and the methods
            # whose bodies Dynamo traces
            **dict.fromkeys(
                ("get_rank", "get_size", "get_name", "get_backend", "get_device"),
                MemberType.USE_REAL,
            ),
            **dict.fromkeys((*_METHODS, "batch_op_create"), MemberType.INLINED),
        },
    )


_register_opaque()


def _indexed(device: torch.device) -> torch.device:
    """A CUDA device without an index becomes cuda:(local rank % device count), as torchcomms'
    CUDA backends resolve it; where the rank is not known yet, the current device."""
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
    hints = dict(hints or {})
    if is_high_priority_stream:
        hints.setdefault("nccl.high_priority", "1")
    device = _indexed(torch.device(device))
    if not is_backend_built(backend):
        _registry._load_entry_point_backends()
    if enable_reconfigure:
        name = name or f"{backend}_{next(_names)}"
        unconfigured, options = _reconfigure.new_reconfigurable(backend, name, opts, hints, store)
        return TorchComm(unconfigured, device, options)
    if backend in _registry._python_backends:  # NOTE [python backend trampoline]
        opts.hints, opts.name = hints, name or f"{backend}_{next(_names)}"
        impl = _registry._python_backends[backend]()
        impl.init(device, opts.name, opts)
        try:
            c = _C.Comm.over_python_backend(
                impl, backend, opts, device.type, device.index or 0, ReduceOp
            )
        except BaseException:  # set up, and no communicator over it: let it go
            stop = getattr(impl, "abort", None) or getattr(impl, "finalize", None)
            try:
                if stop is not None:
                    stop()
            except Exception:  # noqa: BLE001, S110 - the first error is the one to report
                pass
            raise
        return TorchComm(c, device, opts)
    try:
        launch = _bootstrap.required()
        given = store
        opts.store = store if store is not None else _bootstrap.default_store(launch, opts.timeout)
    except _bootstrap.LaunchError as e:
        raise _ValueError(str(e)) from None
    rank, size = launch.rank, launch.size
    opts.hints, opts.name = hints, name or f"{backend}_{next(_names)}"
    try:
        impl = _registry.native_comm(backend, rank, size, device, opts.store, opts)
    except Exception as e:
        e.add_note(
            f"fastcomms: this process is {launch.describe()}"
            if given is None
            else f"fastcomms: rank {rank} and size {size} from {launch.source} ({launch.launcher});"
            " the store was given"
        )
        raise
    return TorchComm(impl, device, opts)
