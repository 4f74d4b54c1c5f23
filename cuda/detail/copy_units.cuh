// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// Device code shared by the copy kernels (private to cuda/).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>

#include "fastcomms/cuda/copy.hpp"

namespace fastcomms::cuda::detail {

/// Multiprocessors of the current device, read once per process; 0 if CUDA cannot say.
inline int sm_count() {
  static const int n = [] {
    int dev = 0, sms = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return sms;
  }();
  return n;
}

constexpr int kJobsPerLaunch = 16;
constexpr int kThreads = 512;

/// NOTE [shared GPU residency]: the fused and flagged kernels spin (on block 0's release, on
/// peers' flags), so a grid must be resident whole while it waits, and so must every peer grid it
/// waits for. With one rank per GPU and one lane, a grid of at most one block per SM is (two
/// lanes: NOTE [two lanes on one GPU] in backends/nvlink/nvlink_ulysses.hpp). With several ranks
/// on one GPU running side by side (MPS clients; time-sliced processes are preempted instead),
/// each kernel at 512 threads and 78-104 registers fits one block per SM, so two grids of one
/// block per SM cannot both be resident: each waits for the other's missing blocks and the call
/// hangs (seen on one H200 with 2 and 4 ranks as MPS clients; the separate barrier kernel's path,
/// whose spinning grid is one block, ran). So where `grids` spinning grids may be on the GPU at
/// once, each is capped at that share of what the device holds. `per_sm` is the kernel's
/// occupancy at kThreads (>= 1).
inline int resident_share(int per_sm, int sms, int grids) {
  return std::max(1, per_sm * sms / std::max(1, grids));
}

/// Blocks of `kernel` at kThreads that one multiprocessor holds at once (1 if CUDA cannot say).
inline int blocks_per_sm(const void* kernel) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kThreads, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 0;
  }
  return n > 0 ? n : 1;
}

struct JobBatch {
  CopyJob jobs[kJobsPerLaunch];
  int count;
};
static_assert(sizeof(JobBatch) <= 4096, "kernel parameter space");

// Work is split into units of one row segment of at most kChunkBytes, so a single wide row (a
// flat copy) spreads over many warps just like many narrow rows do. blockIdx.y picks the job;
// each warp takes units in a grid-stride loop (16 units in flight per 512-thread block), and each
// lane moves kUnroll accesses of type V per step with all loads issued before the stores.
constexpr int64_t kChunkBytes = 16 * 1024;
constexpr int kUnroll = 4;
constexpr int kWarps = kThreads / 32;

template <typename V>
__device__ __forceinline__ void copy_units(const CopyJob& j, int64_t warp, int64_t warps) {
  const plan::CopyDesc& c = j.desc;
  constexpr int64_t kVec = sizeof(V);
  const int64_t rows = c.height * c.depth;
  const int64_t chunks = (c.width + kChunkBytes - 1) / kChunkBytes;
  const int64_t units = rows * chunks;
  const auto* src = static_cast<const unsigned char*>(j.src) + c.src_offset;
  auto* dst = static_cast<unsigned char*>(j.dst) + c.dst_offset;
  const int lane = threadIdx.x & 31;
  for (int64_t u = warp; u < units; u += warps) {
    const int64_t row = u / chunks, chunk = u - row * chunks;
    const int64_t z = row / c.height, y = row - z * c.height;
    const int64_t begin = chunk * kChunkBytes;
    const int n = static_cast<int>(min(c.width - begin, kChunkBytes) / kVec);
    const V* s = reinterpret_cast<const V*>(src + z * c.src_slice_pitch + y * c.src_pitch + begin);
    V* t = reinterpret_cast<V*>(dst + z * c.dst_slice_pitch + y * c.dst_pitch + begin);
    for (int i = lane; i < n; i += 32 * kUnroll) {
      V v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        if (i + k * 32 < n) v[k] = s[i + k * 32];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k)
        if (i + k * 32 < n) t[i + k * 32] = v[k];
    }
  }
}

// Copies one job with the widest access its alignment allows; warps `warp` of `warps` share it.
__device__ __forceinline__ void copy_job(const CopyJob& j, int64_t warp, int64_t warps) {
  if (j.desc.width == 0) return;
  const auto align = [](int64_t v) { return static_cast<uint64_t>(v); };
  const uint64_t bits = reinterpret_cast<uintptr_t>(j.src) | reinterpret_cast<uintptr_t>(j.dst) |
                        align(j.desc.src_offset) | align(j.desc.dst_offset) |
                        align(j.desc.src_pitch) | align(j.desc.dst_pitch) |
                        align(j.desc.src_slice_pitch) | align(j.desc.dst_slice_pitch) |
                        align(j.desc.width);
  if ((bits & 15) == 0)
    copy_units<uint4>(j, warp, warps);
  else if ((bits & 7) == 0)
    copy_units<uint2>(j, warp, warps);
  else if ((bits & 3) == 0)
    copy_units<uint32_t>(j, warp, warps);
  else
    copy_units<unsigned char>(j, warp, warps);
}

}  // namespace fastcomms::cuda::detail
