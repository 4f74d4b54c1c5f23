# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Hooks to register on a communicator, as torchcomms' ``torchcomms.hooks`` names them:
``FlightRecorderHook`` (the last operations, in torch's flight-recorder trace format),
``NanCheckHook`` (raises before an operation whose input holds a NaN) and ``clog`` (torchcomms'
clog log, NOTE [clog]): each wraps C++ hooks on the communicator (attached through
``TorchComm._attach_cpp``, so they follow it through a reconfigure), for every backend: one
written in Python is under the C++ communicator too (NOTE [python backend trampoline])."""

from __future__ import annotations

import functools
import json
import os
import pickle
import weakref
from typing import Any

from . import _C

__all__ = ["FlightRecorderHook", "NanCheckHook", "clog"]


class _Registered:
    """The communicator hooks a hook object registered (``_handles``) and ``unregister()``."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def unregister(self) -> None:
        """Stops (what was recorded or written stays)."""
        for h in self._handles:
            h.remove()
        self._handles = []


def _dump_for(ref, rank: int) -> None:
    """The C++ recorder's dump at an abort or a timeout (weakly held: the communicators'
    hooks must not keep the Python recorder alive)."""
    fr = ref()
    if fr is not None:
        fr.dump_file(rank)


class FlightRecorderHook(_Registered):
    """Records the last ``max_entries`` operations of the communicators it is registered with,
    in torch's flight-recorder trace format (version "2.10": ``pg_config``, ``pg_status`` and
    ``entries`` with ``record_id``, ``pg_id``, ``process_group``, ``collective_seq_id``,
    ``p2p_seq_id``, ``op_id``, ``profiling_name`` "<backend>:<op>", input/output sizes and
    dtypes, ``time_created_ns``, ``state`` "scheduled"/"started"/"completed", ``is_p2p``,
    ``retired``, ``timeout_ms``), so torch's analyzer (``torch.distributed.flight_recorder``)
    reads its dumps. The recording is C++ hooks on the communicator (NOTE [flight recorder in
    C++]): every path a call takes is recorded and none is slowed to Python's pace. An async op's
    state is read from its work at dump time; a sync op is complete when it returns (on CUDA:
    ordered on the stream). ``dump_file`` writes the trace pickled, as torch does, when asked,
    when a communicator aborts and when an operation times out. ``isolated=True`` keeps one ring
    per communicator. Thread-safe."""

    VERSION = "2.10"

    def __init__(self, max_entries: int = 2048, isolated: bool = False) -> None:
        super().__init__()
        if max_entries < 0:
            raise ValueError(
                f"FlightRecorderHook: max_entries must be 0 or more, got {max_entries}"
            )
        # NOTE [flight recorder size 0]: torchcomms' shared recorder is sized by
        # TORCHCOMM_FR_BUFFER_SIZE (2000 unset) and an isolated one by max_entries, and a recorder
        # of 0 entries records nothing (torch's torchcomms switch makes FlightRecorderHook(0)): 0
        # here is that size, and 0 records nothing
        if max_entries == 0 and not isolated:
            max_entries = max(0, int(os.environ.get("TORCHCOMM_FR_BUFFER_SIZE", "2000")))
        self._max, self._isolated = int(max_entries), bool(isolated)
        self._fr = _C.FlightRecorder(self._max, self._isolated)
        self._attached = False

    def register_with_comm(self, comm: Any) -> None:
        """Starts recording ``comm``'s operations."""
        dump = functools.partial(_dump_for, weakref.ref(self))
        self._handles.append(comm._attach_cpp(lambda c: self._fr.attach(c, dump)))
        self._attached = True

    def unregister(self) -> None:
        """Stops (what was recorded stays)."""
        super().unregister()
        self._fr.detach()
        self._attached = False

    def _trace(self, include_completed: bool, rank: int | None = None) -> dict:
        entries = self._fr.entries(include_completed)
        groups = self._fr.groups()
        for e in entries:
            e["process_group"] = list(e["process_group"])
        pg_config = {
            g["name"]: {
                "name": g["name"],
                "desc": g["backend"],
                "ranks": "[" + ",".join(map(str, range(g["size"]))) + "]",
            }
            for g in groups
        }
        pg_status = {}
        for g in groups:
            n = g["name"]
            mine = [e for e in entries if e["process_group"][0] == n and not e["is_p2p"]]
            done = [e["collective_seq_id"] for e in mine if e["state"] == "completed"]
            started = [e["collective_seq_id"] for e in mine if e["state"] != "scheduled"]
            pg_status[n] = {
                "last_enqueued_collective": g["collective_seq_id"],
                "last_started_collective": max(started, default=-1),
                "last_completed_collective": max(done, default=-1),
            }
        if rank is None and groups:
            rank = groups[0]["rank"]
        trace = {"version": self.VERSION, "pg_config": pg_config, "pg_status": pg_status}
        if rank is not None:
            trace["rank"] = rank
        trace["entries"] = entries
        return trace

    def dump_json(self, include_completed: bool = True) -> str:
        """The trace as JSON; without ``include_completed``, only entries not retired."""
        return json.dumps(self._trace(include_completed))

    def dump_file(self, rank: int, include_completed: bool = True) -> str:
        """Writes the trace, pickled as torch's flight recorder writes it, and returns the path:
        ``$TORCHCOMM_FR_DUMP_TEMP_FILE<rank>``, by default
        ``$XDG_CACHE_HOME/torch/comm_lib_trace_rank_<rank>`` (``~/.cache`` without
        XDG_CACHE_HOME); with ``TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME=1``,
        ``$TORCHCOMM_FR_DUMP_TEMP_FILE`` itself (the whole path, read at each dump), as
        torchcomms names its files."""
        dynamic = os.environ.get("TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME", "0").lower()
        path = os.environ.get("TORCHCOMM_FR_DUMP_TEMP_FILE")
        if not (path and dynamic in ("1", "true", "yes", "on")):
            if not path:  # the default prefix
                cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
                os.makedirs(os.path.join(cache, "torch"), exist_ok=True)
                path = os.path.join(cache, "torch", "comm_lib_trace_rank_")
            path = f"{path}{rank}"
        with open(path, "wb") as f:
            pickle.dump(self._trace(include_completed, rank), f)
        return path

    def reset(self) -> None:
        """Drops every entry and restarts ``size()`` (the sequence ids go on)."""
        self._fr.reset()

    def is_enabled(self) -> bool:
        """Whether a communicator is registered."""
        return bool(self._handles) or self._attached

    def size(self) -> int:
        """The entries recorded since the last ``reset()`` (torchcomms' count: it goes on past
        ``max_entries``, while the dump holds the last ``max_entries``)."""
        return self._fr.size()

    __len__ = size


class NanCheckHook(_Registered):
    """torchcomms' NaN check: raises ``RuntimeError("NaN detected in <input|output> tensor for
    '<op>' on comm '<name>': ...")`` where a floating tensor an operation reads
    (``check_inputs``, default on; an in-place tensor counts as input) or, with
    ``check_outputs=True``, a floating tensor it writes (a ``recv`` buffer, the outputs; also the
    in-place tensor) holds a NaN. A C++ hook on the communicator (NOTE [NaN check on the device]):
    a CPU tensor is checked before its operation, which the NaN stops; a CUDA tensor is reduced on
    the device without a host sync, and the NaN is raised by the communicator's next operation
    (its own ran). Costs one reduction per checked tensor."""

    def __init__(self, check_inputs: bool = True, check_outputs: bool = False) -> None:
        super().__init__()
        self._check_inputs, self._check_outputs = bool(check_inputs), bool(check_outputs)
        self._nc = _C.NanCheck(self._check_inputs, self._check_outputs)
        self._registered_count = 0

    def register_with_comm(self, comm: Any) -> None:
        self._handles.append(comm._attach_cpp(self._nc.attach))
        self._registered_count += 1

    def unregister(self) -> None:
        """Stops checking."""
        super().unregister()
        self._nc.detach()

    def is_enabled(self) -> bool:
        """Whether it was registered with a communicator (torchcomms')."""
        return self._registered_count > 0


# NOTE [clog]: the log is C++ hooks on the communicator (include/fastcomms/core/clog.hpp), so
# every path a call takes is logged and none is turned off
_CLOG_EVENTS = ("Q", "S", "E", "W", "LIFECYCLE", "ALL", "NONE")
_CLOG_VERBOSE = ("buffers",)


class clog(_Registered):  # noqa: N801  (torchcomms' name)
    """torchcomms' ``clog`` hook: writes the signatures and lifecycle events of the operations
    of every communicator it is registered with to the file ``output``, in torchcomms' clog
    format (NOTE [clog]). ``events``: any of "Q", "S", "E", "W", "LIFECYCLE" (S, E and W),
    "ALL", "NONE"; enqueue lines (Q) are always written. ``verbose``: "buffers" adds the
    tensors' addresses to each signature (``buf=`` for an in-place tensor, ``in=`` / ``out=``).
    Thread-safe; each line is flushed as it is written."""

    VERSION = 1

    def __init__(self, output: str, events: list[str], verbose: list[str] | None = None) -> None:
        super().__init__()
        events = [str(e).upper() for e in events]
        verbose = [str(v).lower() for v in (verbose or [])]
        for e in events:
            if e not in _CLOG_EVENTS:
                raise ValueError(f"clog: unknown event {e!r}; expected one of {_CLOG_EVENTS}")
        for v in verbose:
            if v not in _CLOG_VERBOSE:
                raise ValueError(f"clog: unknown verbose field {v!r}; expected {_CLOG_VERBOSE}")
        every = "ALL" in events or "LIFECYCLE" in events
        start, end, waited = (every or e in events for e in "SEW")
        self._log = _C.Clog(str(output), start, end, waited, "buffers" in verbose)

    def register_with_comm(self, comm: Any) -> None:
        """Starts logging ``comm``'s operations (writes its ``new_comm`` line)."""
        self._handles.append(comm._attach_cpp(self._log.attach))

    def unregister(self) -> None:
        """Stops (what was written stays)."""
        super().unregister()
        self._log.detach()

    def close(self) -> None:
        """Stops logging and closes the file."""
        self.unregister()
        self._log.close()
