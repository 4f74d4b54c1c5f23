// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// torchcomms' device transport (`TorchComm.get_device_transport()`, its Triton
/// `torchcomms_transport_*` calls) over a DeviceWindow the communicator makes for itself: block-
/// cooperative send/recv through a staging slot per sender in the receiver's window, signals
/// and a pairwise barrier. Header-only; include it from a .cu file.
///
/// NOTE [device transport ids]: with n ranks the handle has 2n + 2 signal ids and 2n + n*n
/// counters. Signal ids [0, n) are the caller's (transport_signal / transport_wait_signal);
/// n is "chunk landed" (sender -> receiver), n + 1 "slot free" (receiver -> sender), n + 2 + id
/// the pairwise barrier `id` (id < n). Counters [0, n) count chunks sent to each peer, [n, 2n)
/// chunks received from each, [2n + id * n + peer] pairwise barrier passes; all live in device
/// memory, so calls and kernels chain without a host reset. A sender writes chunk k into its
/// slot of the receiver's window only after the receiver acknowledged chunk k - 1 (one slot per
/// direction), signalling with release after the block's stores; the receiver copies out after
/// the acquire and acknowledges after its loads (the acknowledgement's release orders them).
/// One block per (sender, receiver) pair at a time; peer != rank.

#include "fastcomms/device/window.hpp"

