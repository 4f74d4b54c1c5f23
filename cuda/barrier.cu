// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "detail/sync.cuh"
#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/check.hpp"

namespace fastcomms::cuda {
namespace {

// One thread per peer. See NOTE [epoch barrier ordering] in barrier.hpp.
__global__ void barrier_kernel(BarrierArgs a) {
  const uint64_t value = detail::call_epoch(a);
  detail::barrier_body(a, a.slot, value);
  if (a.advance && a.epoch) {
    __syncthreads();
    if (threadIdx.x == 0) *a.epoch = value;
  }
}

__global__ void spin_kernel(uint64_t ns) {
  const uint64_t start = detail::now_ns();
  while (detail::now_ns() - start < ns) {
  }
}

}  // namespace

void spin_async(uint64_t ns, cudaStream_t stream) {
  spin_kernel<<<1, 1, 0, stream>>>(ns);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

void barrier_async(const BarrierArgs& args, cudaStream_t stream) {
  if (args.size <= 1 && !(args.advance && args.epoch)) return;
  const int threads = args.size < 32 ? 32 : (args.size > 1024 ? 1024 : args.size);
  barrier_kernel<<<1, threads, 0, stream>>>(args);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

}  // namespace fastcomms::cuda
