# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Hooks to register on a communicator, as torchcomms' ``torchcomms.hooks`` names them:

- ``FlightRecorderHook``: a ring of the last ``max_entries`` operations (op id, communicator,
  rank, operation, tensor shapes and dtypes, state, times), dumped as JSON on demand and to a
  file when the communicator aborts or one of its operations times out (a sync op, or a wait on
  an async op's work, raising ``TimeoutError``); ``TORCHCOMM_FR_DUMP_TEMP_FILE`` is the file's
  prefix. States: "started" (not yet issued), "issued" (a sync op returned, or an async op
  whose work was dropped), "in_progress", "completed", "timed_out" and "failed" (read from the
  async op's work at dump time).
- ``NanCheckHook``: raises ``RuntimeError`` before an operation whose input holds a NaN.

Both are built on the communicator's pre/post/abort hooks (``TorchComm.register_*_hook``)."""

from __future__ import annotations

import collections
import json
import os
import threading
import time
import weakref
from typing import Any

import torch

__all__ = ["FlightRecorderHook", "NanCheckHook"]


def _tensors(args: Any) -> list[tuple[str, Any]]:
    """(label, tensor) pairs of a pre-hook argument object: its tensor, input and output."""
    out = []
    for label in ("tensor", "input", "output"):
        v = getattr(args, label, None) if label in getattr(args, "_fields", ()) else None
        if isinstance(v, torch.Tensor):
            out.append((label, v))
        elif isinstance(v, list | tuple):
            out.extend((f"{label}[{i}]", t) for i, t in enumerate(v) if isinstance(t, torch.Tensor))
    return out


class FlightRecorderHook:
    """Records the last ``max_entries`` operations of the communicators it is registered with.
    ``isolated=True`` keeps one ring per communicator (``dump_json`` then lists them all).
    Thread-safe."""

    def __init__(self, max_entries: int = 2048, isolated: bool = False) -> None:
        if max_entries <= 0:
            raise ValueError(f"FlightRecorderHook: max_entries must be positive, got {max_entries}")
        self._max, self._isolated = int(max_entries), bool(isolated)
        self._rings: dict[str, collections.deque] = {}
        self._open: dict[tuple[str, int], dict] = {}
        self._lock = threading.Lock()
        self._handles: list[Any] = []
        self._ranks: dict[str, int] = {}
        self._works: dict[tuple[str, int], weakref.ref] = {}  # async ops' works, weakly

    def _ring(self, comm_name: str) -> collections.deque:
        key = comm_name if self._isolated else ""
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = collections.deque(maxlen=self._max)
        return ring

    def register_with_comm(self, comm: Any) -> None:
        """Starts recording ``comm``'s operations."""
        name, rank = comm.get_name(), comm.get_rank()
        self._ranks[name] = rank

        def pre(op, op_id, args):
            entry = {
                "op_id": op_id,
                "comm": name,
                "rank": rank,
                "op": getattr(op, "value", str(op)),
                "tensors": [
                    {"arg": label, "shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1]}
                    for label, t in _tensors(args)
                ],
                "async_op": bool(getattr(args, "async_op", False)),
                "state": "started",
                "time_started_ns": time.time_ns(),
                "time_issued_ns": None,
            }
            with self._lock:
                self._ring(name).append(entry)
                self._open[(name, op_id)] = entry

        def post(op_id, args):
            with self._lock:
                entry = self._open.pop((name, op_id), None)
                if entry is not None:
                    entry["state"] = "issued"  # sync ops are complete here, async ones enqueued
                    entry["time_issued_ns"] = time.time_ns()

        def observe(event, op_id, payload):
            if event == "issued" and payload is not None:
                with self._lock:
                    self._works[(name, op_id)] = weakref.ref(payload)
                    if len(self._works) > 2 * self._max * max(1, len(self._rings)):
                        self._prune_works()
                return
            if event == "timeout":
                with self._lock:
                    for entry in self._ring(name):
                        if entry["comm"] == name and entry["op_id"] == op_id:
                            entry["timed_out"] = True
                self.dump_file(rank)

        def on_abort():
            self.dump_file(rank)

        self._handles += [
            comm.register_pre_hook(pre),
            comm.register_post_hook(post),
            comm._observe(observe),
            comm.register_abort_hook(on_abort),
        ]

    def unregister(self) -> None:
        """Stops recording (the entries stay until ``reset``)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def _state(self, entry: dict) -> str:
        if entry.pop("timed_out", False):
            return "timed_out"
        ref = self._works.get((entry["comm"], entry["op_id"]))
        work = ref() if ref is not None else None
        if work is None:
            return entry["state"]
        status = work.status().name
        return {
            "COMPLETED": "completed",
            "TIMEDOUT": "timed_out",
            "ERROR": "failed",
        }.get(status, "in_progress")

    def _prune_works(self) -> None:
        """Forgets the works of entries the rings no longer hold (the lock is held)."""
        live = {(e["comm"], e["op_id"]) for ring in self._rings.values() for e in ring}
        self._works = {k: w for k, w in self._works.items() if k in live}

    def _entries(self, include_completed: bool) -> list[dict]:
        with self._lock:
            self._prune_works()
            entries = [dict(e) for ring in self._rings.values() for e in ring]
            for e in entries:
                e["state"] = self._state(e)
        if not include_completed:  # what is not known to be finished
            entries = [
                e
                for e in entries
                if e["state"] != "completed" and not (e["state"] == "issued" and not e["async_op"])
            ]
        return sorted(entries, key=lambda e: e["time_started_ns"])

    def dump_json(self, include_completed: bool = True) -> str:
        """The recorded operations as JSON: ``{"version": 1, "entries": [...]}``; without
        ``include_completed``, only operations not known to be finished (started, or async)."""
        return json.dumps({"version": 1, "entries": self._entries(include_completed)})

    def dump_file(self, rank: int, include_completed: bool = True) -> str:
        """Writes ``dump_json`` to ``$TORCHCOMM_FR_DUMP_TEMP_FILE<rank>`` (default prefix
        ``/tmp/torchcomm_fr_trace_``) and returns the path."""
        prefix = os.environ.get("TORCHCOMM_FR_DUMP_TEMP_FILE", "/tmp/torchcomm_fr_trace_")
        path = f"{prefix}{rank}"
        with open(path, "w") as f:
            f.write(self.dump_json(include_completed))
        return path

    def reset(self) -> None:
        with self._lock:
            self._rings.clear()
            self._open.clear()
            self._works.clear()

    def is_enabled(self) -> bool:
        return bool(self._handles)

    def size(self) -> int:
        with self._lock:
            return sum(len(r) for r in self._rings.values())


class NanCheckHook:
    """Raises ``RuntimeError`` naming the communicator, operation and argument before an
    operation whose input (or in-place tensor) holds a NaN. Costs one reduction per floating
    input."""

    def __init__(self) -> None:
        self._handles: list[Any] = []

    def register_with_comm(self, comm: Any) -> None:
        name = comm.get_name()

        def pre(op, op_id, args):
            for label, t in _tensors(args):
                if label.startswith("output") and not label.startswith("output_"):
                    continue  # outputs are written by the op, not read
                if t.is_floating_point() and t.numel() and bool(torch.isnan(t).any()):
                    raise RuntimeError(
                        f"[{name} {getattr(op, 'value', op)}] NaN in {label} "
                        f"({tuple(t.shape)} {str(t.dtype).split('.')[-1]}) before the operation"
                    )

        self._handles.append(comm.register_pre_hook(pre))

    def unregister(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
