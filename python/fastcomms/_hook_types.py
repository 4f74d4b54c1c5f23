# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The types hooks receive, as torchcomms names them: ``OpName`` and one pre-hook argument class
per operation (the call's tensors and arguments), and the post-hook argument classes.

A pre-hook is called as ``fn(name: OpName, op_id: int, args)``, a post-hook as
``fn(op_id: int, args)``; ``op_id`` is the same for the two calls of one operation."""

from __future__ import annotations

import enum
import re

__all__ = ["OpName", "RemovableHandle"]


class OpName(enum.Enum):
    """The operation a hook is called for."""

    send = "send"
    recv = "recv"
    broadcast = "broadcast"
    all_reduce = "all_reduce"
    reduce = "reduce"
    all_gather = "all_gather"
    all_gather_v = "all_gather_v"
    all_gather_single = "all_gather_single"
    reduce_scatter = "reduce_scatter"
    reduce_scatter_v = "reduce_scatter_v"
    reduce_scatter_single = "reduce_scatter_single"
    all_to_all_single = "all_to_all_single"
    all_to_all_v_single = "all_to_all_v_single"
    all_to_all = "all_to_all"
    barrier = "barrier"
    scatter = "scatter"
    gather = "gather"
    gather_single = "gather_single"
    split = "split"
    new_window = "new_window"
    batch_op_issue = "batch_op_issue"
    finalize = "finalize"


class RemovableHandle:
    """Returned by the hook registrations; ``remove()`` unregisters (idempotent)."""

    def __init__(self, remover) -> None:
        self._remover = remover

    def remove(self) -> None:
        if self._remover is not None:
            self._remover()
            self._remover = None


def _args_class(name: str, fields: tuple[str, ...], base: type = object) -> type:
    """A small read-only record: positional construction in field order, attribute access."""

    def __init__(self, *values):
        if len(values) != len(fields):
            raise TypeError(f"{name} takes {len(fields)} values ({', '.join(fields)})")
        for f, v in zip(fields, values, strict=True):
            object.__setattr__(self, f, v)

    def __setattr__(self, key, value):
        raise AttributeError(f"{name} is read-only")

    def __repr__(self):
        inner = ", ".join(f"{f}={_short(getattr(self, f))}" for f in fields)
        return f"{name}({inner})"

    methods = {"__init__": __init__, "__setattr__": __setattr__, "__repr__": __repr__}
    return type(name, (base,), {"__slots__": fields, "_fields": fields, **methods})


def _short(v):
    shape = getattr(v, "shape", None)
    if shape is not None:
        return f"Tensor{tuple(shape)}"
    if isinstance(v, list) and v and getattr(v[0], "shape", None) is not None:
        return f"[{len(v)} tensors]"
    return repr(v)


# torchcomms' fields, and for the reductions the call's ReduceOp last (``op``: a fastcomms
# addition, which the clog hook writes)
_PRE = {
    "SendPreHookArgs": ("tensor", "peer", "async_op"),
    "RecvPreHookArgs": ("tensor", "peer", "async_op"),
    "BroadcastPreHookArgs": ("tensor", "root", "async_op"),
    "AllReducePreHookArgs": ("tensor", "async_op", "op"),
    "ReducePreHookArgs": ("tensor", "root", "async_op", "op"),
    "AllGatherPreHookArgs": ("input", "output", "async_op"),
    "AllGatherVPreHookArgs": ("input", "output", "async_op"),
    "AllGatherSinglePreHookArgs": ("input", "output", "async_op"),
    "ReduceScatterPreHookArgs": ("input", "output", "async_op", "op"),
    "ReduceScatterVPreHookArgs": ("input", "output", "async_op", "op"),
    "ReduceScatterSinglePreHookArgs": ("input", "output", "async_op", "op"),
    "AllToAllSinglePreHookArgs": ("input", "output", "async_op"),
    "AllToAllVSinglePreHookArgs": (
        "input",
        "output",
        "input_split_sizes",
        "output_split_sizes",
        "async_op",
    ),
    "AllToAllPreHookArgs": ("input", "output", "async_op"),
    "BarrierPreHookArgs": ("async_op",),
    "ScatterPreHookArgs": ("output", "input", "root", "async_op"),
    "GatherPreHookArgs": ("input", "output", "root", "async_op"),
    "GatherSinglePreHookArgs": ("input", "output", "root", "async_op"),
    "SplitPreHookArgs": ("ranks", "name"),
    "NewWindowPreHookArgs": (),
    "BatchOpIssuePreHookArgs": ("num_ops", "async_op"),
    "FinalizePreHookArgs": (),
}
_POST = {
    "CollectivePostHookArgs": (),
    # the communicator the split made (None where this rank joined none): fastcomms passes it,
    # as torchcomms does to its C++ hooks (its Python class shows no field)
    "SplitPostHookArgs": ("new_comm",),
    "NewWindowPostHookArgs": (),
    "BatchOpIssuePostHookArgs": (),
    "FinalizePostHookArgs": (),
}
for _name, _fields in {**_PRE, **_POST}.items():
    globals()[_name] = _args_class(_name, _fields)
__all__ += list(_PRE) + list(_POST)

# torchcomms' per-operation post-hook classes: one per collective and point-to-point operation,
# each a CollectivePostHookArgs with no fields; a post-hook gets its operation's (split's takes
# the communicator the split made)
POST_OF: dict[OpName, type] = {}
for _name in _PRE:
    _base = _name[: -len("PreHookArgs")]
    _post = f"{_base}PostHookArgs"
    if _post not in globals():
        globals()[_post] = _args_class(_post, (), base=globals()["CollectivePostHookArgs"])
        __all__.append(_post)
    POST_OF[OpName(re.sub(r"(?<!^)(?=[A-Z])", "_", _base).lower())] = globals()[_post]
