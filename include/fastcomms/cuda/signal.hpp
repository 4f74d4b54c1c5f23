// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Point-to-point signals for windows: one 64-bit slot per (receiver, sender) pair in the
/// receiver's signal pad, written only by that sender with monotonically growing values.
///
/// NOTE [window signal ordering]: signal_async runs, in stream order after everything the sender
/// enqueued before it (copy-engine puts included: a copy is complete when the stream reaches the
/// next kernel), a fence.acq_rel.sys and then st.release.sys of the new count into the
/// receiver's slot. wait_signal_async spins with ld.acquire.sys on its own slot until the count
/// is reached, so every write the sender made before signalling is visible to work the receiver
/// enqueues after the wait. A wait longer than `timeout_ns` stores kBarrierTimeout into `error`
/// and stops waiting instead of hanging.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastcomms::cuda {

/// Enqueues: fence, then publish `value` into `remote_slot` (a peer's pad, mapped here).
void signal_async(uint64_t* remote_slot, uint64_t value, cudaStream_t stream);

/// Enqueues: wait until `*local_slot >= value` (acquire), or time out into `*error`.
void wait_signal_async(const uint64_t* local_slot, uint64_t value, int* error, uint64_t timeout_ns,
                       cudaStream_t stream);

}  // namespace fastcomms::cuda
