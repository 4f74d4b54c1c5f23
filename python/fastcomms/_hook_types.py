# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The types hooks receive, as torchcomms names them: ``OpName`` and one pre-hook argument class
per operation (the call's tensors and arguments), and the post-hook argument classes.

A pre-hook is called as ``fn(name: OpName, op_id: int, args)``, a post-hook as
``fn(op_id: int, args)``; ``op_id`` is the same for the two calls of one operation."""

from __future__ import annotations

import enum
import functools
import operator

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
    # fastcomms: torchcomms calls no hooks for its persistent all-gather (NOTE [persistent
    # all-gather]); fastcomms' hooks and flight recorder see its exec under torchcomms' name
    all_gather_p_exec = "all_gather_p_exec"


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


def _camel(op: str) -> str:
    return "".join(w.capitalize() for w in op.split("_"))


# each operation's ``<Op>PreHookArgs``: torchcomms' fields, and for the reductions the call's
# ReduceOp last (``op``: a fastcomms addition, which the clog hook writes)
_PRE = {
    "send": ("tensor", "peer", "async_op"),
    "recv": ("tensor", "peer", "async_op"),
    "broadcast": ("tensor", "root", "async_op"),
    "all_reduce": ("tensor", "async_op", "op"),
    "reduce": ("tensor", "root", "async_op", "op"),
    "all_gather": ("input", "output", "async_op"),
    "all_gather_v": ("input", "output", "async_op"),
    "all_gather_single": ("input", "output", "async_op"),
    "reduce_scatter": ("input", "output", "async_op", "op"),
    "reduce_scatter_v": ("input", "output", "async_op", "op"),
    "reduce_scatter_single": ("input", "output", "async_op", "op"),
    "all_to_all_single": ("input", "output", "async_op"),
    "all_to_all_v_single": (
        "input",
        "output",
        "input_split_sizes",
        "output_split_sizes",
        "async_op",
    ),
    "all_to_all": ("input", "output", "async_op"),
    "barrier": ("async_op",),
    "scatter": ("output", "input", "root", "async_op"),
    "gather": ("input", "output", "root", "async_op"),
    "gather_single": ("input", "output", "root", "async_op"),
    "split": ("ranks", "name"),
    "new_window": (),
    "batch_op_issue": ("num_ops", "async_op"),
    "finalize": (),
    "all_gather_p_exec": ("input", "output", "async_op"),
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
_PRE_CLASSES = {f"{_camel(op)}PreHookArgs": fields for op, fields in _PRE.items()}
for _name, _fields in {**_PRE_CLASSES, **_POST}.items():
    globals()[_name] = _args_class(_name, _fields)
__all__ += list(_PRE_CLASSES) + list(_POST)

# torchcomms' per-operation post-hook classes: one per collective and point-to-point operation,
# each a CollectivePostHookArgs with no fields; a post-hook gets its operation's (split's takes
# the communicator the split made)
POST_OF: dict[OpName, type] = {}
for _op in _PRE:
    _post = f"{_camel(_op)}PostHookArgs"
    if _post not in globals():
        globals()[_post] = _args_class(_post, (), base=globals()["CollectivePostHookArgs"])
        __all__.append(_post)
    POST_OF[OpName(_op)] = globals()[_post]

# torchcomms' unions of the argument classes (for annotations)
_post_classes = dict.fromkeys([*POST_OF.values(), *(globals()[c] for c in _POST)])
PreHookArgs = functools.reduce(operator.or_, (globals()[c] for c in _PRE_CLASSES))
PostHookArgs = functools.reduce(operator.or_, _post_classes)
__all__ += ["PreHookArgs", "PostHookArgs"]
