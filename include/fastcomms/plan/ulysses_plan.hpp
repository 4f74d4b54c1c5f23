// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The Ulysses all-to-all layout contract: which bytes go where.
///
/// Pure host arithmetic: no CUDA, no torch, no communication library. Every transport (the
/// peer-to-peer NVLink path, the collective path over any backend, the host replay used by the
/// tests) executes the descriptors produced here, so this file is the single definition of the
/// layout.
///
/// Geometry (API.md §2), with P ranks, S = sum(seq_splits), N = sum(head_splits):
///   mode 0: x is (b, seq_splits[rank], N, d)  ->  out is (b, S, head_splits[rank], d)
///   mode 1: x is (b, S, head_splits[rank], d)  ->  out is (b, seq_splits[rank], N, d)
/// and for mode 0, on rank r: out_r[i, S_p + j, k, :] = x_p[i, j, H_r + k, :] where S_p, H_r are
/// the exclusive prefix sums of the splits. Mode 1 is the exact inverse.
///
/// NOTE [kv replicas]: grouped-query and multi-query attention have fewer key/value heads than
/// ranks. With `kv_replicas` = R > 1, x holds h heads that stand for N = h * R virtual heads, the
/// virtual head v being source head v / R (as `x.repeat_interleave(R, dim=2)` would lay them out);
/// the splits and the output speak of virtual heads. Mode 0 reads the source head of every
/// virtual head a rank receives straight from x, so the repeat is never materialised and each
/// source byte is read once per destination. No rank may receive two copies of one source head
/// (its virtual range must map to distinct, hence contiguous, source heads), which holds for the
/// usual R = world_size / h with one virtual head per rank. Mode 1 with R is the exchange of the
/// replicas' gradients: descriptors and output as for R = 1 over the N virtual heads, and the
/// caller sums each run of R consecutive output heads into one (the Python layer does it with
/// torch, so the sum is repeat_interleave's own backward).

#include <array>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace fastcomms::plan {

/// Which transport the plan is for; it decides which descriptors are produced and whether the
/// 16-byte alignment rule applies.
enum class Path {
  kPeerToPeer,  ///< This rank writes straight into every peer's output buffer (NVLink).
  kCollective,  ///< Pack, one all_to_all_v, unpack (any backend; no alignment rule).
};

/// One pitched byte copy, up to three dimensions. It copies, for z < depth and y < height,
/// `width` bytes from src + src_offset + z * src_slice_pitch + y * src_pitch
///            to   dst + dst_offset + z * dst_slice_pitch + y * dst_pitch.
///
/// NOTE [copy descriptor invariants]: a non-empty descriptor always has width > 0, height > 0,
/// depth > 0, pitch >= width, slice_pitch >= pitch * height, and slice_pitch a multiple of pitch
/// (so it maps onto one cudaMemcpy3DAsync: slice_pitch / pitch is the y-extent). Descriptors are
/// normalized: depth is folded into height when the slices are evenly spaced, and rows are folded
/// into one flat run when both sides are contiguous, so a flat copy has height == depth == 1. An
/// empty descriptor is all zeros. Offsets and sizes are in bytes.
struct CopyDesc {
  int64_t src_offset = 0;       ///< First byte read, relative to the source buffer.
  int64_t src_pitch = 0;        ///< Bytes between consecutive source rows.
  int64_t src_slice_pitch = 0;  ///< Bytes between consecutive source slices.
  int64_t dst_offset = 0;       ///< First byte written, relative to the destination buffer.
  int64_t dst_pitch = 0;        ///< Bytes between consecutive destination rows.
  int64_t dst_slice_pitch = 0;  ///< Bytes between consecutive destination slices.
  int64_t width = 0;            ///< Bytes per row.
  int64_t height = 0;           ///< Rows per slice.
  int64_t depth = 0;            ///< Slices.

  /// Bytes this descriptor moves.
  int64_t bytes() const noexcept { return width * height * depth; }
  /// True when nothing is copied.
  bool empty() const noexcept { return bytes() == 0; }
  /// One past the last source byte touched (0 when empty).
  int64_t src_extent() const noexcept;
  /// One past the last destination byte touched (0 when empty).
  int64_t dst_extent() const noexcept;
  bool operator==(const CopyDesc&) const = default;
};

