// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The Ulysses all-to-all over any communicator: the collective path (pack with plan/'s
/// descriptors, one all_to_all_v_single, unpack). CPU tensors are packed with memcpy.

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "fastcomms/core/communicator.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"

namespace fastcomms {

/// Arguments of one Ulysses call besides the tensors.
struct UlyssesArgs {
  int mode = 0;                                     ///< 0 or 1 (see ulysses_plan.hpp).
  std::optional<std::vector<int64_t>> seq_splits;   ///< Per-rank sequence shards, or even.
  std::optional<std::vector<int64_t>> head_splits;  ///< Per-rank head shards, or even.
  bool async_op = false;                            ///< Return before completion.
  bool check_agreement = true;  ///< Compare the call across ranks first (one small all_gather).
};

/// The plan request of one call on a group: x's shape and element size, the call's mode and
/// splits, this rank and the group size. Checks that x is a contiguous 4-D tensor first.
plan::UlyssesRequest ulysses_request(const TensorView& x, const UlyssesArgs& args, int rank,
                                     int size, const std::string& comm_name, plan::Path path);

/// Plans by geometry (and rank), bounded; shared by every transport of the Ulysses op.
class UlyssesPlanCache {
 public:
  /// The plan of `req`, made on first use. Thread-safe.
  std::shared_ptr<const plan::UlyssesPlan> get(const plan::UlyssesRequest& req);

 private:
  using Key = std::tuple<int, int, int, int, std::array<int64_t, 4>, int64_t, std::vector<int64_t>,
                         std::vector<int64_t>, bool>;
  std::mutex mu_;
  std::map<Key, std::shared_ptr<const plan::UlyssesPlan>> plans_;
};

/// A grow-only host staging buffer (uninitialized).
struct UlyssesScratch {
  std::unique_ptr<std::byte[]> data;
  int64_t size = 0;
};

/// The Ulysses all-to-all of API.md §2 on the collective path.
class UlyssesGroup {
 public:
  /// @param comm the group's communicator (kept alive by the group)
  explicit UlyssesGroup(std::shared_ptr<Communicator> comm);

  /// The output shape of a call on this rank; validates like the call itself.
  std::array<int64_t, 4> output_shape(const TensorView& x, const UlyssesArgs& args) const;

  /// Runs the exchange: `out` must be contiguous with output_shape(x, args) and x's dtype.
  /// With args.async_op the returned Work finishes the unpack inside wait().
  WorkPtr all_to_all_4d(const TensorView& x, const TensorView& out, const UlyssesArgs& args);

  /// The communicator.
  const std::shared_ptr<Communicator>& comm() const { return comm_; }

 private:
  plan::UlyssesRequest request(const TensorView& x, const UlyssesArgs& args) const;
  std::shared_ptr<UlyssesScratch> scratch(std::shared_ptr<UlyssesScratch>& pool, int64_t bytes);

  std::shared_ptr<Communicator> comm_;
  std::mutex mu_;
  UlyssesPlanCache plans_;
  std::shared_ptr<UlyssesScratch> send_pool_, recv_pool_;
};

}  // namespace fastcomms
