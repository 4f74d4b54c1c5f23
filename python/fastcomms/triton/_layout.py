# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Byte offsets of the fields of ``fastcomms::device::DeviceWindow`` and ``RegisteredBuffer``
(include/fastcomms/device/window.hpp) that the Triton functions read. The CPU tests compare
them with ``fastcomms._C.device_window_layout()`` (offsetof in the compiled binding)."""

LAYOUT = {
    "DeviceWindow.base_": 0,
    "DeviceWindow.size_": 8,
    "DeviceWindow.rank_": 16,
    "DeviceWindow.num_ranks_": 20,
    "DeviceWindow.signal_count_": 24,
    "DeviceWindow.counter_count_": 28,
    "DeviceWindow.barrier_count_": 32,
    "DeviceWindow.flags_": 36,
    "DeviceWindow.peer_bases_": 40,
    "DeviceWindow.signals_": 48,
    "DeviceWindow.peer_signals_": 56,
    "DeviceWindow.counters_": 64,
    "DeviceWindow.barriers_": 72,
    "DeviceWindow.peer_barriers_": 80,
    "DeviceWindow.barrier_epochs_": 88,
    "DeviceWindow.error_": 96,
    "DeviceWindow.timeout_ns_": 104,
    "DeviceWindow": 112,
    "RegisteredBuffer.base_ptr": 0,
    "RegisteredBuffer.size": 8,
    "RegisteredBuffer": 24,
    "kFaultUnorderedSignal": 1,
    "kDeviceInvalid": -1,
    "kDeviceTimeout": -2,
}
