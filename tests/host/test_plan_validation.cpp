// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Every validation rule of the plan, with its exact message.
#include <gtest/gtest.h>

#include <limits>

#include "fastcomms/error.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"

namespace fastcomms::plan {
namespace {

UlyssesRequest base() {
  UlyssesRequest r;
  r.world_size = 4;
  r.rank = 3;
  r.mode = 0;
  r.shape = {1, 16, 40, 128};
  r.element_size = 2;
  return r;
}

void expect_rejected(const UlyssesRequest& req, const std::string& message) {
  try {
    make_ulysses_plan(req);
    ADD_FAILURE() << "accepted; expected: " << message;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(std::string(e.what()), message);
  }
  // The shape query validates the same way.
  EXPECT_THROW(ulysses_output_shape(req), Error);
}

TEST(PlanValidation, BaseIsAccepted) { EXPECT_NO_THROW(make_ulysses_plan(base())); }

TEST(PlanValidation, WorldAndRank) {
  auto r = base();
  r.world_size = 0;
  r.rank = 0;
  expect_rejected(r, "[rank 0/0] all_to_all_4d: world_size must be >= 1, got 0");
  r = base();
  r.rank = 4;
  expect_rejected(r, "[rank 4/4] all_to_all_4d: rank must be in [0, 4), got 4");
  r.rank = -1;
  expect_rejected(r, "[rank -1/4] all_to_all_4d: rank must be in [0, 4), got -1");
}

TEST(PlanValidation, ModeAndElementSize) {
  auto r = base();
  r.mode = 2;
  expect_rejected(r, "[rank 3/4] all_to_all_4d: mode must be 0 or 1, got 2");
  r = base();
  r.element_size = 3;
  expect_rejected(r, "[rank 3/4] all_to_all_4d: element size must be 1, 2, 4 or 8 bytes, got 3");
}

TEST(PlanValidation, NegativeDimension) {
  auto r = base();
  r.shape[3] = -128;
  expect_rejected(r, "[rank 3/4] all_to_all_4d: x.size(3) must be >= 0, got -128");
}

TEST(PlanValidation, OneSplitWithoutTheOther) {
  auto r = base();
  r.seq_splits = std::vector<int64_t>{16, 16, 16, 16};
  expect_rejected(r,
                  "[rank 3/4] all_to_all_4d: seq_splits and head_splits must be given together, "
                  "got seq_splits only");
  r = base();
  r.head_splits = std::vector<int64_t>{10, 10, 10, 10};
  expect_rejected(r,
                  "[rank 3/4] all_to_all_4d: seq_splits and head_splits must be given together, "
                  "got head_splits only");
}

TEST(PlanValidation, WrongLength) {
  auto r = base();
  r.seq_splits = std::vector<int64_t>{16, 16, 16};
  r.head_splits = std::vector<int64_t>{10, 10, 10, 10};
  expect_rejected(r, "[rank 3/4] all_to_all_4d: seq_splits must have world_size=4 entries, got 3");
  r.seq_splits = std::vector<int64_t>{16, 16, 16, 16};
  r.head_splits = std::vector<int64_t>{10, 10, 10, 5, 5};
  expect_rejected(r, "[rank 3/4] all_to_all_4d: head_splits must have world_size=4 entries, got 5");
}

TEST(PlanValidation, NegativeSplit) {
  auto r = base();
  r.seq_splits = std::vector<int64_t>{16, -1, 17, 16};
  r.head_splits = std::vector<int64_t>{10, 10, 10, 10};
  expect_rejected(r, "[rank 3/4] all_to_all_4d: seq_splits[1] must be >= 0, got -1");
  r.seq_splits = std::vector<int64_t>{16, 16, 16, 16};
  r.head_splits = std::vector<int64_t>{10, 10, 21, -1};
  expect_rejected(r, "[rank 3/4] all_to_all_4d: head_splits[3] must be >= 0, got -1");
}

TEST(PlanValidation, SplitsDoNotMatchTheShape) {
  auto r = base();
  r.seq_splits = std::vector<int64_t>{16, 16, 16, 16};
  r.head_splits = std::vector<int64_t>{10, 10, 10, 8};
  expect_rejected(r, "[rank 3/4] all_to_all_4d: head_splits sums to 38, x.size(2) is 40");
  r.head_splits = std::vector<int64_t>{10, 10, 10, 10};
  r.seq_splits = std::vector<int64_t>{16, 16, 16, 12};
  expect_rejected(r,
                  "[rank 3/4] all_to_all_4d: seq_splits[3] is 12, x.size(1) is 16 (mode 0 takes "
                  "this rank's sequence shard)");
  r = base();
  r.mode = 1;
  r.shape = {1, 64, 10, 128};
  r.seq_splits = std::vector<int64_t>{16, 16, 16, 15};
  r.head_splits = std::vector<int64_t>{10, 10, 10, 10};
  expect_rejected(r, "[rank 3/4] all_to_all_4d: seq_splits sums to 63, x.size(1) is 64");
  r.seq_splits = std::vector<int64_t>{16, 16, 16, 16};
  r.head_splits = std::vector<int64_t>{10, 10, 10, 9};
  expect_rejected(r,
                  "[rank 3/4] all_to_all_4d: head_splits[3] is 9, x.size(2) is 10 (mode 1 takes "
                  "this rank's head shard)");
}

TEST(PlanValidation, ScatteredAxisNotDivisible) {
  auto r = base();
  r.world_size = 3;
  r.rank = 1;
  expect_rejected(r,
                  "[rank 1/3] all_to_all_4d: mode 0 scatters heads: x.size(2)=40 is not divisible "
                  "by world_size=3; pass seq_splits and head_splits for uneven shards");
  r.mode = 1;
  r.shape = {1, 100, 13, 128};
  expect_rejected(r,
                  "[rank 1/3] all_to_all_4d: mode 1 scatters the sequence: x.size(1)=100 is not "
                  "divisible by world_size=3; pass seq_splits and head_splits for uneven shards");
}

TEST(PlanValidation, AlignmentOnlyForPeerToPeer) {
  auto r = base();
  r.shape[3] = 12;  // 24 bytes per row
  expect_rejected(r,
                  "[rank 3/4] all_to_all_4d: the peer-to-peer path needs d * element_size to be "
                  "a multiple of 16 bytes, got d=12 * 2 = 24 bytes; use the collective transport "
                  "for this shape");
  r.path = Path::kCollective;
  EXPECT_NO_THROW(make_ulysses_plan(r));
}

TEST(PlanValidation, EveryShardEmpty) {
  auto r = base();
  r.shape[1] = 0;
  expect_rejected(r,
                  "[rank 3/4] all_to_all_4d: every shard is empty: b=1, s_global=0, n_global=40, "
                  "d=128; nothing to exchange");
  r = base();
  r.seq_splits = std::vector<int64_t>{0, 0, 0, 16};
  r.head_splits = std::vector<int64_t>{0, 0, 0, 0};
  r.shape[2] = 0;
  expect_rejected(r,
                  "[rank 3/4] all_to_all_4d: every shard is empty: b=1, s_global=16, n_global=0, "
                  "d=128; nothing to exchange");
  // One empty shard among non-empty ones is fine.
  r.head_splits = std::vector<int64_t>{0, 40, 0, 0};
  r.shape[2] = 40;
  EXPECT_NO_THROW(make_ulysses_plan(r));
}

TEST(PlanValidation, Overflow) {
  const int64_t big = std::numeric_limits<int64_t>::max() / 2;
  auto r = base();
  r.shape = {1 << 20, 1 << 20, 1 << 20, 1 << 10};
  r.world_size = 1;
  r.rank = 0;
  expect_rejected(r,
                  "[rank 0/1] all_to_all_4d: the global tensor's byte count overflows 64 bits: "
                  "b=1048576 * s_global=1048576 * n_global=1048576 * d=1024 * element_size=2");
  r = base();
  r.shape[1] = big;
  expect_rejected(r, "[rank 3/4] all_to_all_4d: global sequence length x.size(1) * world_size = " +
                         std::to_string(big) + " * 4 overflows 64 bits");
  r = base();
  r.seq_splits = std::vector<int64_t>{big, big, big, 16};
  r.head_splits = std::vector<int64_t>{10, 10, 10, 10};
  expect_rejected(r, "[rank 3/4] all_to_all_4d: seq_splits sum overflows 64 bits: [" +
                         std::to_string(big) + ", " + std::to_string(big) + ", " +
                         std::to_string(big) + ", 16]");
}

TEST(PlanValidation, OpNameInMessages) {
  auto r = base();
  r.op_name = "ulysses.backward";
  r.mode = 5;
  expect_rejected(r, "[rank 3/4] ulysses.backward: mode must be 0 or 1, got 5");
}

}  // namespace
}  // namespace fastcomms::plan
