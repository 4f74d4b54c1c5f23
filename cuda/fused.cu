// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include <algorithm>

#include "detail/copy_units.cuh"
#include "detail/sync.cuh"
#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/copy.hpp"

namespace fastcomms::cuda {
namespace {

using namespace detail;

// NOTE [fused push]: the entry barrier, the transfer and the exit barrier in one launch. Block 0
// runs the entry barrier and then releases the grid through `go` (release/acquire at gpu scope:
// the skip word it may have set is visible to every block after). Each block fences its peer
// writes at system scope before counting itself done; the last block to count acquires them all
// (fence after the atomic) and then publishes the exit flags, so a peer that passes the exit
// barrier sees every byte of this rank's push. The grid is at most one block per SM, so block 0
// is resident while the others spin.
__global__ void __launch_bounds__(kThreads) fused_push_kernel(FusedPushArgs a, JobBatch batch) {
  const BarrierArgs& b = a.bar;
  const uint64_t e = call_epoch(b);
  __shared__ int skip;
  __shared__ int last;
  if (blockIdx.x == 0) {
    barrier_body(b, 0, e);
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      st_release_gpu(a.go, e);
    }
  } else if (threadIdx.x == 0) {
    while (ld_acquire_gpu(a.go) < e) {
    }
  }
  if (threadIdx.x == 0) skip = b.skip ? *reinterpret_cast<volatile int*>(b.skip) : 0;
  __syncthreads();
  if (!skip) {
    const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
    const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
    for (int j = 0; j < batch.count; ++j) copy_job(batch.jobs[j], warp, warps);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(a.done, 1u) == gridDim.x - 1;
    if (last) __threadfence_system();
  }
  __syncthreads();
  if (!last) return;
  barrier_body(b, 1, e);
  __syncthreads();
  if (threadIdx.x == 0) {
    *a.done = 0;
    *b.epoch = e;
  }
}

}  // namespace

void fused_push_async(const FusedPushArgs& args, const CopyJob* jobs, int count,
                      cudaStream_t stream) {
  FASTCOMMS_CHECK(count <= kJobsPerLaunch && args.bar.epoch && args.done && args.go, kInternal,
                  "fused_push_async: ", count, " jobs (at most ", kJobsPerLaunch,
                  "), epoch/done/go must be set");
  // Never guess high: the grid must stay co-resident (NOTE [fused push]).
  const int sms = sm_count() > 0 ? sm_count() : 1;
  JobBatch batch{};
  batch.count = count;
  int64_t units = 0;
  for (int i = 0; i < count; ++i) {
    batch.jobs[i] = jobs[i];
    const plan::CopyDesc& c = jobs[i].desc;
    units += c.height * c.depth * ((c.width + kChunkBytes - 1) / kChunkBytes);
  }
  int cap = args.max_blocks > 0 ? std::min(args.max_blocks, sms) : sms;
  if (args.gpu_grids > 1) {  // NOTE [shared GPU residency]
    static const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(fused_push_kernel));
    cap = std::min(cap, resident_share(per_sm, sms, args.gpu_grids));
  }
  const int64_t blocks = std::clamp<int64_t>((units + kWarps - 1) / kWarps, 1, cap);
  fused_push_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args, batch);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

}  // namespace fastcomms::cuda
