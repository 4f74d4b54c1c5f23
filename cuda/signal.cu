// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Window signals (NOTE [window signal ordering] in include/fastcomms/cuda/signal.hpp).
#include "detail/sync.cuh"
#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/signal.hpp"

namespace fastcomms::cuda {
namespace {

__global__ void signal_kernel(uint64_t* remote_slot, uint64_t value) {
  __threadfence_system();
  detail::st_release_sys(remote_slot, value);
}

__global__ void wait_signal_kernel(const uint64_t* local_slot, uint64_t value, int* error,
                                   uint64_t timeout_ns) {
  const uint64_t start = detail::now_ns();
  while (detail::ld_acquire_sys(local_slot) < value) {
    if (timeout_ns && detail::now_ns() - start > timeout_ns) {
      if (error) atomicExch(error, kBarrierTimeout);
      return;
    }
  }
}

}  // namespace

void signal_async(uint64_t* remote_slot, uint64_t value, cudaStream_t stream) {
  signal_kernel<<<1, 1, 0, stream>>>(remote_slot, value);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

void wait_signal_async(const uint64_t* local_slot, uint64_t value, int* error, uint64_t timeout_ns,
                       cudaStream_t stream) {
  wait_signal_kernel<<<1, 1, 0, stream>>>(local_slot, value, error, timeout_ns);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

}  // namespace fastcomms::cuda