/// The arguments of one Ulysses all-to-all as a rank sees them.
struct UlyssesRequest {
  int world_size = 1;              ///< Ranks in the group (>= 1).
  int rank = 0;                    ///< This rank, in [0, world_size).
  int mode = 0;                    ///< 0: scatter heads, gather sequence. 1: the inverse.
  std::array<int64_t, 4> shape{};  ///< This rank's input x: (b, s, n, d).
  int64_t element_size = 0;        ///< Bytes per element: 1, 2, 4 or 8.
  /// Per-rank sequence shards; nullopt (with head_splits nullopt) means even shards.
  std::optional<std::vector<int64_t>> seq_splits;
  /// Per-rank head shards; given exactly when seq_splits is.
  std::optional<std::vector<int64_t>> head_splits;
  /// Virtual heads per x head (NOTE [kv replicas]); 1 for ordinary calls.
  int64_t kv_replicas = 1;
  Path path = Path::kPeerToPeer;          ///< Which descriptors to produce.
  std::string op_name = "all_to_all_4d";  ///< Used in error messages.
  std::string comm_name;                  ///< Communicator name for messages (may be empty).
};

/// Everything a transport needs to run one Ulysses all-to-all on one rank.
struct UlyssesPlan {
  int world_size = 1;
  int rank = 0;
  int mode = 0;
  Path path = Path::kPeerToPeer;
  int64_t element_size = 0;
  int64_t b = 0;                       ///< Batch.
  int64_t d = 0;                       ///< Head dimension.
  int64_t seq_total = 0;               ///< S, the global sequence length.
  int64_t heads_total = 0;             ///< N, the global (virtual) head count.
  int64_t kv_replicas = 1;             ///< NOTE [kv replicas]; N / kv_replicas source heads.
  std::vector<int64_t> seq_splits;     ///< Resolved (even shards filled in).
  std::vector<int64_t> head_splits;    ///< Resolved (even shards filled in).
  std::vector<int64_t> seq_offsets;    ///< Exclusive prefix sums of seq_splits.
  std::vector<int64_t> head_offsets;   ///< Exclusive prefix sums of head_splits.
  std::array<int64_t, 4> in_shape{};   ///< This rank's input shape.
  std::array<int64_t, 4> out_shape{};  ///< This rank's output shape.
  int64_t in_bytes = 0;                ///< Bytes of this rank's input.
  int64_t out_bytes = 0;               ///< Bytes of this rank's output.
  int64_t max_out_bytes = 0;           ///< Largest output over all ranks (window sizing).
  /// Hash of the global geometry (world size, mode, b, d, element size, both splits). Equal on
  /// every rank of a consistent call; a transport compares it across ranks to catch mismatches.
  uint64_t geometry_key = 0;

  /// Peer-to-peer path: puts[q] copies this rank's input into peer q's output (q == rank is the
  /// local share). Source offsets are relative to this rank's input, destination offsets to
  /// peer q's output. Empty for the collective path.
  std::vector<CopyDesc> puts;

  /// Collective path: pack[q] copies input into the send buffer (chunk for peer q, contiguous
  /// at send_displs[q] elements). Empty for the peer-to-peer path.
  std::vector<CopyDesc> pack;
  /// Collective path: unpack[p] copies the chunk received from peer p (at recv_displs[p]
  /// elements in the receive buffer) into the output.
  std::vector<CopyDesc> unpack;
  std::vector<int64_t> send_counts;  ///< Elements sent to each peer (all_to_all_v).
  std::vector<int64_t> send_displs;  ///< Element offset of each peer's chunk in the send buffer.
  std::vector<int64_t> recv_counts;  ///< Elements received from each peer.
  std::vector<int64_t> recv_displs;  ///< Element offset of each peer's chunk in the recv buffer.
  int64_t send_elems = 0;            ///< Send buffer size in elements (== input elements).
  int64_t recv_elems = 0;            ///< Receive buffer size in elements (== output elements).
};

/// Validates `req` and produces its plan. Throws fastcomms::Error(kInvalidArgument) with a
/// message of the form "[rank r/P] op: what, expected, got" on any bad argument.
/// @param req the call as this rank sees it
UlyssesPlan make_ulysses_plan(const UlyssesRequest& req);

/// The output shape of a call, validated like make_ulysses_plan (no descriptors are built).
std::array<int64_t, 4> ulysses_output_shape(const UlyssesRequest& req);

/// Splits `desc` into at most `parts` non-empty descriptors that together copy exactly the same
/// bytes (by slices when there are enough, else by rows, else a flat run by byte ranges), so that
/// several copy engines can share one transfer. Each part keeps NOTE [copy descriptor
/// invariants] except that it is not re-folded.
std::vector<CopyDesc> split_desc(const CopyDesc& desc, int parts);

/// Runs one descriptor with memcpy over host memory.
/// @param desc the copy
/// @param src base of the source buffer (desc.src_offset is relative to it)
/// @param dst base of the destination buffer
void copy_host(const CopyDesc& desc, const void* src, void* dst);

/// Human-readable one-line form of a descriptor, for logs and the demo.
std::string to_string(const CopyDesc& desc);

}  // namespace fastcomms::plan
