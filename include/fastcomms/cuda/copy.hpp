// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Executing plan::CopyDesc on the GPU, two engines: the copy engines (one cudaMemcpy3DAsync per
/// descriptor, zero SMs) and an SM kernel that moves 16-byte vectors where alignment allows.
/// Pointers may be local or mapped from a peer (NVLink).

#include <cuda_runtime_api.h>

#include <type_traits>

#include "fastcomms/plan/ulysses_plan.hpp"

namespace fastcomms::cuda {

/// One descriptor with its two buffers, passed by value to the kernel.
struct CopyJob {
  const void* src = nullptr;  ///< Base the descriptor's source offsets are relative to.
  void* dst = nullptr;        ///< Base the descriptor's destination offsets are relative to.
  plan::CopyDesc desc;        ///< What to copy.
};
static_assert(std::is_trivially_copyable_v<CopyJob>);

/// Enqueues `job` on the copy engines as one pitched copy (nothing for an empty descriptor).
/// @param job the copy
/// @param stream the stream it is ordered on
void copy_engine_async(const CopyJob& job, cudaStream_t stream);

/// Enqueues all `jobs` as SM kernel launches (16-byte vectors when every pointer, offset, pitch
/// and width of a job is 16-byte aligned; narrower accesses otherwise).
/// @param jobs host array of jobs
/// @param count number of jobs
/// @param max_blocks upper bound on thread blocks per launch (0: the kernel's default)
/// @param stream the stream they are ordered on
/// @param skip if not null, a device word: the kernel copies nothing when it is non-zero
///        (set by a barrier that found the ranks disagreeing)
void copy_sm_async(const CopyJob* jobs, int count, int max_blocks, cudaStream_t stream,
                   const int* skip = nullptr);

}  // namespace fastcomms::cuda
