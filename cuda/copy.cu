// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <cstdint>

#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/copy.hpp"

namespace fastcomms::cuda {
namespace {

constexpr int kJobsPerLaunch = 16;
constexpr int kThreads = 512;

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
__device__ void copy_units(const CopyJob& j) {
  const plan::CopyDesc& c = j.desc;
  constexpr int64_t kVec = sizeof(V);
  const int64_t rows = c.height * c.depth;
  const int64_t chunks = (c.width + kChunkBytes - 1) / kChunkBytes;
  const int64_t units = rows * chunks;
  const auto* src = static_cast<const unsigned char*>(j.src) + c.src_offset;
  auto* dst = static_cast<unsigned char*>(j.dst) + c.dst_offset;
  const int lane = threadIdx.x & 31;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
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

__global__ void __launch_bounds__(kThreads) copy_kernel(JobBatch batch, const int* skip) {
  if (blockIdx.y >= static_cast<unsigned>(batch.count)) return;
  if (skip != nullptr && *reinterpret_cast<const volatile int*>(skip) != 0) return;
  const CopyJob& j = batch.jobs[blockIdx.y];
  if (j.desc.width == 0) return;
  const auto align = [](int64_t v) { return static_cast<uint64_t>(v); };
  const uint64_t bits = reinterpret_cast<uintptr_t>(j.src) | reinterpret_cast<uintptr_t>(j.dst) |
                        align(j.desc.src_offset) | align(j.desc.dst_offset) |
                        align(j.desc.src_pitch) | align(j.desc.dst_pitch) |
                        align(j.desc.src_slice_pitch) | align(j.desc.dst_slice_pitch) |
                        align(j.desc.width);
  if ((bits & 15) == 0)
    copy_units<uint4>(j);
  else if ((bits & 7) == 0)
    copy_units<uint2>(j);
  else if ((bits & 3) == 0)
    copy_units<uint32_t>(j);
  else
    copy_units<unsigned char>(j);
}

}  // namespace

void copy_engine_async(const CopyJob& job, cudaStream_t stream) {
  const plan::CopyDesc& c = job.desc;
  if (c.empty()) return;
  if (c.height == 1 && c.depth == 1) {
    FASTCOMMS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(job.dst) + c.dst_offset,
                                         static_cast<const char*>(job.src) + c.src_offset, c.width,
                                         cudaMemcpyDefault, stream));
    return;
  }
  if (c.depth == 1) {
    FASTCOMMS_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(job.dst) + c.dst_offset, c.dst_pitch,
                                           static_cast<const char*>(job.src) + c.src_offset,
                                           c.src_pitch, c.width, c.height, cudaMemcpyDefault,
                                           stream));
    return;
  }
  // NOTE [copy descriptor invariants]: slice pitches are multiples of the row pitch, so the
  // y-extent of each side is slice_pitch / pitch.
  cudaMemcpy3DParms p{};
  p.srcPtr =
      make_cudaPitchedPtr(const_cast<char*>(static_cast<const char*>(job.src)) + c.src_offset,
                          c.src_pitch, c.width, c.src_slice_pitch / c.src_pitch);
  p.dstPtr = make_cudaPitchedPtr(static_cast<char*>(job.dst) + c.dst_offset, c.dst_pitch, c.width,
                                 c.dst_slice_pitch / c.dst_pitch);
  p.extent = make_cudaExtent(c.width, c.height, c.depth);
  p.kind = cudaMemcpyDefault;
  FASTCOMMS_CUDA_CHECK(cudaMemcpy3DAsync(&p, stream));
}

void copy_sm_async(const CopyJob* jobs, int count, int max_blocks, cudaStream_t stream,
                   const int* skip) {
  static const int sms = [] {
    int dev = 0, n = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) {
      (void)cudaGetLastError();
      return 132;
    }
    return n;
  }();
  for (int first = 0; first < count; first += kJobsPerLaunch) {
    JobBatch batch{};
    batch.count = std::min(kJobsPerLaunch, count - first);
    int64_t units = 0;
    for (int i = 0; i < batch.count; ++i) {
      batch.jobs[i] = jobs[first + i];
      const plan::CopyDesc& c = batch.jobs[i].desc;
      units = std::max(units, c.height * c.depth * ((c.width + kChunkBytes - 1) / kChunkBytes));
    }
    if (units == 0) continue;
    // Enough blocks to fill every SM a few times over, shared among the jobs of the launch.
    const int64_t cap = max_blocks > 0 ? max_blocks : std::max<int64_t>(1, 4 * sms / batch.count);
    const int64_t blocks = (units + kWarps - 1) / kWarps;
    const dim3 grid(static_cast<unsigned>(std::min<int64_t>(blocks, cap)), batch.count);
    copy_kernel<<<grid, kThreads, 0, stream>>>(batch, skip);
    FASTCOMMS_CUDA_LAUNCH_CHECK();
  }
}

}  // namespace fastcomms::cuda
