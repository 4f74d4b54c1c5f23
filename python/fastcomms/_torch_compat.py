# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The private torch APIs fastcomms uses, each behind one function that works from torch 2.11 to
the newest (NOTE [private torch APIs]).

NOTE [private torch APIs]: torch renames its private APIs between minors. 2.15 renamed the opaque
object API (``register_opaque_type`` -> ``register_custom_class``, ``is_opaque_type`` ->
``is_custom_class``, typ ``"reference"`` -> ``"symbolic"``, ``torch._opaque_base.OpaqueBase`` ->
``torch._custom_class_base.CustomClassBase``), logging a deprecation warning on each old name,
and ``_MeshLayout`` lost ``coalesce``/``nest`` (a flattened mesh is ``_MeshLayout([collapse()])``).
Every such use goes through here, newest spelling first, so a torch without the new name gets
the old one and no torch gets a warning. tests/python/test_torch_compat.py runs each on the
installed torch; CI runs it on the oldest and the newest supported torch.
"""

from __future__ import annotations

from typing import Any

try:  # torch >= 2.15
    from torch._custom_class_base import CustomClassBase as OpaqueBase
except ImportError:
    try:
        from torch._opaque_base import OpaqueBase  # type: ignore[no-redef]
    except ImportError:  # pragma: no cover (torch before opaque objects: not traceable)
        OpaqueBase = object  # type: ignore[misc,assignment]


def _opaque_api():
    """(register, is_registered, symbolic typ name, MemberType), or None where torch lacks it."""
    try:
        from torch._library import opaque_object as oo
    except ImportError:  # torch still initializing (imported through an alias), or too old
        return None
    if hasattr(oo, "register_custom_class"):
        return oo.register_custom_class, oo.is_custom_class, "symbolic", oo.MemberType
    return oo.register_opaque_type, oo.is_opaque_type, "reference", oo.MemberType


def member_type():
    """torch's ``MemberType`` enum (USE_REAL, INLINED), or None where torch lacks it."""
    api = _opaque_api()
    return api[3] if api else None


def register_symbolic_class(cls: type, members: dict[str, Any]) -> bool:
    """Registers ``cls`` as an opaque reference ("symbolic") class of torch.compile, once.
    False where this torch cannot (yet): too old, or still initializing."""
    api = _opaque_api()
    if api is None:
        return False
    register, is_registered, typ, _ = api
    if is_registered(cls):
        return True
    # NOTE [opaque registration on a retried import]: torch registers the name (module.qualname)
    # with the dispatcher once per process and refuses it a second time. A module whose import
    # failed after registering its class leaves that name behind; importing it again makes a new
    # class object of the same name, which gets torch's Python-side registration (the tables
    # keyed by class) while the dispatcher keeps the name it already has.
    import torch

    name = f"{cls.__module__}.{cls.__qualname__}"
    if not torch._C._is_opaque_type_registered(name):
        register(cls, typ=typ, members=members)
        return True
    c_register = torch._C._register_opaque_type
    torch._C._register_opaque_type = lambda _name: None
    try:
        register(cls, typ=typ, members=members)
    finally:
        torch._C._register_opaque_type = c_register
    return True


def opaque_type_name(cls: type) -> str:
    from torch._library.opaque_object import get_opaque_type_name

    return get_opaque_type_name(cls)


def flat_mesh_layout(layout):
    """The one-dimensional layout that flattening ``layout`` (a DeviceMesh's ``_MeshLayout``)
    gives, as torch's own ``_flatten`` makes it."""
    if hasattr(layout, "collapse"):  # torch >= 2.15
        return type(layout)([layout.collapse()])
    flat = layout.coalesce() if hasattr(layout, "coalesce") else layout
    if hasattr(flat, "nest") and len(flat) > 1:
        flat = flat.nest()
    return flat
