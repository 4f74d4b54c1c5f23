# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Byte offsets of the fields of ``fastcomms::device::DeviceWindow`` and ``RegisteredBuffer``
(include/fastcomms/device/window.hpp) that the Triton functions read, and the device API's
constants: ``offsetof`` in the compiled binding, read once (no second copy to drift)."""

from .. import _C

LAYOUT = _C.device_window_layout()
