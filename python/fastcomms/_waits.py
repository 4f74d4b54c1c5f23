# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""torchcomms' two wait operators, for code that calls them by name.

NOTE [torchcomms wait ops]: ``torch.ops.torchcomms.torchcomm_wait_tensors`` (``Tensor[] ->
Tensor[]``, new tensors) and ``torchcomm_wait_tensors_`` (in place) wait for the asynchronous
work torch's work registry holds for their tensors (every async call made inside a compiled
function and the Ulysses op's async results, NOTE [compiled async calls]) and are the identity
to autograd. Defined only where the torchcomms package is not installed (defining them twice
would break its import). Under torch.compile the in-place form becomes torch's own
``_c10d_functional.wait_tensor`` per tensor (inductor places it as a collective's wait); the
functional form stays one node. The wait is in compiled graphs, so this module's digest is part
of a communicator's graph-cache key (``code_key``).
"""

from __future__ import annotations

import functools
import importlib.metadata

import torch

_lib = None


@functools.cache  # (asked again by _torchcomms_ops)
def _torchcomms_installed() -> bool:
    try:
        importlib.metadata.distribution("torchcomms")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _in_place(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    for t in inputs:
        torch.ops._c10d_functional.wait_tensor(t)
    return inputs


def _functional(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in _in_place(inputs)]


def _functional_fake(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.empty_like(t) for t in inputs]


def _in_place_autograd(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.torchcomms.torchcomm_wait_tensors_.default(inputs)


def _in_place_functionalized(ctx, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    raw = ctx.unwrap_tensors(inputs)
    with ctx.redispatch_to_next():
        waited = [torch.ops._c10d_functional.wait_tensor(t) for t in raw]
    for t, w in zip(inputs, waited, strict=True):
        ctx.replace(t, w)
        ctx.commit_update(t)
        ctx.sync(t)
    return inputs


def register() -> bool:
    """Defines the two operators once (True where they are fastcomms'); again with the first
    communicator where torch imported this package before ``torch.library`` existed."""
    global _lib
    if _lib is not None:
        return True
    if not hasattr(torch, "library") or not hasattr(torch, "Tag") or _torchcomms_installed():
        return False
    try:
        lib = torch.library.Library("torchcomms", "FRAGMENT")
        tags = (torch.Tag.pt2_compliant_tag,)
        lib.define("torchcomm_wait_tensors(Tensor[] inputs) -> Tensor[]", tags=tags)
        lib.define("torchcomm_wait_tensors_(Tensor(a!)[] inputs) -> Tensor(a!)[]", tags=tags)
    except RuntimeError:  # another library defined them: theirs serve
        return False
    lib.impl("torchcomm_wait_tensors", _functional, "CompositeExplicitAutograd")
    torch.library.register_fake("torchcomms::torchcomm_wait_tensors", _functional_fake, lib=lib)
    torch.library.register_autograd(  # the identity
        "torchcomms::torchcomm_wait_tensors",
        lambda ctx, grads: grads,
        setup_context=lambda ctx, inputs, output: None,
        lib=lib,
    )
    lib.impl("torchcomm_wait_tensors_", _in_place, "CompositeExplicitAutograd")
    lib.impl("torchcomm_wait_tensors_", lambda inputs: inputs, "Meta")
    lib.impl("torchcomm_wait_tensors_", _in_place_autograd, "Autograd")
    torch.ops.torchcomms.torchcomm_wait_tensors_.default.py_functionalize_impl(
        _in_place_functionalized
    )
    _lib = lib
    return True
