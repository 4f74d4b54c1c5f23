// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// A naive host reference for the Ulysses all-to-all over a whole simulated world, written the way
/// a PyTorch user computes it today: permute into a send buffer, all_to_all_single with the split
/// sizes the geometry implies, permute the received chunks back. Element by element, sharing no
/// code with the plan, so it can judge the plan's descriptors.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace fastcomms::plan {

/// One byte buffer per rank.
using RankBuffers = std::vector<std::vector<std::byte>>;

/// Runs the reference exchange for every rank at once.
/// @param mode 0 or 1 (see ulysses_plan.hpp)
/// @param b batch
/// @param d head dimension
/// @param element_size bytes per element
/// @param seq_splits every rank's sequence shard
/// @param head_splits every rank's head shard
/// @param inputs inputs[r] holds rank r's x, contiguous, in the shape mode implies
/// @return outputs[r], rank r's result, contiguous
RankBuffers reference_all_to_all_4d(int mode, int64_t b, int64_t d, int64_t element_size,
                                    const std::vector<int64_t>& seq_splits,
                                    const std::vector<int64_t>& head_splits,
                                    const RankBuffers& inputs);

/// `x.repeat_interleave(R, dim=2)` of every rank's (.., heads, d) buffer: what a user
/// materialises before an ordinary call when key/value heads are fewer than ranks (the reference
/// for NOTE [kv replicas]).
RankBuffers repeat_interleave_heads(const RankBuffers& inputs, int64_t heads, int64_t d,
                                    int64_t element_size, int64_t R);

}  // namespace fastcomms::plan
