// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include <algorithm>
#include <cstdint>

#include "detail/copy_units.cuh"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/copy.hpp"

namespace fastcomms::cuda {
using namespace detail;
namespace {

__global__ void __launch_bounds__(kThreads) copy_kernel(JobBatch batch, const int* skip) {
  if (blockIdx.y >= static_cast<unsigned>(batch.count)) return;
  if (skip != nullptr && *reinterpret_cast<const volatile int*>(skip) != 0) return;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  copy_job(batch.jobs[blockIdx.y], warp, static_cast<int64_t>(gridDim.x) * kWarps);
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
  // An unknown count only sizes the grid here.
  const int sms = sm_count() > 0 ? sm_count() : 132;
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
