# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Reconfigure (torchcomms' fault-tolerance API): ``new_comm(enable_reconfigure=True)`` makes a
communicator with no ranks, ``TorchComm.reconfigure(uuid, init_handles)`` (``reconfigure``
here) builds it over the ranks whose ``get_init_handle()`` are listed."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket

from . import _C, _bootstrap, _registry
from ._C import UnsupportedError
from ._options import CommOptions, _ms, _TypeError, _ValueError
from ._work import _DoneWork


class ReconfigureOptions:
    """The arguments of ``TorchComm.reconfigure`` as one object (torchcomms' class)."""

    def __init__(self, uuid: int = 0, init_handles=None, timeout=None, hints=None) -> None:
        self.uuid = uuid
        self.init_handles = [] if init_handles is None else init_handles
        self.timeout = timeout
        self.hints = dict(hints or {})


class _Unconfigured:
    """What a communicator made with ``enable_reconfigure=True`` holds until its first
    ``reconfigure``: it knows its name, backend, timeout and hints, and every op says to
    reconfigure first."""

    def __init__(self, backend, name, timeout, hints) -> None:
        self._backend, self._name, self._timeout = backend, name, timeout
        self._hints = dict(hints)

    def name(self):
        return self._name

    def backend(self):
        return self._backend

    def timeout(self):
        return self._timeout

    def hints(self):
        return dict(self._hints)

    def set_timeout(self, td) -> None:
        self._timeout = td

    def set_hints(self, hints) -> None:
        self._hints = dict(hints)

    def finalize(self) -> None:
        pass

    abort = finalize

    @staticmethod
    def register_hook(fn):
        """Hooks wait for the communicator reconfigure makes (TorchComm._rebind)."""
        return lambda: None

    register_pre_hook = register_post_hook = register_abort_hook = register_hook

    def __getattr__(self, attr):
        raise _ValueError(
            f"[{self._name}] {attr}: this communicator was made with enable_reconfigure=True "
            "and has no ranks until reconfigure(uuid, init_handles) is called"
        )


def init_handle(self) -> str:
    """``TorchComm.get_init_handle`` of ``self``."""
    handle = getattr(self, "_init_handle", None)
    if handle is None:
        handle = f"fastcomms:{self.get_backend()}:{socket.gethostname()}:{os.getpid()}"
        handle += f":{secrets.token_hex(8)}"
        self._init_handle = handle
    return handle


def reconfigure(self, uuid, init_handles=None, timeout=None, hints=None) -> _DoneWork:
    """``TorchComm.reconfigure`` of ``self``."""
    if isinstance(uuid, ReconfigureOptions):
        uuid, init_handles, timeout, hints = uuid.uuid, uuid.init_handles, uuid.timeout, uuid.hints
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
    import torch.distributed as dist

    td = _ms(timeout, where) if timeout is not None else self._options.timeout
    store = self._options.store
    if store is None:
        raise _ValueError(
            f"{where} the communicator has no store (new_comm(store=...), or MASTER_ADDR "
            "and MASTER_PORT with TORCHCOMM_RANK/SIZE or RANK/WORLD_SIZE set)"
        )
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
    try:  # the configuration before (a no-op before the first), its attachments first
        self._detach(destroy=False, release=True)  # NOTE [communicator attachments]
        self._c.finalize()
    except Exception:  # noqa: BLE001 (a broken configuration: abort it instead)
        self._c.abort()
    o = self._options
    merged = {**o.hints, **(hints or {})}
    options = CommOptions(o.abort_process_on_timeout_or_error, td, o.store, merged, name)
    c = _registry.native_comm(backend, rank, size, self._device, space, options)
    c.set_timeout(self._options.timeout)  # the reconfigure timeout was for the rendezvous
    self._rebind(c)
    self._reconf_uuids.add(uuid)
    return _DoneWork()


def new_reconfigurable(backend, name, opts, hints, store) -> tuple[_Unconfigured, CommOptions]:
    """new_comm(enable_reconfigure=True): no ranks and no rendezvous until reconfigure(); what
    the TorchComm holds and its options."""
    if not _C.is_backend_built(backend):
        raise UnsupportedError(
            f"new_comm: enable_reconfigure=True needs a built-in backend "
            f"({', '.join(b for b in ('gloo', 'nccl', 'nvlink') if _C.is_backend_built(b))}), "
            f"got {backend!r}"
        )
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
    return _Unconfigured(backend, name, opts.timeout, hints), options
