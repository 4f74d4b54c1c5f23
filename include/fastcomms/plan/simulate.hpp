// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Host replay of a whole world's Ulysses plans with memcpy: every rank is planned, every
/// descriptor is bounds-checked, and every output byte must be written exactly once. The tests,
/// the fuzzer and the demo run plans through this; the reference (reference.hpp) judges them.

#include <cstdint>
#include <string>
#include <vector>

#include "fastcomms/plan/reference.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"

namespace fastcomms::plan {

/// A whole simulated call: the global geometry every rank agrees on.
struct WorldSpec {
  int world_size = 1;
  int mode = 0;
  int64_t b = 1;
  int64_t d = 1;
  int64_t element_size = 1;
  std::vector<int64_t> seq_splits;   ///< Per-rank sequence shards (size world_size).
  std::vector<int64_t> head_splits;  ///< Per-rank head shards (size world_size).
  bool pass_splits = true;           ///< false: plan with even shards (splits left out).
  int64_t kv_replicas = 1;           ///< NOTE [kv replicas]: head_splits count virtual heads.

  /// Rank r's input shape for this mode.
  std::array<int64_t, 4> input_shape(int r) const;
  /// Rank r's request for `path`.
  UlyssesRequest request(int r, Path path) const;
};

/// The outcome of a replay: outputs per rank, and an empty error when every check held.
struct SimResult {
  RankBuffers outputs;
  std::string error;  ///< First broken rule, or empty.
  std::vector<UlyssesPlan> plans;
};

/// Plans every rank for `path`, replays the descriptors over `inputs` (outputs start filled with
/// `poison`), and checks bounds, send/receive agreement and exactly-once coverage.
SimResult simulate_world(const WorldSpec& spec, Path path, const RankBuffers& inputs,
                         unsigned char poison);

/// Checks NOTE [copy descriptor invariants] for one descriptor; empty string when it holds.
std::string check_desc_invariants(const CopyDesc& c);

}  // namespace fastcomms::plan
