// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Stream memory operations (cuStreamBatchMemOp): 64-bit writes and waits that the GPU's
/// front end executes in stream order, with no kernel and no SM.
///
/// NOTE [memop barrier]: the copy-engine path's barriers, so that an async call makes progress
/// while a GEMM holds every SM. A barrier on slot s with token t does, on the caller's stream:
/// (1) for every peer q, a write of t into q's memop slot [s][rank] (default flags: a fence
///     scoped to the stream comes first, so every copy the stream completed before, copy-engine
///     copies into peers included, is visible before the token);
/// (2) for every peer q, a wait until this rank's slot [s][q] == t;
/// (3) for every peer q, a write of 0 into this rank's slot [s][q].
/// Tokens are fixed per (geometry key, slot, generation), not per call, so the step (3) reset
/// is what tells calls apart: peer q writes its next token into [s][rank] only after passing the
/// next barrier of the other slot, which needs this rank's token of that barrier, written after
/// (3) in stream order. A wait has no timeout of its own: a host watchdog (backends/nvlink,
/// NOTE [memop watchdog]) reports a timeout or a peer's differing token and releases the wait.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

namespace fastcomms::cuda {

/// One 64-bit stream memory operation.
struct MemOp {
  enum Kind { kWrite, kWaitEq, kWaitEqFlush } kind = kWrite;  ///< Flush: CU_STREAM_WAIT_VALUE_FLUSH
  uint64_t* address = nullptr;  ///< Device address (this device's memory or a peer's mapping).
  uint64_t value = 0;
};

/// Whether `device` runs 64-bit stream memory operations (else `why` says what is missing).
bool memops_supported(int device, std::string* why = nullptr);

/// Whether waits on `device` can flush remote writes (CU_STREAM_WAIT_VALUE_FLUSH: writes peers
/// made before the awaited value are visible to the work after the wait).
bool memops_can_flush(int device);

/// Enqueues `ops` on `stream` in order (batched, as many per batch as the driver takes).
void memops_async(const std::vector<MemOp>& ops, cudaStream_t stream);

/// Enqueues the barrier of NOTE [memop barrier]: `remote[q]` is peer q's slot [s][rank] (mapped
/// here; ignored for q == rank), `local[q]` this rank's slot [s][q]; `flush`: the waits flush
/// remote writes (where memops_can_flush).
void memop_barrier_async(const std::vector<uint64_t*>& remote, const std::vector<uint64_t*>& local,
                         int rank, uint64_t token, bool flush, cudaStream_t stream);

}  // namespace fastcomms::cuda
