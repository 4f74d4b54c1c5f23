// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The kernels of the device all-to-all-v (torchcomms' device_alltoallv_single): split sizes are
/// int64 tensors on the GPU, read only by these kernels.
///
/// NOTE [device all-to-all-v]: every rank owns one buffer mapped into every peer (CUDA IPC, set
/// up once): a count pad, a done pad and a receive buffer ("staging") of the same capacity on
/// every rank. A call of epoch e (one past the device counter `epoch`, so a replayed CUDA graph
/// advances on its own: no value is fixed on the host) runs four kernels on the caller's stream:
/// 1. counts (one block): checks this rank's input_split_sizes and output_split_sizes, writes
///    both with the row bytes (and a bit per rejected vector) into slot [e & 1][rank] of every
///    rank's count pad, then fence.acq_rel.sys + st.release.sys of e as the slot's flag; waits
///    (ld.acquire.sys, with the timeout) for every peer's slot [e & 1][peer] to read e. Every
///    rank then holds every rank's counts (S[sender][receiver] sent, R[receiver][sender]
///    expected) and computes the same verdicts from them: where sender p's rows land in receiver
///    q's staging (after the rows of lower senders, q's own rows excepted), whether q's staging
///    overflows (then no rank sends to q), whether all row sizes agree (else nobody copies),
///    which pairs disagree. So every error is seen by every rank, and every rank's next call
///    reports it: no rank goes on alone. It writes the per-peer plan (offsets and bytes) into
///    device memory for the next kernels.
/// 2. push (a grid): copies this rank's rows for each peer q straight into q's staging (the copy
///    over the link) and its own rows from input to output (read through `input_index` where
///    one is given: NOTE [indexed push]); the last block to finish fences
///    (fence.acq_rel.sys after every block's fence, through the done counter) and stores e with
///    st.release.sys into every peer's done pad at [rank]: always, even with nothing to send.
/// 3. wait (one block): ld.acquire.sys on this rank's done pad until every peer's entry reads
///    e (with the timeout), then stores e into `epoch`.
/// 4. copy-out (a grid): for each peer p, min(output_split_sizes[p], S[p][rank]) rows from the
///    staging to the output at the prefix sum of output_split_sizes, clipped to the output.
/// Copies per call: each row crosses the link once (input to the receiver's staging) and is
/// copied once more inside the receiver (staging to output); a rank's own rows go input to
/// output directly. (Zero copy would need the user's output mapped into every peer, which a
/// call cannot set up without the host.)
/// Reuse: a rank writes q's staging in call e + 1 only after it read q's call-(e + 1) counts,
/// which q writes after its call-e copy-out in stream order; count slots alternate by e & 1, so a
/// slot is rewritten (call e + 2) only after its reader has finished call e. Done entries only
/// grow, and a peer can be at most one call ahead.
/// Errors (DeviceA2avError) never stop the protocol: every flag is still written, so no peer
/// waits for a rank that found a bad count; a wait that times out marks the group broken (later
/// calls copy nothing and wait for nobody) and leaves kA2avTimeout.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

#include "fastcomms/cuda/device_a2av_plan.hpp"

namespace fastcomms::cuda {

/// What the device flags (the first error of a check interval wins).
enum DeviceA2avCode : int {
  kA2avOk = 0,
  kA2avNegativeSend = 1,     ///< input_split_sizes[peer] is negative (got).
  kA2avSendOverflow = 2,     ///< input_split_sizes sum to got rows, input has expected.
  kA2avNegativeRecv = 3,     ///< output_split_sizes[peer] is negative (got).
  kA2avRecvOverflow = 4,     ///< output_split_sizes sum to got rows, output has expected.
  kA2avPeerBadCounts = 5,    ///< rank peer rejected its input_split_sizes (phase 1) or its
                             ///< output_split_sizes (phase 2).
  kA2avCountMismatch = 6,    ///< rank peer's output_split_sizes[peer2] is expected rows, rank
                             ///< peer2 sends it got rows.
  kA2avStagingOverflow = 7,  ///< rank peer would receive got bytes, its buffer holds expected.
  kA2avRowMismatch = 8,      ///< rank peer's rows are got bytes, this rank's expected.
  kA2avTimeout = 9,          ///< waited more than expected ms for rank peer (phase: 1 counts,
                             ///< 2 done); sticky.
};

/// The error record, in mapped pinned memory (the host reads it without a sync). `ready` is
/// stored last (after a system fence), so a host that sees it sees the fields.
struct DeviceA2avError {
  int code = 0;
  int peer = -1;
  int peer2 = -1;
  int phase = 0;
  int ready = 0;
  int timed_out = 0;  ///< Set by every timeout, never cleared: the group is broken.
  int64_t expected = 0;
  int64_t got = 0;
};

/// Device state of one rank (not mapped): the epoch counter and what the kernels hand on.
struct DeviceA2avState {
  uint64_t epoch = 0;     ///< Calls completed (NOTE [device all-to-all-v]).
  uint64_t call = 0;      ///< The epoch of the call in flight (set by the counts kernel).
  unsigned int done = 0;  ///< Push blocks finished (reset by the last).
  int broken = 0;         ///< A wait timed out: later calls copy nothing, wait for nobody.
  int copy = 0;           ///< This call copies (row sizes agree, nobody timed out).
  int pad_ = 0;
};

/// Everything the kernels need; trivially copyable, passed by value.
struct DeviceA2avArgs {
  int rank = 0;
  int size = 1;
  /// Device array: rank q's buffer base, mapped here ([rank]: this rank's). A buffer is the
  /// count pad (count_pad_words() u64), the done pad (size u64), then the staging at
  /// staging_offset().
  char* const* peers = nullptr;
  DeviceA2avState* state = nullptr;
  DeviceA2avPeerPlan* plan = nullptr;    ///< Device array of size entries.
  DeviceA2avError* error = nullptr;      ///< Device pointer of the mapped pinned record.
  const int64_t* send_counts = nullptr;  ///< input_split_sizes (size int64 on this device).
  const int64_t* recv_counts = nullptr;  ///< output_split_sizes.
  const char* input = nullptr;
  char* output = nullptr;
  int64_t input_rows = 0;
  int64_t output_rows = 0;
  int64_t row_bytes = 0;      ///< Bytes of one dim-0 row (input's and output's).
  int64_t staging_bytes = 0;  ///< Capacity of every rank's staging.
  uint64_t timeout_ns = 0;    ///< Each device wait gives up after this long (0: never).
  uint64_t timeout_ms = 0;    ///< The same, for the error record.
  int vector_bytes = 16;      ///< 16, 8, 4, 2 or 1: divides row_bytes and both tensors' bases.
  /// NOTE [indexed push]: null, or the device array of input_rows entries naming, for each row
  /// the splits count, the row of `input` it is (rows from `input` are then input_src_rows, each
  /// row_bytes apart); an entry outside [0, input_src_rows) sends a zero row. The push reads
  /// through it, so a caller whose rows are scattered sends them without packing them first.
  const int64_t* input_index = nullptr;
  int64_t input_src_rows = 0;
};
static_assert(std::is_trivially_copyable_v<DeviceA2avArgs>);

/// Enqueues the four kernels of one call on `stream` (NOTE [device all-to-all-v]). `max_blocks`
/// caps the copy grids (0: one block per SM).
void device_a2av_async(const DeviceA2avArgs& args, int max_blocks, cudaStream_t stream);

}  // namespace fastcomms::cuda
