// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// Scoped loads and stores for the signal pads (private to cuda/); see NOTE [epoch barrier
// ordering] in include/fastcomms/cuda/barrier.hpp.
#include <cstdint>

#include "fastcomms/cuda/barrier.hpp"

namespace fastcomms::cuda::detail {

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ void st_relaxed_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_gpu(uint64_t* p, uint64_t v) {
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_acquire_gpu(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/// One 16-byte flagged line {lo, flag, hi, flag} (NOTE [flagged push]); each 8-byte half
/// arrives whole.
__device__ __forceinline__ void st_line(uint4* p, uint32_t lo, uint32_t hi, uint32_t flag) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(lo), "r"(flag),
               "r"(hi), "r"(flag)
               : "memory");
}

__device__ __forceinline__ uint4 ld_line(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

/// One past the device counter of completed calls.
__device__ __forceinline__ uint64_t call_epoch_of(const uint64_t* epoch) {
  return *reinterpret_cast<const volatile uint64_t*>(epoch) + 1;
}

/// The epoch of the call in flight: one past the device counter (see BarrierArgs::epoch).
__device__ __forceinline__ uint64_t call_epoch(const BarrierArgs& a) {
  return a.epoch ? *reinterpret_cast<const volatile uint64_t*>(a.epoch) + 1 : a.value;
}

/// One barrier on `slot` with `value`, by the threads of one block (one thread per peer).
__device__ __forceinline__ void barrier_body(const BarrierArgs& a, int slot, uint64_t value) {
  // NOTE [one call, two paths]
  const uint32_t flag = static_cast<uint32_t>(value);
  const int64_t half = static_cast<int64_t>(value & 1);
  const uint64_t marked = a.key ^ kBarrierPathMark;
  for (int q = threadIdx.x; q < a.size; q += blockDim.x) {
    if (q == a.rank) continue;
    if (slot == 0 && a.flag_peers)
      st_line(a.flag_peers[q] + (half * a.size + a.rank) * a.flag_slot_lines,
              static_cast<uint32_t>(marked), static_cast<uint32_t>(marked >> 32), flag);
    uint64_t* remote = a.peer_pads[q] + (static_cast<size_t>(slot) * a.size + a.rank) * 2;
    __threadfence_system();
    st_relaxed_sys(remote + 1, a.key);
    st_release_sys(remote, value);
  }
  for (int q = threadIdx.x; q < a.size; q += blockDim.x) {
    if (q == a.rank) continue;
    const uint64_t* local = a.local_pad + (static_cast<size_t>(slot) * a.size + q) * 2;
    const uint4* header =
        a.flag_peers ? a.flag_local + (half * a.size + q) * a.flag_slot_lines : nullptr;
    const uint64_t start = now_ns();
    bool other_path = false;
    for (int spins = 1; ld_acquire_sys(local) < value; ++spins) {
      if (header && (spins & 15) == 0) {
        const uint4 h = ld_line(header);
        if (h.y == flag && h.w == flag && (static_cast<uint64_t>(h.z) << 32 | h.x) != marked) {
          other_path = true;
          break;
        }
      }
      if (a.timeout_ns && now_ns() - start > a.timeout_ns) {
        atomicExch(a.error, kBarrierTimeout);
        if (a.skip) atomicExch(a.skip, 1);
        break;
      }
    }
    if (other_path || ld_relaxed_sys(local + 1) != a.key) {
      atomicExch(a.error, kBarrierMismatch);
      if (a.skip) atomicExch(a.skip, 1);
    }
  }
}

}  // namespace fastcomms::cuda::detail
