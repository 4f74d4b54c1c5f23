# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""What `fastcomms bench` runs and the tools/gpu benchmarks reuse: the permute baseline and the
gated device timer (the host-time sampler of the benchmarks is tools/gpu/_bench_common.py's).

NOTE [gated device timing]
A batch of back-to-back calls timed between two CUDA events measures the device only while the
host keeps ahead of it. A Python call that costs more on the host than its kernels take on the
GPU (the permute path costs ~100-250 µs of Python against ~30 µs of GPU work; our small Ulysses
calls ~20 µs against ~15 µs) leaves the GPU idle between calls, and the events then time the
host. The C++ benchmark (tools/gpu/bench_a2a) has no such cost, so the two disagreed by 1.2-9x on
small messages. The timer below first queues a spin kernel (``torch.cuda._sleep``) long enough to
hold the stream while the host issues the whole batch, then one untimed call (it absorbs the
ranks' arrival skew), then the timed calls: the events see only device time. Whether the gate
held (the spin kernel was still running when the host finished issuing) is checked on every
sample and agreed across ranks; a gate that did not hold is doubled and the sample taken again,
all ranks together, so every rank issues the same calls. The host's cost per call is reported
beside the device time, because an eager training loop pays whichever of the two is larger.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def permute_all_to_all_4d(x, mode, size, group=None):
    """The baseline: permute + torch.distributed all_to_all_single + permute (even shards), as
    Ulysses code usually has it. Mode 0: (b, s, h, d) -> (b, s * size, h / size, d); mode 1 the
    inverse."""
    b, s, h, d = x.shape
    if mode == 0:
        send = x.reshape(b, s, size, h // size, d).permute(2, 0, 1, 3, 4).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        return recv.permute(1, 0, 2, 3, 4).reshape(b, size * s, h // size, d)
    send = x.reshape(b, size, s // size, h, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // size, size * h, d)


class GatedTimer:
    """Device seconds per call of ``fn`` on the current CUDA stream, with the host's cost out of
    the way (NOTE [gated device timing]). ``agree(value) -> value`` returns the largest value
    over the ranks (identity for one process); every rank must call ``sample`` with the same
    ``iters`` in the same order."""

    MAX_TRIES = 4

    def __init__(self, agree=lambda v: v):
        self._agree = agree
        self._gate_s = 0.002
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        a.record()
        torch.cuda._sleep(10_000_000)
        b.record()
        b.synchronize()
        self._cycles_per_s = 10_000_000 / max(a.elapsed_time(b) / 1e3, 1e-6)

    def sample(self, fn, iters):
        """Returns (device s/call, host s/call, gated): ``gated`` is False only when the gate did
        not hold after MAX_TRIES doublings (the device time is then an upper bound)."""
        for _ in range(self.MAX_TRIES):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            gate = torch.cuda.Event()
            t0 = time.perf_counter()
            torch.cuda._sleep(int(self._gate_s * self._cycles_per_s))
            gate.record()
            fn()  # untimed: the ranks' arrival skew ends here
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            host_s = time.perf_counter() - t0
            missed = 1.0 if gate.query() else 0.0  # the spin had ended before the last issue
            b.synchronize()
            device_s = a.elapsed_time(b) / 1e3 / iters
            if self._agree(missed) == 0.0:
                return device_s, host_s / (iters + 1), True
            self._gate_s = self._agree(max(2 * self._gate_s, 2 * host_s))
        return device_s, host_s / (iters + 1), False
