// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The device methods of fastcomms::device::DeviceWindow (included by window.hpp under nvcc;
/// NOTE [device window ordering] there says which PTX gives which guarantee).

#ifndef __CUDACC__
#error "fastcomms/device/window_impl.cuh is device code: include fastcomms/device/window.hpp"
#endif

#include <cstddef>
#include <cstdint>

namespace fastcomms::device {
namespace ptx {

FASTCOMMS_DEVICE_FN uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
FASTCOMMS_DEVICE_FN void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
FASTCOMMS_DEVICE_FN void add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
FASTCOMMS_DEVICE_FN void add_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.relaxed.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
FASTCOMMS_DEVICE_FN void add_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
FASTCOMMS_DEVICE_FN void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
FASTCOMMS_DEVICE_FN uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

}  // namespace ptx

namespace detail {

// The threads of one scope: how many, this thread's place, the leader, and the join.
struct Group {
  CoopScope scope;
  FASTCOMMS_DEVICE_FN unsigned rank() const {
    const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    return scope == CoopScope::BLOCK ? t : scope == CoopScope::WARP ? (t & 31u) : 0u;
  }
  FASTCOMMS_DEVICE_FN unsigned size() const {
    return scope == CoopScope::BLOCK  ? blockDim.x * blockDim.y * blockDim.z
           : scope == CoopScope::WARP ? 32u
                                      : 1u;
  }
  FASTCOMMS_DEVICE_FN bool leader() const { return rank() == 0; }
  FASTCOMMS_DEVICE_FN void sync() const {
    if (scope == CoopScope::BLOCK) __syncthreads();
    if (scope == CoopScope::WARP) __syncwarp();
  }
  // The leader's `v` in every thread of the group (a join included).
  FASTCOMMS_DEVICE_FN int broadcast(int v) const {
    if (scope == CoopScope::WARP) return __shfl_sync(0xffffffffu, v, 0);
    if (scope == CoopScope::BLOCK) {
      __shared__ int slot;
      __syncthreads();
      if (leader()) slot = v;
      __syncthreads();
      return slot;
    }
    return v;
  }
};

FASTCOMMS_DEVICE_FN bool compare(CmpOp cmp, uint64_t lhs, uint64_t rhs) {
  switch (cmp) {
    case CmpOp::EQ:
      return lhs == rhs;
    case CmpOp::NE:
      return lhs != rhs;
    case CmpOp::LT:
      return lhs < rhs;
    case CmpOp::LE:
      return lhs <= rhs;
    case CmpOp::GT:
      return lhs > rhs;
    case CmpOp::GE:
      return lhs >= rhs;
  }
  return false;
}

FASTCOMMS_DEVICE_FN bool valid_cmp(CmpOp cmp) {
  return static_cast<int>(cmp) >= 0 && static_cast<int>(cmp) <= 5;
}

// Copies `bytes` by the group's threads: 16-byte vectors where both sides allow, else bytes.
FASTCOMMS_DEVICE_FN void copy(char* dst, const char* src, size_t bytes, const Group& g) {
  const unsigned r = g.rank(), n = g.size();
  const bool aligned =
      ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) == 0;
  size_t done = 0;
  if (aligned) {
    const size_t vecs = bytes / 16;
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* s = reinterpret_cast<const uint4*>(src);
    for (size_t i = r; i < vecs; i += n) d[i] = s[i];
    done = vecs * 16;
  }
  for (size_t i = done + r; i < bytes; i += n) dst[i] = src[i];
}

// A leader's spin with acquire loads until `cmp` holds for `read()`; false on a timeout (which
// sets the host-mapped error word).
template <typename Read>
FASTCOMMS_DEVICE_FN bool spin(const DeviceWindow& w, CmpOp cmp, uint64_t value, Read read) {
  const uint64_t start = w.timeout_ns_ ? ptx::now_ns() : 0;
  while (!compare(cmp, read(), value)) {
    if (w.timeout_ns_ && ptx::now_ns() - start > w.timeout_ns_) {
      if (w.error_) atomicExch(w.error_, 2);  // kBarrierTimeout (fastcomms/cuda/barrier.hpp)
      return false;
    }
  }
  return true;
}

}  // namespace detail

