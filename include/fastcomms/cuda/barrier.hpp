// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Device-side epoch barriers over signal pads mapped into every peer.
///
/// NOTE [epoch barrier ordering]: a barrier with value v on slot s does, for every peer q:
/// (1) fence.acq_rel.sys, so every write this rank issued before the barrier in stream order
///     (SM stores into peers' windows, and copy-engine copies, which are complete once the stream
///     reaches the kernel) is ordered before (2);
/// (2) st.release.sys of {key, v} into q's pad at [s][rank];
/// (3) ld.acquire.sys spin on this rank's pad at [s][q] until it reads >= v, so every write q made
///     before its own (2) is visible here afterwards.
/// Values only grow (one epoch per call, the same on every rank), so a flag left from an earlier
/// call can never satisfy a later wait, and a peer can run ahead by at most one barrier: it
/// cannot pass the next entry barrier before this rank arrives there, which is what keeps a
/// peer's next call from writing into a window this rank is still reading (copy-out happens
/// before this rank's next entry barrier, in stream order).
/// The key (a hash of the call's geometry) travels with the flag; a peer whose key differs sets
/// `error` (kBarrierMismatch) and the `skip` word that stops the transfer kernel. A wait that
/// exceeds `timeout_ns` sets kBarrierTimeout and stops waiting.

#include <cuda_runtime_api.h>

#include <cstdint>
#include <type_traits>