#if defined(__CUDACC__)
namespace fastcomms::device {

/// torchcomms' transport compare numbering (0 EQ, 1 GT, 2 LT, 3 GE, 4 LE, 5 NE) as CmpOp.
FASTCOMMS_DEVICE_FN CmpOp transport_cmp(int op) {
  constexpr CmpOp m[6] = {CmpOp::EQ, CmpOp::GT, CmpOp::LT, CmpOp::GE, CmpOp::LE, CmpOp::NE};
  return op >= 0 && op < 6 ? m[op] : static_cast<CmpOp>(-1);
}

namespace detail {
// Bytes of one sender's staging slot: the window split among the ranks, 16-byte aligned.
FASTCOMMS_DEVICE_FN size_t transport_slot(const DeviceWindow& w) {
  return (w.size_ / static_cast<size_t>(w.num_ranks_)) & ~static_cast<size_t>(15);
}
FASTCOMMS_DEVICE_FN bool transport_ok(const DeviceWindow& w, int peer) {
  const int n = w.num_ranks_;
  return peer >= 0 && peer < n && peer != w.rank_ && w.signal_count_ >= 2 * n + 2 &&
         w.counter_count_ >= 2 * n + n * n && transport_slot(w) > 0;
}
}  // namespace detail

/// Sends `nbytes` from `src` (this device's memory) to `peer`, which calls transport_recv with
/// the same size. Every thread of the block calls. 0, -1 (refused), -2 (timed out).
FASTCOMMS_DEVICE_FN int transport_send(DeviceWindow& w, int peer, const void* src,
                                       uint64_t nbytes) {
  const detail::Group g{CoopScope::BLOCK};
  if (!detail::transport_ok(w, peer)) return kDeviceInvalid;
  const int n = w.num_ranks_;
  const size_t slot = detail::transport_slot(w);
  const uint64_t base = ptx::ld_acquire_sys(w.counters_ + peer);
  const uint64_t chunks = (nbytes + slot - 1) / slot;
  char* dst = static_cast<char*>(w.peer_bases_[peer]) + slot * w.rank_;
  int rc = kDeviceOk;
  for (uint64_t k = 0; k < chunks && rc == kDeviceOk; ++k) {
    const uint64_t seq = base + k;
    rc = w.wait_signal_from(peer, n + 1, CmpOp::GE, seq, CoopScope::BLOCK);  // slot free
    if (rc != kDeviceOk) break;
    const uint64_t off = k * slot;
    const size_t len = static_cast<size_t>(nbytes - off < slot ? nbytes - off : slot);
    detail::copy(dst, static_cast<const char*>(src) + off, len, g);
    rc = w.signal(peer, n, SignalOp::ADD, 1, CoopScope::BLOCK);  // chunk landed (release)
  }
  g.sync();
  if (g.leader() && rc == kDeviceOk) ptx::st_release_sys(w.counters_ + peer, base + chunks);
  g.sync();
  return rc;
}

/// Receives `nbytes` from `peer` into `dst` (this device's memory). Every thread of the block.
FASTCOMMS_DEVICE_FN int transport_recv(DeviceWindow& w, int peer, void* dst, uint64_t nbytes) {
  const detail::Group g{CoopScope::BLOCK};
  if (!detail::transport_ok(w, peer)) return kDeviceInvalid;
  const int n = w.num_ranks_;
  const size_t slot = detail::transport_slot(w);
  const uint64_t base = ptx::ld_acquire_sys(w.counters_ + n + peer);
  const uint64_t chunks = (nbytes + slot - 1) / slot;
  const char* src = static_cast<const char*>(w.base_) + slot * peer;
  int rc = kDeviceOk;
  for (uint64_t k = 0; k < chunks && rc == kDeviceOk; ++k) {
    rc = w.wait_signal_from(peer, n, CmpOp::GE, base + k + 1, CoopScope::BLOCK);  // landed
    if (rc != kDeviceOk) break;
    const uint64_t off = k * slot;
    const size_t len = static_cast<size_t>(nbytes - off < slot ? nbytes - off : slot);
    detail::copy(static_cast<char*>(dst) + off, src, len, g);
    rc = w.signal(peer, n + 1, SignalOp::ADD, 1, CoopScope::BLOCK);  // slot free, after our loads
  }
  g.sync();
  if (g.leader() && rc == kDeviceOk) ptx::st_release_sys(w.counters_ + n + peer, base + chunks);
  g.sync();
  return rc;
}

/// torchcomms' transport signal: `op` 0 SET, 1 ADD, on the caller's ids [0, n). Block scope.
FASTCOMMS_DEVICE_FN int transport_signal(DeviceWindow& w, int peer, int signal_id, int op,
                                         uint64_t value) {
  if (signal_id < 0 || signal_id >= w.num_ranks_) return kDeviceInvalid;
  return w.signal(peer, signal_id, static_cast<SignalOp>(op), value, CoopScope::BLOCK);
}

/// torchcomms' transport wait: `peer`'s slot of the caller's `signal_id`, its compare numbering.
FASTCOMMS_DEVICE_FN int transport_wait_signal(DeviceWindow& w, int peer, int signal_id, int op,
                                              uint64_t value) {
  if (signal_id < 0 || signal_id >= w.num_ranks_) return kDeviceInvalid;
  return w.wait_signal_from(peer, signal_id, transport_cmp(op), value, CoopScope::BLOCK);
}

/// The pairwise barrier `barrier_id` (< n) with `peer`: both pass once both arrived.
FASTCOMMS_DEVICE_FN int transport_barrier(DeviceWindow& w, int peer, int barrier_id) {
  const detail::Group g{CoopScope::BLOCK};
  const int n = w.num_ranks_;
  if (!detail::transport_ok(w, peer) || barrier_id < 0 || barrier_id >= n) return kDeviceInvalid;
  uint64_t* count = w.counters_ + 2 * n + static_cast<size_t>(barrier_id) * n + peer;
  const uint64_t next = ptx::ld_acquire_sys(count) + 1;
  int rc = w.signal(peer, n + 2 + barrier_id, SignalOp::ADD, 1, CoopScope::BLOCK);
  if (rc == kDeviceOk)
    rc = w.wait_signal_from(peer, n + 2 + barrier_id, CmpOp::GE, next, CoopScope::BLOCK);
  g.sync();
  if (g.leader() && rc == kDeviceOk) ptx::st_release_sys(count, next);
  g.sync();
  return rc;
}

FASTCOMMS_DEVICE_FN int transport_my_rank(const DeviceWindow& w) { return w.rank_; }
FASTCOMMS_DEVICE_FN int transport_n_ranks(const DeviceWindow& w) { return w.num_ranks_; }
/// Every other rank is reached through CUDA IPC loads and stores.
FASTCOMMS_DEVICE_FN int transport_num_nvl_peers(const DeviceWindow& w) { return w.num_ranks_ - 1; }
/// 0 SELF, 1 P2P_NVL (every other rank), -1 out of range (torchcomms' TransportType values).
FASTCOMMS_DEVICE_FN int transport_get_type(const DeviceWindow& w, int rank) {
  return rank < 0 || rank >= w.num_ranks_ ? -1 : rank == w.rank_ ? 0 : 1;
}

}  // namespace fastcomms::device
#endif
