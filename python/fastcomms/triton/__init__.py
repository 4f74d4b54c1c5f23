# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""The device window API for Triton kernels (torchcomms' ``torchcomms.triton`` functions):
``@triton.jit`` helpers a kernel calls with the int that ``TorchCommWindow.get_device_window()``
returns (``win``) and, for puts, the int that ``register_local_buffer(tensor)`` returns.

No bitcode is shipped: every function is Triton code over plain pointer loads and stores of the
``DeviceWindow`` fields (offsets in ``_layout.py``, checked against the C++ layout) plus inline
PTX for the ordered operations, so it runs with the Triton that torch brings. The memory
ordering is the C++ header's (NOTE [device window ordering] in fastcomms/device/window.hpp):

- block-scope calls (``*_block``, and every call that writes a peer's signal or barrier slot)
  must be reached by every thread of the program convergently; they join the program's threads
  with ``bar.sync`` (``tl.debug_barrier``) before the leader (thread 0) publishes with
  ``red.release.sys.global.add.u64`` / ``st.release.sys.global.u64``;
- waits spin with ``ld.acquire.sys.global.u64`` in every thread (idempotent, as torchcomms' are)
  and give up after the communicator's timeout (returning -2 and setting the error the host's
  ``check_errors()`` raises);
- ``fence`` is ``fence.acq_rel.sys``.

Return codes: 0, -1 (a rank, id or range refused; nothing written), -2 (timed out).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - torch wheels bring triton on Linux x86_64
    raise ImportError(
        "fastcomms.triton needs the triton package (torch's CUDA wheels install it)"
    ) from e

from ._layout import LAYOUT

__all__ = [
    "SIGNAL_SET",
    "SIGNAL_ADD",
    "CMP_EQ",
    "CMP_NE",
    "CMP_LT",
    "CMP_LE",
    "CMP_GT",
    "CMP_GE",
    "put_block",
    "self_copy_block",
    "signal",
    "signal_block",
    "wait_signal",
    "wait_signal_cmp",
    "wait_signal_from",
    "wait_signal_from_cmp",
    "wait_signal_from_block",
    "read_signal",
    "reset_signal",
    "wait_counter",
    "wait_counter_block",
    "read_counter",
    "reset_counter",
    "fence",
    "flush_block",
    "barrier_block",
    "rank",
    "num_ranks",
    "base",
    "size",
    "get_nvlink_address",
    "get_multimem_address",
    "requires_torchcomms",
    "requires_fastcomms",
    "transport_signal",
    "transport_wait_signal",
    "transport_send",
    "transport_recv",
    "transport_barrier",
    "transport_my_rank",
    "transport_n_ranks",
    "transport_num_nvl_peers",
    "transport_get_type",
]

# torchcomms' SignalOp and CmpOp values
SIGNAL_SET = tl.constexpr(0)
SIGNAL_ADD = tl.constexpr(1)
CMP_EQ = tl.constexpr(0)
CMP_NE = tl.constexpr(1)
CMP_LT = tl.constexpr(2)
CMP_LE = tl.constexpr(3)
CMP_GT = tl.constexpr(4)
CMP_GE = tl.constexpr(5)

_BASE = tl.constexpr(LAYOUT["DeviceWindow.base_"])
_SIZE = tl.constexpr(LAYOUT["DeviceWindow.size_"])
_RANK = tl.constexpr(LAYOUT["DeviceWindow.rank_"])
_NRANKS = tl.constexpr(LAYOUT["DeviceWindow.num_ranks_"])
_NSIG = tl.constexpr(LAYOUT["DeviceWindow.signal_count_"])
_NCNT = tl.constexpr(LAYOUT["DeviceWindow.counter_count_"])
_NBAR = tl.constexpr(LAYOUT["DeviceWindow.barrier_count_"])
_FLAGS = tl.constexpr(LAYOUT["DeviceWindow.flags_"])
_PEER_BASES = tl.constexpr(LAYOUT["DeviceWindow.peer_bases_"])
_SIGNALS = tl.constexpr(LAYOUT["DeviceWindow.signals_"])
_PEER_SIGNALS = tl.constexpr(LAYOUT["DeviceWindow.peer_signals_"])
_COUNTERS = tl.constexpr(LAYOUT["DeviceWindow.counters_"])
_BARRIERS = tl.constexpr(LAYOUT["DeviceWindow.barriers_"])
_PEER_BARRIERS = tl.constexpr(LAYOUT["DeviceWindow.peer_barriers_"])
_EPOCHS = tl.constexpr(LAYOUT["DeviceWindow.barrier_epochs_"])
_ERROR = tl.constexpr(LAYOUT["DeviceWindow.error_"])
_TIMEOUT = tl.constexpr(LAYOUT["DeviceWindow.timeout_ns_"])
_RB_BASE = tl.constexpr(LAYOUT["RegisteredBuffer.base_ptr"])
_RB_SIZE = tl.constexpr(LAYOUT["RegisteredBuffer.size"])
_FAULT_UNORDERED = tl.constexpr(LAYOUT["kFaultUnorderedSignal"])
_COPY_BLOCK = tl.constexpr(2048)


def requires_torchcomms(fn):
    """torchcomms' decorator (it links its bitcode); nothing to link here."""
    return fn


requires_fastcomms = requires_torchcomms


# -- field access and PTX --------------------------------------------------------------------------
@triton.jit
def _i64(addr):
    return tl.load(addr.to(tl.pointer_type(tl.int64)))


@triton.jit
def _i32(addr):
    return tl.load(addr.to(tl.pointer_type(tl.int32)))


@triton.jit
def _ld_acquire(addr):
    return tl.inline_asm_elementwise(
        "ld.acquire.sys.global.u64 $0, [$1];",
        "=l,l",
        [addr],
        dtype=tl.uint64,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _now_ns():
    return tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.uint64, is_pure=False, pack=1
    )


@triton.jit
def _leader_add_release(addr, value):
    # thread 0 of the program only: red.release.sys (a signal ADD)
    return tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 $0, 0; "
        "@p red.release.sys.global.add.u64 [$1], $2; }",
        "=r,l,l",
        [addr, value],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _leader_add_relaxed(addr, value):
    return tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 $0, 0; "
        "@p red.relaxed.sys.global.add.u64 [$1], $2; }",
        "=r,l,l",
        [addr, value],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _leader_add_release_gpu(addr, value):
    return tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 $0, 0; "
        "@p red.release.gpu.global.add.u64 [$1], $2; }",
        "=r,l,l",
        [addr, value],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _leader_st_release(addr, value):
    return tl.inline_asm_elementwise(
        "{ .reg .u32 t; .reg .pred p; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; mov.u32 $0, 0; "
        "@p st.release.sys.global.u64 [$1], $2; }",
        "=r,l,l",
        [addr, value],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _fence_sys():
    return tl.inline_asm_elementwise(
        "fence.acq_rel.sys; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _compare(cmp, v, x):
    return tl.where(
        cmp == 0,
        v == x,
        tl.where(
            cmp == 1,
            v != x,
            tl.where(
                cmp == 2, v < x, tl.where(cmp == 3, v <= x, tl.where(cmp == 4, v > x, v >= x))
            ),
        ),
    )


@triton.jit
def _timed_out(win, start):
    limit = _i64(win + _TIMEOUT).to(tl.uint64)
    return (limit != 0) & ((_now_ns() - start) > limit)


@triton.jit
def _report_timeout(win):
    # the host-mapped error word (kBarrierTimeout = 2); idempotent from every thread
    tl.atomic_xchg(_i64(win + _ERROR).to(tl.pointer_type(tl.int32)), 2, sem="relaxed", scope="sys")


@triton.jit
def _spin_slot(win, slot_addr, cmp, value):
    """Every thread spins on one slot with acquire loads; 0, or -2 on a timeout."""
    value = tl.cast(value, tl.uint64)
    start = _now_ns()
    v = _ld_acquire(slot_addr)
    done = _compare(cmp, v, value)
    late = done & False
    while (done == 0) & (late == 0):
        v = _ld_acquire(slot_addr)
        done = _compare(cmp, v, value)
        if done == 0:
            late = _timed_out(win, start)
    rc = tl.cast(0, tl.int32)
    if late:
        _report_timeout(win)
        rc = -2
    return rc


@triton.jit
def _sum_row(row_addr, n):
    s = _ld_acquire(row_addr)
    for q in range(1, n):
        s += _ld_acquire(row_addr + 8 * q)
    return s


# -- metadata -------------------------------------------------------------------------------------
@triton.jit
def rank(win):
    return _i32(win + _RANK)


@triton.jit
def num_ranks(win):
    return _i32(win + _NRANKS)


@triton.jit
def base(win):
    """This rank's window buffer, as an int64 address."""
    return _i64(win + _BASE)


@triton.jit
def size(win):
    return _i64(win + _SIZE)


@triton.jit
def get_nvlink_address(win, peer):
    """``peer``'s buffer mapped here (int64; 0 for a peer out of range)."""
    peer = tl.cast(peer, tl.int32)
    n = _i32(win + _NRANKS)
    ok = (peer >= 0) & (peer < n)
    p = tl.where(ok, peer, 0)
    a = _i64(_i64(win + _PEER_BASES) + 8 * tl.cast(p, tl.int64))
    return tl.where(ok, a, 0)


@triton.jit
def get_multimem_address(win, offset):
    """Always 0: fastcomms never creates NVLink multicast objects."""
    return tl.cast(offset, tl.int64) * 0


# -- RMA ------------------------------------------------------------------------------------------
@triton.jit
def _copy(dst, src, nbytes):
    """Every thread of the program copies its share; 8-byte words where all three allow."""
    if ((dst | src | nbytes) & 7) == 0:
        d = dst.to(tl.pointer_type(tl.int64))
        s = src.to(tl.pointer_type(tl.int64))
        words = nbytes // 8
        for i in range(0, words, _COPY_BLOCK):
            o = i + tl.arange(0, _COPY_BLOCK)
            m = o < words
            tl.store(d + o, tl.load(s + o, mask=m), mask=m)
    else:
        d8 = dst.to(tl.pointer_type(tl.int8))
        s8 = src.to(tl.pointer_type(tl.int8))
        for i in range(0, nbytes, _COPY_BLOCK):
            o = i + tl.arange(0, _COPY_BLOCK)
            m = o < nbytes
            tl.store(d8 + o, tl.load(s8 + o, mask=m), mask=m)


@triton.jit
def self_copy_block(dst_ptr, dst_offset, src_ptr, src_offset, nbytes):
    """A local copy by the program's threads (torchcomms' self-send helper)."""
    _copy(
        tl.cast(dst_ptr, tl.int64) + dst_offset,
        tl.cast(src_ptr, tl.int64) + src_offset,
        tl.cast(nbytes, tl.int64),
    )
    return 0


@triton.jit
def put_block(win, dst_offset, src_buf, src_offset, dst_rank, nbytes, signal_id, counter_id):
    """Copies ``nbytes`` of the registered buffer ``src_buf`` (from ``src_offset``) into
    ``dst_rank``'s window at ``dst_offset``; then ADDs 1 to ``signal_id`` at the peer (release)
    and to this rank's ``counter_id`` (when >= 0). Block scope."""
    dst_rank = tl.cast(dst_rank, tl.int32)
    signal_id = tl.cast(signal_id, tl.int32)
    counter_id = tl.cast(counter_id, tl.int32)
    dst_offset = tl.cast(dst_offset, tl.int64)
    src_offset = tl.cast(src_offset, tl.int64)
    nbytes = tl.cast(nbytes, tl.int64)
    n = _i32(win + _NRANKS)
    wsize = _i64(win + _SIZE)
    sbase = _i64(src_buf + _RB_BASE)
    ssize = _i64(src_buf + _RB_SIZE)
    ok = (dst_rank >= 0) & (dst_rank < n) & (sbase != 0) & (dst_offset >= 0) & (nbytes >= 0)
    ok = ok & (src_offset >= 0) & (dst_offset + nbytes <= wsize) & (src_offset + nbytes <= ssize)
    ok = ok & (signal_id < _i32(win + _NSIG)) & (counter_id < _i32(win + _NCNT))
    rc = tl.cast(-1, tl.int32)
    if ok:
        me = _i32(win + _RANK).to(tl.int64)
        slot = _i64(_i64(win + _PEER_SIGNALS) + 8 * tl.cast(dst_rank, tl.int64))
        slot = slot + 8 * (tl.cast(signal_id, tl.int64) * n + me)
        armed = ((_i32(win + _FLAGS) & _FAULT_UNORDERED) != 0) & (signal_id >= 0)
        unordered = tl.where(armed, 1, 0)
        if unordered == 1:  # the test control: a signal that overtakes the data
            _leader_add_relaxed(slot, 1)
        dst = _i64(_i64(win + _PEER_BASES) + 8 * tl.cast(dst_rank, tl.int64)) + dst_offset
        _copy(dst, sbase + src_offset, nbytes)
        if (signal_id >= 0) | (counter_id >= 0):
            tl.debug_barrier()  # every thread's stores before the leader's release
        if (signal_id >= 0) & (unordered == 0):
            _leader_add_release(slot, 1)
        if counter_id >= 0:
            _leader_add_release_gpu(_i64(win + _COUNTERS) + 8 * tl.cast(counter_id, tl.int64), 1)
        rc = 0
    return rc


# -- signals --------------------------------------------------------------------------------------
@triton.jit
def signal(win, peer, signal_id, op, value):
    """SET (op 0) or ADD (op 1) ``value`` into this rank's slot of ``signal_id`` at ``peer``,
    after the program's earlier writes (release). Block scope."""
    peer = tl.cast(peer, tl.int32)
    signal_id = tl.cast(signal_id, tl.int32)
    op = tl.cast(op, tl.int32)
    n = _i32(win + _NRANKS)
    ok = (peer >= 0) & (peer < n) & (signal_id >= 0) & (signal_id < _i32(win + _NSIG))
    ok = ok & ((op == 0) | (op == 1))
    rc = tl.cast(-1, tl.int32)
    if ok:
        me = _i32(win + _RANK).to(tl.int64)
        slot = _i64(_i64(win + _PEER_SIGNALS) + 8 * tl.cast(peer, tl.int64))
        slot = slot + 8 * (tl.cast(signal_id, tl.int64) * n + me)
        v = tl.cast(value, tl.uint64)
        tl.debug_barrier()
        if op == 1:
            if (_i32(win + _FLAGS) & _FAULT_UNORDERED) != 0:
                _leader_add_relaxed(slot, v)
            else:
                _leader_add_release(slot, v)
        else:
            _leader_st_release(slot, v)
        rc = 0
    return rc


@triton.jit
def signal_block(win, peer, signal_id, value):
    """ADD ``value`` (torchcomms' signal_block)."""
    return signal(win, peer, signal_id, 1, value)


@triton.jit
def wait_signal_cmp(win, signal_id, cmp, value):
    """Waits until the sum over senders of ``signal_id`` compares true with ``value``."""
    signal_id = tl.cast(signal_id, tl.int32)
    cmp = tl.cast(cmp, tl.int32)
    n = _i32(win + _NRANKS)
    ok = (signal_id >= 0) & (signal_id < _i32(win + _NSIG)) & (cmp >= 0) & (cmp <= 5)
    rc = tl.cast(-1, tl.int32)
    if ok:
        row = _i64(win + _SIGNALS) + 8 * tl.cast(signal_id, tl.int64) * n
        v64 = tl.cast(value, tl.uint64)
        start = _now_ns()
        done = _compare(cmp, _sum_row(row, n), v64)
        late = done & False
        while (done == 0) & (late == 0):
            done = _compare(cmp, _sum_row(row, n), v64)
            if done == 0:
                late = _timed_out(win, start)
        rc = 0
        if late:
            _report_timeout(win)
            rc = -2
    return rc


@triton.jit
def wait_signal(win, signal_id, expected_value):
    """Waits until the sum over senders of ``signal_id`` is >= ``expected_value``."""
    return wait_signal_cmp(win, signal_id, 5, expected_value)


@triton.jit
def wait_signal_from_cmp(win, peer, signal_id, cmp, value):
    peer = tl.cast(peer, tl.int32)
    signal_id = tl.cast(signal_id, tl.int32)
    cmp = tl.cast(cmp, tl.int32)
    n = _i32(win + _NRANKS)
    ok = (peer >= 0) & (peer < n) & (signal_id >= 0) & (signal_id < _i32(win + _NSIG))
    ok = ok & (cmp >= 0) & (cmp <= 5)
    rc = tl.cast(-1, tl.int32)
    if ok:
        slot = _i64(win + _SIGNALS) + 8 * (
            tl.cast(signal_id, tl.int64) * n + tl.cast(peer, tl.int64)
        )
        rc = _spin_slot(win, slot, cmp, value)
    return rc


@triton.jit
def wait_signal_from(win, peer, signal_id, expected_value):
    """Waits until ``peer``'s slot of ``signal_id`` is >= ``expected_value``."""
    return wait_signal_from_cmp(win, peer, signal_id, 5, expected_value)


@triton.jit
def wait_signal_from_block(win, peer, signal_id, expected_value):
    rc = wait_signal_from_cmp(win, peer, signal_id, 5, expected_value)
    tl.debug_barrier()
    return rc


@triton.jit
def read_signal(win, signal_id):
    """The sum over senders of ``signal_id`` (uint64; 0 out of range)."""
    signal_id = tl.cast(signal_id, tl.int32)
    n = _i32(win + _NRANKS)
    ok = (signal_id >= 0) & (signal_id < _i32(win + _NSIG))
    sid = tl.where(ok, signal_id, 0).to(tl.int64)
    s = _sum_row(_i64(win + _SIGNALS) + 8 * sid * n, n)
    return tl.where(ok, s, 0)


@triton.jit
def reset_signal(win, signal_id):
    """Zeroes every sender's slot of ``signal_id`` here (block scope)."""
    signal_id = tl.cast(signal_id, tl.int32)
    n = _i32(win + _NRANKS)
    if (signal_id >= 0) & (signal_id < _i32(win + _NSIG)):
        row = _i64(win + _SIGNALS) + 8 * tl.cast(signal_id, tl.int64) * n
        tl.debug_barrier()
        for q in range(0, n):
            _leader_st_release(row + 8 * q, 0)
        tl.debug_barrier()
    return 0


# -- counters -------------------------------------------------------------------------------------
@triton.jit
def wait_counter_cmp(win, counter_id, cmp, value):
    counter_id = tl.cast(counter_id, tl.int32)
    cmp = tl.cast(cmp, tl.int32)
    ok = (counter_id >= 0) & (counter_id < _i32(win + _NCNT)) & (cmp >= 0) & (cmp <= 5)
    rc = tl.cast(-1, tl.int32)
    if ok:
        rc = _spin_slot(win, _i64(win + _COUNTERS) + 8 * tl.cast(counter_id, tl.int64), cmp, value)
    return rc


@triton.jit
def wait_counter(win, counter_id, expected_value):
    return wait_counter_cmp(win, counter_id, 5, expected_value)


@triton.jit
def wait_counter_block(win, counter_id, expected_value):
    rc = wait_counter_cmp(win, counter_id, 5, expected_value)
    tl.debug_barrier()
    return rc


@triton.jit
def read_counter(win, counter_id):
    counter_id = tl.cast(counter_id, tl.int32)
    ok = (counter_id >= 0) & (counter_id < _i32(win + _NCNT))
    cid = tl.where(ok, counter_id, 0).to(tl.int64)
    v = _ld_acquire(_i64(win + _COUNTERS) + 8 * cid)
    return tl.where(ok, v, 0)


@triton.jit
def reset_counter(win, counter_id):
    counter_id = tl.cast(counter_id, tl.int32)
    if (counter_id >= 0) & (counter_id < _i32(win + _NCNT)):
        tl.debug_barrier()
        _leader_st_release(_i64(win + _COUNTERS) + 8 * tl.cast(counter_id, tl.int64), 0)
        tl.debug_barrier()
    return 0


# -- synchronization ------------------------------------------------------------------------------
@triton.jit
def fence(win):
    """fence.acq_rel.sys."""
    return _fence_sys()


@triton.jit
def flush_block(win):
    """Local completion: the program's puts are issued (their sources may be reused)."""
    tl.debug_barrier()
    return 0


@triton.jit
def barrier_block(win, barrier_id):
    """Every rank reaches barrier ``barrier_id`` (NOTE [device barrier epochs])."""
    barrier_id = tl.cast(barrier_id, tl.int32)
    n = _i32(win + _NRANKS)
    rc = tl.cast(-1, tl.int32)
    if (barrier_id >= 0) & (barrier_id < _i32(win + _NBAR)):
        me = _i32(win + _RANK).to(tl.int64)
        bid = tl.cast(barrier_id, tl.int64)
        epoch_addr = _i64(win + _EPOCHS) + 8 * bid
        tl.debug_barrier()
        epoch = _ld_acquire(epoch_addr) + 1  # not through L1: the leader wrote it last time
        tl.debug_barrier()  # every thread read the old epoch before the leader replaces it
        _leader_st_release(epoch_addr, epoch)
        peers = _i64(win + _PEER_BARRIERS)
        for q in range(0, n):
            _leader_st_release(_i64(peers + 8 * q) + 8 * (bid * n + me), epoch)
        row = _i64(win + _BARRIERS) + 8 * bid * n
        rc = 0
        for q in range(0, n):
            r = _spin_slot(win, row + 8 * q, 5, epoch)
            rc = tl.where(r != 0, r, rc)
        tl.debug_barrier()
    return rc


# -- the device transport (comm.get_device_transport(); NOTE [device transport ids]) ---------------
# torchcomms' transport CmpOp numbering: 0=EQ, 1=GT, 2=LT, 3=GE, 4=LE, 5=NE.
@triton.jit
def _transport_cmp(op):
    op = tl.cast(op, tl.int32)
    return tl.where(
        op == 0,
        0,
        tl.where(
            op == 1,
            4,
            tl.where(
                op == 2, 2, tl.where(op == 3, 5, tl.where(op == 4, 3, tl.where(op == 5, 1, -1)))
            ),
        ),
    )


@triton.jit
def _transport_slot(handle):
    return (size(handle) // tl.cast(num_ranks(handle), tl.int64)) // 16 * 16


@triton.jit
def _transport_ok(handle, peer):
    n = num_ranks(handle)
    ok = (peer >= 0) & (peer < n) & (peer != rank(handle)) & (_transport_slot(handle) > 0)
    return ok & (_i32(handle + _NSIG) >= 2 * n + 2) & (_i32(handle + _NCNT) >= 2 * n + n * n)


@triton.jit
def transport_signal(handle, peer, signal_id, op, value):
    """SET (0) / ADD (1) on the caller's signal ids [0, n) at ``peer`` (block scope)."""
    signal_id = tl.cast(signal_id, tl.int32)
    ok = (signal_id >= 0) & (signal_id < num_ranks(handle))
    rc = tl.cast(-1, tl.int32)
    if ok:
        rc = signal(handle, peer, signal_id, op, value)
    return rc


@triton.jit
def transport_wait_signal(handle, peer, signal_id, op, value):
    """Waits for ``peer``'s slot of the caller's ``signal_id`` (torchcomms' compare numbering)."""
    signal_id = tl.cast(signal_id, tl.int32)
    ok = (signal_id >= 0) & (signal_id < num_ranks(handle))
    rc = tl.cast(-1, tl.int32)
    if ok:
        rc = wait_signal_from_cmp(handle, peer, signal_id, _transport_cmp(op), value)
        tl.debug_barrier()
    return rc


@triton.jit
def transport_send(handle, peer, src_ptr, nbytes, max_signal_bytes):
    """Sends ``nbytes`` from ``src_ptr`` to ``peer`` (which calls transport_recv with the same
    size) through this rank's staging slot in the peer's window, one slot-sized chunk per signal
    (``max_signal_bytes`` is accepted; the slot decides). Block scope; peer != rank."""
    peer = tl.cast(peer, tl.int32)
    nbytes = tl.cast(nbytes, tl.int64)
    src = tl.cast(src_ptr, tl.int64)
    rc = tl.cast(-1, tl.int32)
    if _transport_ok(handle, peer):
        n = num_ranks(handle)
        slot = _transport_slot(handle)
        cnt = _i64(handle + _COUNTERS) + 8 * tl.cast(peer, tl.int64)
        base = tl.cast(_ld_acquire(cnt), tl.int64)
        chunks = (nbytes + slot - 1) // slot
        dst = _i64(_i64(handle + _PEER_BASES) + 8 * tl.cast(peer, tl.int64))
        dst = dst + slot * tl.cast(rank(handle), tl.int64)
        rc = tl.cast(0, tl.int32)
        for k in range(0, chunks):
            if rc == 0:
                r1 = wait_signal_from_cmp(handle, peer, n + 1, 5, base + k)  # the slot is free
                tl.debug_barrier()
                if r1 == 0:
                    off = k * slot
                    _copy(dst, src + off, tl.minimum(nbytes - off, slot))
                    r1 = signal(handle, peer, n, 1, 1)  # landed (joins, then release)
                rc = r1
        tl.debug_barrier()
        if rc == 0:
            _leader_st_release(cnt, base + chunks)
        tl.debug_barrier()
    return rc


@triton.jit
def transport_recv(handle, peer, dst_ptr, nbytes, max_signal_bytes):
    """Receives ``nbytes`` from ``peer`` into ``dst_ptr`` (block scope)."""
    peer = tl.cast(peer, tl.int32)
    nbytes = tl.cast(nbytes, tl.int64)
    dst = tl.cast(dst_ptr, tl.int64)
    rc = tl.cast(-1, tl.int32)
    if _transport_ok(handle, peer):
        n = num_ranks(handle)
        slot = _transport_slot(handle)
        cnt = _i64(handle + _COUNTERS) + 8 * tl.cast(n + peer, tl.int64)
        base = tl.cast(_ld_acquire(cnt), tl.int64)
        chunks = (nbytes + slot - 1) // slot
        src = _i64(handle + _BASE) + slot * tl.cast(peer, tl.int64)
        rc = tl.cast(0, tl.int32)
        for k in range(0, chunks):
            if rc == 0:
                r1 = wait_signal_from_cmp(handle, peer, n, 5, base + k + 1)  # landed
                tl.debug_barrier()
                if r1 == 0:
                    off = k * slot
                    _copy(dst + off, src, tl.minimum(nbytes - off, slot))
                    r1 = signal(handle, peer, n + 1, 1, 1)  # free, after the block's loads
                rc = r1
        tl.debug_barrier()
        if rc == 0:
            _leader_st_release(cnt, base + chunks)
        tl.debug_barrier()
    return rc


@triton.jit
def transport_barrier(handle, peer, barrier_id):
    """The pairwise barrier ``barrier_id`` (< n) with ``peer`` (block scope)."""
    peer = tl.cast(peer, tl.int32)
    barrier_id = tl.cast(barrier_id, tl.int32)
    n = num_ranks(handle)
    rc = tl.cast(-1, tl.int32)
    if _transport_ok(handle, peer) & (barrier_id >= 0) & (barrier_id < n):
        cnt = _i64(handle + _COUNTERS) + 8 * tl.cast(2 * n + barrier_id * n + peer, tl.int64)
        nxt = _ld_acquire(cnt) + 1
        rc = signal(handle, peer, n + 2 + barrier_id, 1, 1)
        if rc == 0:
            rc = wait_signal_from_cmp(handle, peer, n + 2 + barrier_id, 5, nxt)
        tl.debug_barrier()
        if rc == 0:
            _leader_st_release(cnt, nxt)
        tl.debug_barrier()
    return rc


@triton.jit
def transport_my_rank(handle):
    return rank(handle)


@triton.jit
def transport_n_ranks(handle):
    return num_ranks(handle)


@triton.jit
def transport_num_nvl_peers(handle):
    return num_ranks(handle) - 1


@triton.jit
def transport_get_type(handle, r):
    """0 SELF, 1 P2P_NVL (every other rank: CUDA IPC on one host), -1 out of range."""
    r = tl.cast(r, tl.int32)
    n = num_ranks(handle)
    return tl.where((r < 0) | (r >= n), -1, tl.where(r == rank(handle), 0, 1))
