# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The "nvlink" backend name in torch.distributed, and the finder that registers it where torch
imports this package under a ``torchcomms`` alias before its own registry exists."""

from __future__ import annotations

import importlib.abc
import sys

from . import _C


def register_nvlink_name() -> bool:
    """NOTE [nvlink as a torch.distributed backend] (fastcomms/device_mesh.py): registers "nvlink"
    with torch.distributed where built; False while torch's registry does not exist yet."""
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


def register_with_torch() -> None:
    """Where torch imports this package while importing torch.distributed (a ``torchcomms``
    alias), a finder that loads nothing registers the name at the first import after."""
    if register_nvlink_name() or "torch.distributed.distributed_c10d" not in sys.modules:
        return

    class _WhenTorchDistributedIsWhole(importlib.abc.MetaPathFinder):
        done = False

        def find_spec(self, name, path=None, target=None):
            if not self.done:
                self.done = register_nvlink_name()
            return None  # loads nothing; stays in place (removing it mid-import skips a finder)

    sys.meta_path.insert(0, _WhenTorchDistributedIsWhole())