namespace fastcomms::cuda {

/// Error codes a barrier leaves in its error word.
enum BarrierError : int { kBarrierOk = 0, kBarrierMismatch = 1, kBarrierTimeout = 2 };

/// Slots per pad; each slot holds {epoch, key} for every rank.
inline constexpr int kPadSlots = 4;

/// Bytes of one rank's signal pad for a world of `size`.
inline constexpr size_t pad_bytes(int size) {
  return static_cast<size_t>(kPadSlots) * size * 2 * sizeof(uint64_t);
}

/// What the barrier kernel needs; trivially copyable, passed by value.
struct BarrierArgs {
  uint64_t* local_pad = nullptr;         ///< This rank's pad (peers write it).
  uint64_t* const* peer_pads = nullptr;  ///< Device array: peer q's pad, mapped here.
  int rank = 0;
  int size = 1;
  int slot = 0;        ///< Which slot of the pads.
  uint64_t value = 0;  ///< The epoch to publish (when `epoch` is null).
  /// Device counter of completed calls: the barrier publishes *epoch + 1, so a captured CUDA
  /// graph advances on every replay. Null: use `value`.
  uint64_t* epoch = nullptr;
  bool advance = false;     ///< Store the new epoch back when done (the call's last barrier).
  uint64_t key = 0;         ///< The call's geometry key.
  int* error = nullptr;     ///< Host-visible word for BarrierError (mapped pinned).
  int* skip = nullptr;      ///< Device word the transfer kernel checks.
  uint64_t timeout_ns = 0;  ///< Give up after this long (0: never).
  /// NOTE [one call, two paths]: when the group has flag buffers (NOTE [flagged push]), the
  /// entry barrier also writes this rank's header, keyed `key ^ kBarrierPathMark`, into every
  /// peer's flag buffer, and every wait watches this rank's own flag buffer: a peer header of
  /// this call with another key means that peer took the flagged path (or another geometry), so
  /// the wait stops with kBarrierMismatch instead of running into the timeout. A flagged peer
  /// sees the marked key in its header check and flags the mismatch too.
  uint4* const* flag_peers = nullptr;  ///< Device array: peer q's flag buffer (null: none).
  const uint4* flag_local = nullptr;   ///< This rank's flag buffer.
  int64_t flag_slot_lines = 0;         ///< Lines per (half, sender) slot.
};
static_assert(std::is_trivially_copyable_v<BarrierArgs>);

/// Distinguishes a barrier-path header from a flagged one (NOTE [one call, two paths]).
inline constexpr uint64_t kBarrierPathMark = 0x5bd1e9955bd1e995ull;

/// Enqueues the barrier on `stream`.
void barrier_async(const BarrierArgs& args, cudaStream_t stream);

/// Enqueues a kernel that spins for `ns` nanoseconds (test faults: a slow reader).
void spin_async(uint64_t ns, cudaStream_t stream);

/// What the fused push kernel needs besides the barrier.
struct FusedPushArgs {
  BarrierArgs bar;               ///< Entry on slot 0, exit on slot 1; `bar.epoch` must be set.
  unsigned int* done = nullptr;  ///< Device counter of finished blocks (reset by the last one).
  uint64_t* go = nullptr;        ///< Device word: block 0 publishes the epoch past the entry.
  int max_blocks = 0;            ///< Cap on the grid (0: one block per SM, the widest).
  int gpu_grids =
      1;  ///< Spinning grids that may be on this GPU at once (NOTE [shared GPU residency]).
};
static_assert(std::is_trivially_copyable_v<FusedPushArgs>);

/// One launch for a whole small exchange: block 0 runs the entry barrier and releases the other
/// blocks, every block pushes its share of `jobs` (at most 16), and the last block to finish runs
/// the exit barrier and advances the epoch. The grid never exceeds the number of SMs (nor, with
/// several ranks on one GPU, this rank's share of its resident blocks), so every block is
/// resident while others wait on block 0.
struct CopyJob;
void fused_push_async(const FusedPushArgs& args, const CopyJob* jobs, int count,
                      cudaStream_t stream);

/// NOTE [flagged push]: small exchanges without barriers. Each 16-byte line a sender stores into
/// a peer's flag buffer is {data lo 32 bits, flag, data hi 32 bits, flag}, written with one
/// 16-byte store whose two 8-byte halves each arrive whole, so a receiver that reads both flags
/// equal to the call's flag (the low 32 bits of the call's epoch) holds that line's data: no
/// fence, no handshake, one one-way trip per call. The receiver moves the data into its output.
/// Layout: buffer[half][sender][line]; a call of epoch e uses half e & 1, line 0 of each slot is
/// a header carrying the geometry key (a differing key sets kBarrierMismatch and `skip`).
/// Reuse: a sender writes half e & 1 of peer q during call e only after its call e - 1 read q's
/// call-(e-1) header, which q wrote from its call e - 1 kernel, started after its call e - 2
/// kernel (the last reader of that half) had finished in stream order. Every pair exchanges at
/// least the header, so the chain holds for empty shards too. Stale lines carry older flags.
struct FlaggedPushArgs {
  uint64_t* epoch = nullptr;      ///< Device counter of completed calls (NOTE [device epoch]).
  unsigned int* done = nullptr;   ///< Device counter of finished blocks (reset by the last).
  const uint4* local = nullptr;   ///< This rank's flag buffer (peers write it).
  uint4* const* peers = nullptr;  ///< Device array: peer q's flag buffer, mapped here.
  int rank = 0;
  int size = 1;
  int64_t slot_lines = 0;   ///< Lines per (half, sender) slot, header included.
  uint64_t key = 0;         ///< The call's geometry key.
  int* error = nullptr;     ///< Host-visible BarrierError word.
  int* skip = nullptr;      ///< Device word: set on an error; receivers stop waiting.
  uint64_t timeout_ns = 0;  ///< A receiver gives up after this long (0: never).
  int max_blocks = 0;       ///< Cap on the grid (0: one block per SM).
  int gpu_grids =
      1;  ///< Spinning grids that may be on this GPU at once (NOTE [shared GPU residency]).
};
static_assert(std::is_trivially_copyable_v<FlaggedPushArgs>);

/// One launch for a small exchange (NOTE [flagged push]). `sends[i]` is this rank's put to peer
/// `send_peer[i]` (the local share, peer == rank, is copied straight into `out`); `recvs[i]` is
/// peer `recv_peer[i]`'s put to this rank (its destination offsets address `out`). Every row
/// width must be a multiple of 8 bytes and every put at most (slot_lines - 1) * 8 bytes.
void flagged_push_async(const FlaggedPushArgs& args, const CopyJob* sends, const int* send_peer,
                        int send_count, const CopyJob* recvs, const int* recv_peer, int recv_count,
                        cudaStream_t stream);

}  // namespace fastcomms::cuda
