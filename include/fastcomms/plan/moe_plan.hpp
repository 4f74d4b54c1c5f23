// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// NOTE [moe plan kernels]: the routing plan of the MoE device transport
/// (python/fastcomms/_moe_device.py, NOTE [moe device transport]) in three steps of kernels
/// instead of some 700 torch ops, so an eager dispatch costs a handful of launches on the host.
/// The results are those of the torch plan in the same file, field for field (the GPU test
/// compares the two on random routing), so the rows, their order and every refusal stay bit for
/// bit the collective transport's:
/// - home: the verdict on topk_idx (overflow, an expert out of range, an expert twice in a
///   token: the first one in flat order, as the collective transport reports it), each slot's
///   owner rank and local expert, the packed rows to send (by destination rank, then token: a
///   token goes once to each rank) and the (P, 5) counts header;
/// - send: after the header exchange, the verdict of every rank (a refusal anywhere: nothing
///   moves, `flags` records the first), the splits both ways, the home slots' places in the
///   returning rows (by owner rank, then flat slot) and each sent row's metadata (source
///   position, scale bits, k local experts or -1, k weight bits) written beside its bytes;
/// - expert: from the received metadata, the (row, slot) pairs of this rank's experts stably
///   sorted by local expert (NOTE [moe row order]), per-expert counts, each grouped row's source
///   rank and position, weight and scale, and the rows in arrival order (the combine's send).
/// At the heart of each is a stable counting sort over many blocks: each block of 1024 counts
/// the keys of its tile of elements, one block scans those counts (key-major, then block), and
/// each block places its tile, a warp ranking equal keys with match.any and the warps before it
/// adding theirs, so the order within a key is the flat order, as torch's stable argsort gives
/// it. The work per element that needs no order (each slot's key and verdict, the sent rows'
/// metadata, the grouped rows' weights, sources and scales) runs in grid kernels beside it.
/// The keys are ranks (home, send) or local experts (expert): at most kMoePlanMaxKeys.
///
/// Plain structs of device pointers (all contiguous) and sizes, shared by core (checks) and
/// cuda (kernels). Sizes: T tokens, k slots, P ranks, L local experts, S = T * min(k, P) send
/// rows, R receive rows, C capacity (grouped rows).

#include <cstdint>

namespace fastcomms::plan {

/// The most keys (ranks or local experts) a plan kernel sorts by (its shared memory).
inline constexpr int64_t kMoePlanMaxKeys = 1024;
/// Header fields per (sender, receiver): count, status, tokens, bad expert, token.
inline constexpr int64_t kMoeHeader = 5;

/// The elements one block of the sort takes (its threads).
inline constexpr int64_t kMoeSortTile = 1024;
/// The blocks a sort of n elements runs.
inline constexpr int64_t moe_sort_blocks(int64_t n) {
  return (n + kMoeSortTile - 1) / kMoeSortTile;
}
/// The int32 scratch of a plan step over n elements sorted by `keys` keys: four words (the
/// verdict, a flag), each element's key, the per-block counts of each key and of keyed elements,
/// the per-key counts and their total.
inline constexpr int64_t moe_plan_scratch(int64_t n, int64_t keys) {
  return 4 + n + (keys + 1) * moe_sort_blocks(n) + (keys + 1);
}

struct MoePlanHome {
  const int64_t* idx = nullptr;  // (T, k) expert ids, -1 dropped
  int64_t tokens = 0, k = 0, ranks = 0, local_experts = 0, num_experts = 0, max_tokens = 0;
  int64_t overflow_bit = 0, bad_expert_bit = 0, duplicate_bit = 0;  // the status codes
  int64_t* owner = nullptr;                                         // (T * k) rank or -1
  int64_t* local = nullptr;                                         // (T * k) local expert or -1
  int64_t* send_tok = nullptr;   // (S) token of each packed row, 0 past the rows in use
  int64_t* send_dest = nullptr;  // (S) its rank
  int64_t send_rows = 0;         // S
  int64_t* head = nullptr;       // (P, kMoeHeader)
  int32_t* scratch = nullptr;    // moe_plan_scratch(T * k, P) int32 (8-byte aligned)
};

struct MoePlanSend {
  const int64_t* got = nullptr;   // (P, kMoeHeader) every peer's header row for this rank
  const int64_t* head = nullptr;  // (P, kMoeHeader) this rank's own header
  int64_t* owner = nullptr;       // (T * k) set to -1 everywhere when a rank refused
  const int64_t* local = nullptr;
  const int64_t* send_tok = nullptr;
  const int64_t* send_dest = nullptr;
  const float* scales = nullptr;   // (T) or null (scale bits 0)
  const float* weights = nullptr;  // (T, k) or null (ones)
  int64_t tokens = 0, k = 0, ranks = 0, send_rows = 0;
  int64_t* flags = nullptr;        // (5) the first refusal, kept once set
  unsigned char* meta = nullptr;   // row i's (2 + 2k) int32 at meta + i * meta_pitch
  int64_t meta_pitch = 0;          // bytes
  int64_t* send_splits = nullptr;  // (P)
  int64_t* recv_splits = nullptr;  // (P)
  int64_t* back_splits = nullptr;  // (P) slots returning from each rank
  int64_t* slot_src = nullptr;     // (T * k) the slot's returning row, or -1
  int64_t* send_total = nullptr;   // (1)
  int32_t* scratch = nullptr;      // moe_plan_scratch(T * k, P) int32 (8-byte aligned)
};

struct MoePlanExpert {
  const unsigned char* meta = nullptr;  // row r's (2 + 2k) int32 at meta + r * meta_pitch
  int64_t meta_pitch = 0;
  int64_t recv_rows = 0;                 // R
  const int64_t* recv_splits = nullptr;  // (P)
  int64_t ranks = 0, k = 0, local_experts = 0, capacity = 0;
  int32_t* counts = nullptr;     // (L)
  int64_t* row_tok = nullptr;    // (C) received row of each grouped row, 0 past the rows in use
  int64_t* row_slot = nullptr;   // (C)
  bool* row_keep = nullptr;      // (C)
  int64_t* back_rows = nullptr;  // (C) grouped row of each pair in arrival order
  int64_t* rows_from = nullptr;  // (P)
  int64_t* row_total = nullptr;  // (1)
  float* row_w = nullptr;        // (C)
  int64_t* src = nullptr;        // (C, 2) source rank and position, -1 past the rows in use
  float* row_scales = nullptr;   // (C) or null
  int32_t* scratch = nullptr;    // moe_plan_scratch(R * k, L) int32 (8-byte aligned)
};

}  // namespace fastcomms::plan