// NOTE [device window ordering] (window.hpp): the join, then a release by the leader.
FASTCOMMS_DEVICE_FN int DeviceWindow::signal(int peer, int signal_id, SignalOp op, uint64_t value,
                                             CoopScope scope) {
  const detail::Group g{scope};
  if (peer < 0 || peer >= num_ranks_ || signal_id < 0 || signal_id >= signal_count_ ||
      (op != SignalOp::ADD && op != SignalOp::SET))
    return kDeviceInvalid;
  g.sync();
  if (g.leader()) {
    uint64_t* slot = peer_signals_[peer] + static_cast<size_t>(signal_id) * num_ranks_ + rank_;
    if (op == SignalOp::ADD) {
      if (flags_ & kFaultUnorderedSignal)
        ptx::add_relaxed_sys(slot, value);
      else
        ptx::add_release_sys(slot, value);
    } else {
      ptx::st_release_sys(slot, value);
    }
  }
  return kDeviceOk;
}

FASTCOMMS_DEVICE_FN int DeviceWindow::put(size_t dst_offset, const RegisteredBuffer& src_buf,
                                          size_t src_offset, int dst_rank, size_t bytes,
                                          int signal_id, int counter_id, CoopScope scope) {
  const detail::Group g{scope};
  // Refused rather than written past: a peer's buffer, or the source, is never overrun.
  if (dst_rank < 0 || dst_rank >= num_ranks_ || src_buf.base_ptr == nullptr || dst_offset > size_ ||
      bytes > size_ - dst_offset || src_offset > src_buf.size ||
      bytes > src_buf.size - src_offset || signal_id >= signal_count_ ||
      counter_id >= counter_count_)
    return kDeviceInvalid;
  const bool unordered = (flags_ & kFaultUnorderedSignal) != 0 && signal_id >= 0;
  if (unordered && g.leader()) {  // the test control: a signal that overtakes the data
    ptx::add_relaxed_sys(
        peer_signals_[dst_rank] + static_cast<size_t>(signal_id) * num_ranks_ + rank_, 1);
  }
  detail::copy(static_cast<char*>(peer_bases_[dst_rank]) + dst_offset,
               static_cast<const char*>(src_buf.base_ptr) + src_offset, bytes, g);
  if (signal_id >= 0 && !unordered) signal(dst_rank, signal_id, SignalOp::ADD, 1, scope);
  if (counter_id >= 0) {
    g.sync();
    if (g.leader()) ptx::add_release_gpu(counters_ + counter_id, 1);
  }
  return kDeviceOk;
}

FASTCOMMS_DEVICE_FN int DeviceWindow::wait_signal(int signal_id, CmpOp cmp, uint64_t value,
                                                  CoopScope scope) {
  const detail::Group g{scope};
  if (signal_id < 0 || signal_id >= signal_count_ || !detail::valid_cmp(cmp)) return kDeviceInvalid;
  int rc = kDeviceOk;
  if (g.leader()) {
    const uint64_t* base = signals_ + static_cast<size_t>(signal_id) * num_ranks_;
    const int n = num_ranks_;
    if (!detail::spin(*this, cmp, value, [&] {
          uint64_t sum = 0;
          for (int q = 0; q < n; ++q) sum += ptx::ld_acquire_sys(base + q);
          return sum;
        }))
      rc = kDeviceTimeout;
  }
  return g.broadcast(rc);
}

FASTCOMMS_DEVICE_FN int DeviceWindow::wait_signal_from(int peer, int signal_id, CmpOp cmp,
                                                       uint64_t value, CoopScope scope) {
  const detail::Group g{scope};
  if (peer < 0 || peer >= num_ranks_ || signal_id < 0 || signal_id >= signal_count_ ||
      !detail::valid_cmp(cmp))
    return kDeviceInvalid;
  int rc = kDeviceOk;
  if (g.leader()) {
    const uint64_t* slot = signals_ + static_cast<size_t>(signal_id) * num_ranks_ + peer;
    if (!detail::spin(*this, cmp, value, [&] { return ptx::ld_acquire_sys(slot); }))
      rc = kDeviceTimeout;
  }
  return g.broadcast(rc);
}

