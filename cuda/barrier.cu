// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/check.hpp"

namespace fastcomms::cuda {
namespace {

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
__device__ __forceinline__ uint64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// One thread per peer. See NOTE [epoch barrier ordering] in barrier.hpp.
__global__ void barrier_kernel(BarrierArgs a) {
  for (int q = threadIdx.x; q < a.size; q += blockDim.x) {
    if (q == a.rank) continue;
    uint64_t* remote = a.peer_pads[q] + (static_cast<size_t>(a.slot) * a.size + a.rank) * 2;
    __threadfence_system();
    st_relaxed_sys(remote + 1, a.key);
    st_release_sys(remote, a.value);
  }
  for (int q = threadIdx.x; q < a.size; q += blockDim.x) {
    if (q == a.rank) continue;
    const uint64_t* local = a.local_pad + (static_cast<size_t>(a.slot) * a.size + q) * 2;
    const uint64_t start = now_ns();
    while (ld_acquire_sys(local) < a.value) {
      if (a.timeout_ns && now_ns() - start > a.timeout_ns) {
        atomicExch(a.error, kBarrierTimeout);
        if (a.skip) atomicExch(a.skip, 1);
        break;
      }
    }
    if (ld_relaxed_sys(local + 1) != a.key) {
      atomicExch(a.error, kBarrierMismatch);
      if (a.skip) atomicExch(a.skip, 1);
    }
  }
}

}  // namespace

void barrier_async(const BarrierArgs& args, cudaStream_t stream) {
  if (args.size <= 1) return;
  const int threads = args.size < 32 ? 32 : (args.size > 1024 ? 1024 : args.size);
  barrier_kernel<<<1, threads, 0, stream>>>(args);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

}  // namespace fastcomms::cuda
