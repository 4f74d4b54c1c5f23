// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The CUDA check: every runtime call goes through FASTCOMMS_CUDA_CHECK, every launch is followed
/// by FASTCOMMS_CUDA_LAUNCH_CHECK. Failures throw fastcomms::Error(kCudaError) naming the call,
/// the file and line, and the CUDA error.

#include <cuda_runtime_api.h>

#include "fastcomms/error.hpp"

namespace fastcomms::cuda::detail {
[[noreturn]] inline void throw_cuda(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(ErrorCode::kCudaError, fastcomms::detail::cat(file, ":", line, ": ", call,
                                                            " failed: ", cudaGetErrorName(err),
                                                            " (", cudaGetErrorString(err), ")"));
}
}  // namespace fastcomms::cuda::detail

/// Runs a CUDA runtime call and throws fastcomms::Error(kCudaError) when it fails.
#define FASTCOMMS_CUDA_CHECK(call)                                               \
  do {                                                                           \
    const cudaError_t fc_err_ = (call);                                          \
    if (fc_err_ != cudaSuccess) [[unlikely]]                                     \
      ::fastcomms::cuda::detail::throw_cuda(fc_err_, #call, __FILE__, __LINE__); \
  } while (0)

/// Checks the last launch (call right after every <<<...>>>).
#define FASTCOMMS_CUDA_LAUNCH_CHECK() FASTCOMMS_CUDA_CHECK(cudaGetLastError())