FASTCOMMS_DEVICE_FN uint64_t DeviceWindow::read_signal(int signal_id) const {
  if (signal_id < 0 || signal_id >= signal_count_) return 0;
  const uint64_t* base = signals_ + static_cast<size_t>(signal_id) * num_ranks_;
  uint64_t sum = 0;
  for (int q = 0; q < num_ranks_; ++q) sum += ptx::ld_acquire_sys(base + q);
  return sum;
}

FASTCOMMS_DEVICE_FN void DeviceWindow::reset_signal(int signal_id, CoopScope scope) {
  const detail::Group g{scope};
  if (signal_id < 0 || signal_id >= signal_count_) return;
  g.sync();
  if (g.leader()) {
    uint64_t* base = signals_ + static_cast<size_t>(signal_id) * num_ranks_;
    for (int q = 0; q < num_ranks_; ++q) ptx::st_release_sys(base + q, 0);
  }
  g.sync();
}

FASTCOMMS_DEVICE_FN int DeviceWindow::wait_counter(int counter_id, CmpOp cmp, uint64_t value,
                                                   CoopScope scope) {
  const detail::Group g{scope};
  if (counter_id < 0 || counter_id >= counter_count_ || !detail::valid_cmp(cmp))
    return kDeviceInvalid;
  int rc = kDeviceOk;
  if (g.leader()) {
    const uint64_t* c = counters_ + counter_id;
    if (!detail::spin(*this, cmp, value, [&] { return ptx::ld_acquire_sys(c); }))
      rc = kDeviceTimeout;
  }
  return g.broadcast(rc);
}

FASTCOMMS_DEVICE_FN uint64_t DeviceWindow::read_counter(int counter_id) const {
  if (counter_id < 0 || counter_id >= counter_count_) return 0;
  return ptx::ld_acquire_sys(counters_ + counter_id);
}

FASTCOMMS_DEVICE_FN void DeviceWindow::reset_counter(int counter_id, CoopScope scope) {
  const detail::Group g{scope};
  if (counter_id < 0 || counter_id >= counter_count_) return;
  g.sync();
  if (g.leader()) ptx::st_release_sys(counters_ + counter_id, 0);
  g.sync();
}

FASTCOMMS_DEVICE_FN int DeviceWindow::fence() {
  ptx::fence_acq_rel_sys();
  return kDeviceOk;
}

FASTCOMMS_DEVICE_FN int DeviceWindow::flush(CoopScope scope) {
  // Puts are the group's own stores: once every thread has passed the join they are issued and
  // the sources are free (visibility at the peer is signal()'s job).
  detail::Group{scope}.sync();
  return kDeviceOk;
}

// NOTE [device barrier epochs]: barrier_epochs_[id] counts this rank's passes through barrier
// `id` in device memory, so it survives across kernels and CUDA graph replays; each pass
// publishes the new epoch into every rank's slot (this rank's column) with st.release.sys and
// waits for every rank's epoch with ld.acquire.sys. Only the leader of one group per rank may
// use an id at a time (as with NCCL's LSA barriers).
FASTCOMMS_DEVICE_FN int DeviceWindow::barrier(int barrier_id, CoopScope scope) {
  const detail::Group g{scope};
  if (barrier_id < 0 || barrier_id >= barrier_count_) return kDeviceInvalid;
  g.sync();
  int rc = kDeviceOk;
  if (g.leader()) {
    const uint64_t epoch = barrier_epochs_[barrier_id] + 1;
    barrier_epochs_[barrier_id] = epoch;
    const size_t row = static_cast<size_t>(barrier_id) * num_ranks_;
    for (int q = 0; q < num_ranks_; ++q)
      ptx::st_release_sys(peer_barriers_[q] + row + rank_, epoch);
    for (int q = 0; q < num_ranks_ && rc == kDeviceOk; ++q) {
      const uint64_t* slot = barriers_ + row + q;
      if (!detail::spin(*this, CmpOp::GE, epoch, [&] { return ptx::ld_acquire_sys(slot); }))
        rc = kDeviceTimeout;
    }
  }
  return g.broadcast(rc);
}

FASTCOMMS_DEVICE_FN void* DeviceWindow::get_nvlink_address(int peer) const {
  if (peer < 0 || peer >= num_ranks_) return nullptr;
  return peer_bases_[peer];
}

FASTCOMMS_DEVICE_FN void* DeviceWindow::get_multimem_address(size_t) const { return nullptr; }

}  // namespace fastcomms::device
