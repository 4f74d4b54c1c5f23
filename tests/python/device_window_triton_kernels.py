# Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
"""Triton kernels of test_device_window_gpu.py: every fastcomms.triton call, the same checks as
the CUDA kernels of tests/gpu/device_window_kernels.cu (a program is the block scope)."""

import fastcomms.triton as fct
import triton
import triton.language as tl


@triton.jit
def tk_exchange(win, src, out, chunk, expect, rc):
    """Every program puts its chunk of src into every rank's window (itself included) at
    rank * total + pid * chunk, with signal 0 and counter 0; waits for `expect` signals and
    counts; then copies its share of the window to out right after the acquire."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    r = fct.rank(win)
    n = fct.num_ranks(win)
    total = tl.cast(programs, tl.int64) * chunk
    bad = tl.cast(0, tl.int32)
    for q in range(0, n):
        d = (r + q) % n
        bad |= fct.put_block(win, r * total + pid * chunk, src, pid * chunk, d, chunk, 0, 0)
    bad |= fct.wait_signal(win, 0, expect)
    bad |= fct.wait_counter_block(win, 0, expect)
    base = fct.base(win).to(tl.pointer_type(tl.int8))
    o = out.to(tl.pointer_type(tl.int8))
    nbytes = n * total
    share = tl.cdiv(nbytes, programs)
    lo = pid * share
    for i in range(0, share, 1024):
        offs = lo + i + tl.arange(0, 1024)
        m = (offs < nbytes) & (offs < lo + share)
        tl.store(o + offs, tl.load(base + offs, mask=m), mask=m)
    if bad != 0:
        tl.atomic_or(rc, 1)


@triton.jit
def tk_barrier(win, barrier_id, rc):
    if fct.barrier_block(win, barrier_id) != 0:
        tl.atomic_or(rc, 2)


@triton.jit
def tk_calls(win, src, out, rnd):
    """One program: metadata, refusals, SET/ADD with every compare op, read/reset, stores through
    get_nvlink_address, counters, fence, flush, barrier (out is int64[64], as the CUDA test)."""
    r = fct.rank(win)
    n = fct.num_ranks(win)
    tl.store(out + 0, r.to(tl.int64))
    tl.store(out + 1, n.to(tl.int64))
    tl.store(out + 2, fct.base(win))
    tl.store(out + 3, fct.size(win))
    tl.store(out + 4, fct.get_multimem_address(win, 0))
    tl.store(out + 5, fct.get_nvlink_address(win, n))
    for q in range(0, n):
        tl.store(out + 8 + q, fct.get_nvlink_address(win, q))
    refused = tl.cast(0, tl.int64)
    refused += fct.put_block(win, 0, src, 0, n, 8, -1, -1) == -1
    refused += fct.put_block(win, fct.size(win) - 4, src, 0, r, 8, -1, -1) == -1
    refused += fct.put_block(win, 0, src, 1 << 40, r, 8, -1, -1) == -1
    refused += fct.signal(win, r, 1 << 20, 1, 1) == -1
    refused += fct.signal(win, -1, 1, 1, 1) == -1
    refused += fct.wait_signal_cmp(win, 1, 9, 0) == -1
    refused += fct.wait_signal_from(win, n, 1, 0) == -1
    refused += fct.wait_counter(win, 1 << 20, 0) == -1
    refused += fct.barrier_block(win, 1 << 20) == -1
    tl.store(out + 6, refused)
    rc = tl.cast(0, tl.int32)
    for q in range(0, n):
        rc |= fct.signal(win, q, 1, fct.SIGNAL_SET, (r + 1) * 10)
        rc |= fct.signal(win, q, 2, fct.SIGNAL_ADD, r + 1)
        rc |= fct.signal_block(win, q, 2, r + 1)
    set_sum = 5 * n * (n + 1)
    add_sum = n * (n + 1)
    rc |= fct.wait_signal_cmp(win, 1, fct.CMP_EQ, set_sum)
    rc |= fct.wait_signal(win, 2, add_sum)
    for q in range(0, n):
        v = (q + 1) * 10
        rc |= fct.wait_signal_from_cmp(win, q, 1, fct.CMP_EQ, v)
        rc |= fct.wait_signal_from_cmp(win, q, 1, fct.CMP_NE, v + 1)
        rc |= fct.wait_signal_from_cmp(win, q, 1, fct.CMP_LT, v + 1)
        rc |= fct.wait_signal_from_cmp(win, q, 1, fct.CMP_LE, v)
        rc |= fct.wait_signal_from_cmp(win, q, 1, fct.CMP_GT, v - 1)
        rc |= fct.wait_signal_from_block(win, q, 1, v)
    rc |= fct.wait_signal_cmp(win, 2, fct.CMP_LE, add_sum)
    rc |= fct.wait_signal_cmp(win, 2, fct.CMP_GT, add_sum - 1)
    rc |= fct.wait_signal_cmp(win, 2, fct.CMP_LT, add_sum + 1)
    rc |= fct.wait_signal_cmp(win, 2, fct.CMP_NE, 0)
    tl.store(out + 20, fct.read_signal(win, 1).to(tl.int64))
    tl.store(out + 21, fct.read_signal(win, 2).to(tl.int64))
    tl.store(out + 22, fct.read_signal(win, 1 << 20).to(tl.int64))
    rc |= fct.barrier_block(win, 0)
    fct.reset_signal(win, 1)
    fct.reset_signal(win, 2)
    tl.store(out + 23, fct.read_signal(win, 1).to(tl.int64))
    tl.store(out + 24, fct.read_signal(win, 2).to(tl.int64))
    nxt = (r + 1) % n
    prev = (r + n - 1) % n
    offs = tl.arange(0, 256)
    peer = fct.get_nvlink_address(win, nxt).to(tl.pointer_type(tl.int64))
    tl.store(peer + offs, r.to(tl.int64) * 1000000 + offs + 7 * rnd)
    rc |= fct.fence(win)
    rc |= fct.signal_block(win, nxt, 3, 1)
    rc |= fct.wait_signal_from_block(win, prev, 3, rnd)
    mine = fct.base(win).to(tl.pointer_type(tl.int64))
    got = tl.load(mine + offs)
    wrong = tl.sum((got != prev.to(tl.int64) * 1000000 + offs + 7 * rnd).to(tl.int64), axis=0)
    tl.store(out + 25, wrong)
    rc |= fct.barrier_block(win, 0)
    fct.reset_counter(win, 1)
    rc |= fct.put_block(win, 2048, src, 0, nxt, 64, -1, 1)
    rc |= fct.wait_counter_block(win, 1, 1)
    tl.store(out + 26, fct.read_counter(win, 1).to(tl.int64))
    fct.reset_counter(win, 1)
    tl.store(out + 27, fct.read_counter(win, 1).to(tl.int64))
    rc |= fct.flush_block(win)
    rc |= fct.barrier_block(win, 0)
    tl.store(out + 7, rc.to(tl.int64))
    # the transport view of the same handle
    tl.store(out + 28, fct.transport_my_rank(win).to(tl.int64))
    tl.store(out + 29, fct.transport_n_ranks(win).to(tl.int64))
    tl.store(out + 30, fct.transport_get_type(win, r).to(tl.int64))
    tl.store(out + 31, fct.transport_get_type(win, nxt).to(tl.int64))


@triton.jit
def tk_contention(win, src, peer, reps, expect_signals, expect_counter, rc):
    """Every program ADDs 1 to signal 4 at `peer` and puts 16 bytes to itself with counter 2,
    `reps` times; program 0 waits for the exact totals (EQ)."""
    pid = tl.program_id(0)
    bad = tl.cast(0, tl.int32)
    off = (pid.to(tl.int64) * 16) % (fct.size(win) - 16)
    for _ in range(0, reps):
        bad |= fct.signal_block(win, peer, 4, 1)
        bad |= fct.put_block(win, off, src, 0, fct.rank(win), 16, -1, 2)
    if pid == 0:
        bad |= fct.wait_signal_cmp(win, 4, fct.CMP_EQ, expect_signals)
        bad |= fct.wait_counter_cmp(win, 2, fct.CMP_EQ, expect_counter)
    if bad != 0:
        tl.atomic_or(rc, 1)


@triton.jit
def tk_ordering(win, src, sender, receiver, nbytes, rnd, seed, wrong, rc):
    """The ordering check and its armed control (as ordering_kernel in CUDA)."""
    r = fct.rank(win)
    bad = tl.cast(0, tl.int32)
    if r == sender:
        bad |= fct.wait_signal_from_block(win, receiver, 6, rnd)
        bad |= fct.put_block(win, 0, src, 0, receiver, nbytes, 5, -1)
    if r == receiver:
        bad |= fct.signal_block(win, sender, 6, 1)
        bad |= fct.wait_signal_from_block(win, sender, 5, rnd)
        p = fct.base(win).to(tl.pointer_type(tl.uint8))
        count = tl.cast(0, tl.int64)
        for i in range(0, nbytes, 4096):
            j = nbytes - 1 - (i + tl.arange(0, 4096))
            m = j >= 0
            want = ((j * 7 + seed) & 255).to(tl.uint8)
            count += tl.sum(((tl.load(p + j, mask=m) != want) & m).to(tl.int64), axis=0)
        tl.atomic_add(wrong, count)
    if bad != 0:
        tl.atomic_or(rc, 1)


@triton.jit
def tk_transport(handle, src, dst, nbytes, rc):
    """Ranks pair up (0-1, 2-3, ...): the even one sends then receives, the odd one receives then
    sends, through the transport's staging slots; then a pairwise barrier, a user signal and its
    wait, and the properties (out-of-pair ranks only check the properties)."""
    r = fct.transport_my_rank(handle)
    n = fct.transport_n_ranks(handle)
    peer = tl.where(r % 2 == 0, r + 1, r - 1)
    bad = tl.cast(0, tl.int32)
    if peer < n:
        if r % 2 == 0:
            bad |= fct.transport_send(handle, peer, src, nbytes, 0)
            bad |= fct.transport_recv(handle, peer, dst, nbytes, 0)
        else:
            bad |= fct.transport_recv(handle, peer, dst, nbytes, 0)
            bad |= fct.transport_send(handle, peer, src, nbytes, 0)
        bad |= fct.transport_barrier(handle, peer, 0)
        bad |= fct.transport_signal(handle, peer, 0, fct.SIGNAL_ADD, 1)
        bad |= fct.transport_wait_signal(
            handle, peer, 0, 3, 1
        )  # 3: GE in the transport's numbering
        bad |= (fct.transport_get_type(handle, peer) != 1).to(tl.int32) * 8
    bad |= (fct.transport_get_type(handle, r) != 0).to(tl.int32) * 16
    bad |= (fct.transport_num_nvl_peers(handle) != n - 1).to(tl.int32) * 32
    bad |= (fct.transport_send(handle, r, src, nbytes, 0) != -1).to(tl.int32) * 64  # self: refused
    if bad != 0:
        tl.atomic_or(rc, bad)
