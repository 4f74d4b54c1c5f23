// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Replays the plan's descriptors for every rank of simulated worlds and compares byte for byte
// with the naive permute -> all_to_all_single -> permute reference.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "fastcomms/error.hpp"
#include "fastcomms/plan/reference.hpp"
#include "fastcomms/plan/simulate.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"

namespace fastcomms::plan {
namespace {

uint64_t test_seed() {
  if (const char* s = std::getenv("FASTCOMMS_SEED")) return std::strtoull(s, nullptr, 10);
  return std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32);
}

RankBuffers random_inputs(const WorldSpec& spec, std::mt19937_64& rng) {
  RankBuffers in(spec.world_size);
  for (int r = 0; r < spec.world_size; ++r) {
    const auto s = spec.input_shape(r);
    in[r].resize(static_cast<size_t>(s[0] * s[1] * s[2] * s[3] * spec.element_size));
    for (auto& byte : in[r]) byte = static_cast<std::byte>(rng());
  }
  return in;
}

std::string describe(const WorldSpec& s) {
  std::string out = detail::cat("world=", s.world_size, " mode=", s.mode, " b=", s.b, " d=", s.d,
                                " e=", s.element_size, " splits=", s.pass_splits, " seq=[");
  for (auto v : s.seq_splits) out += detail::cat(v, ",");
  out += "] heads=[";
  for (auto v : s.head_splits) out += detail::cat(v, ",");
  return out + "]";
}

WorldSpec random_spec(std::mt19937_64& rng) {
  static constexpr int kWorlds[] = {1, 2, 3, 4, 5, 7, 8, 16};
  static constexpr int64_t kElem[] = {1, 2, 4, 8};
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  WorldSpec s;
  s.world_size = kWorlds[pick(0, 7)];
  s.mode = static_cast<int>(pick(0, 1));
  s.element_size = kElem[pick(0, 3)];
  s.b = pick(1, 4);
  const int64_t granule = std::max<int64_t>(1, 16 / s.element_size);
  // Mostly 16-byte rows (both paths run); sometimes any d (collective only).
  s.d = pick(0, 9) < 7 ? granule * pick(1, 3) : pick(1, 9);
  const int P = s.world_size;
  const int64_t max_s = P >= 8 ? 5 : 9, max_h = P >= 8 ? 3 : 6;
  if (pick(0, 9) < 3) {  // even shards
    s.seq_splits.assign(P, pick(1, max_s));
    s.head_splits.assign(P, pick(1, max_h));
    s.pass_splits = pick(0, 1) == 0;
  } else {  // uneven, with empty shards
    for (int i = 0; i < P; ++i) {
      s.seq_splits.push_back(pick(0, 3) == 0 ? 0 : pick(1, max_s));
      s.head_splits.push_back(pick(0, 3) == 0 ? 0 : pick(1, max_h));
    }
    s.seq_splits[pick(0, P - 1)] += 1;  // keep the global tensor non-empty
    s.head_splits[pick(0, P - 1)] += 1;
  }
  return s;
}

TEST(PlanReference, HandComputedTwoRanks) {
  // x_0 = [[a0 a1] [a2 a3]], x_1 = [[b0 b1] [b2 b3]] as (b=1, s=2, n=2, d=1).
  RankBuffers in = {{std::byte{0xa0}, std::byte{0xa1}, std::byte{0xa2}, std::byte{0xa3}},
                    {std::byte{0xb0}, std::byte{0xb1}, std::byte{0xb2}, std::byte{0xb3}}};
  RankBuffers out = reference_all_to_all_4d(0, 1, 1, 1, {2, 2}, {1, 1}, in);
  RankBuffers want = {{std::byte{0xa0}, std::byte{0xa2}, std::byte{0xb0}, std::byte{0xb2}},
                      {std::byte{0xa1}, std::byte{0xa3}, std::byte{0xb1}, std::byte{0xb3}}};
  EXPECT_EQ(out, want);
  EXPECT_EQ(reference_all_to_all_4d(1, 1, 1, 1, {2, 2}, {1, 1}, out), in);
}

TEST(PlanReplay, RandomGeometriesMatchReference) {
  const uint64_t seed = test_seed();
  std::printf("[plan replay] seed %llu (set FASTCOMMS_SEED to replay)\n",
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  const int kGeometries = 2500;
  int p2p = 0, coll = 0, trips = 0, rejected_alignment = 0, mismatches = 0;
  for (int g = 0; g < kGeometries && mismatches == 0; ++g) {
    const WorldSpec spec = random_spec(rng);
    const RankBuffers in = random_inputs(spec, rng);
    const RankBuffers want = reference_all_to_all_4d(spec.mode, spec.b, spec.d, spec.element_size,
                                                     spec.seq_splits, spec.head_splits, in);
    const bool aligned = (spec.d * spec.element_size) % 16 == 0;
    const unsigned char poison = static_cast<unsigned char>(rng());
    for (Path path : {Path::kPeerToPeer, Path::kCollective}) {
      if (path == Path::kPeerToPeer && !aligned) {
        EXPECT_THROW(make_ulysses_plan(spec.request(0, path)), Error) << describe(spec);
        ++rejected_alignment;
        continue;
      }
      SimResult res = simulate_world(spec, path, in, poison);
      const char* name = path == Path::kPeerToPeer ? "p2p" : "collective";
      if (!res.error.empty() || res.outputs != want) {
        ++mismatches;
        ADD_FAILURE() << name << " mismatch (" << res.error << ") for " << describe(spec);
        break;
      }
      ++(path == Path::kPeerToPeer ? p2p : coll);
      // Round trip: the other mode with the same splits gives the input back.
      WorldSpec inv = spec;
      inv.mode = 1 - spec.mode;
      SimResult back = simulate_world(inv, path, res.outputs, static_cast<unsigned char>(~poison));
      if (!back.error.empty() || back.outputs != in) {
        ++mismatches;
        ADD_FAILURE() << name << " round trip failed (" << back.error << ") for " << describe(spec);
        break;
      }
      ++trips;
    }
  }
  std::printf(
      "[plan replay] %d geometries: %d peer-to-peer and %d collective replays bit-exact, %d round "
      "trips, %d unaligned rejected, %d mismatches\n",
      kGeometries, p2p, coll, trips, rejected_alignment, mismatches);
  EXPECT_EQ(mismatches, 0);
  EXPECT_GE(p2p + coll, kGeometries);
}

// NOTE [kv replicas]: mode 0 with R equals repeat_interleave(R) then the ordinary call, and mode
// 1 with R is the ordinary exchange of the virtual heads; random worlds, both paths.
TEST(PlanReplay, KvReplicasMatchRepeatThenCall) {
  const uint64_t seed = test_seed();
  std::printf("[kv replicas] seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int checked = 0, rejected = 0;
  for (int iter = 0; iter < 600; ++iter) {
    WorldSpec spec;
    spec.world_size = static_cast<int>(pick(1, 8));
    const int P = spec.world_size;
    spec.mode = static_cast<int>(pick(0, 1));
    spec.element_size = int64_t{1} << pick(0, 3);
    spec.b = pick(1, 3);
    spec.d = (16 / spec.element_size) * pick(1, 2);
    for (int i = 0; i < P; ++i) spec.seq_splits.push_back(pick(0, 4));
    spec.seq_splits[pick(0, P - 1)] += 1;
    if (pick(0, 1) == 0) {  // GQA/MQA: h source heads with h | P, one virtual head per rank
      std::vector<int64_t> divisors;
      for (int64_t h = 1; h <= P; ++h)
        if (P % h == 0) divisors.push_back(h);
      const int64_t h = divisors[pick(0, static_cast<int64_t>(divisors.size()) - 1)];
      spec.kv_replicas = P / h;
      spec.head_splits.assign(P, 1);
      spec.pass_splits = pick(0, 1) == 0;
      if (!spec.pass_splits) spec.seq_splits.assign(P, pick(1, 4));  // even shards
    } else {  // any R and virtual splits; keep those with distinct source heads per rank
      spec.kv_replicas = pick(1, 4);
      for (int i = 0; i < P; ++i) spec.head_splits.push_back(pick(0, 2));
      int64_t n = 0;
      for (int64_t v : spec.head_splits) n += v;
      spec.head_splits[P - 1] += (spec.kv_replicas - n % spec.kv_replicas) % spec.kv_replicas;
      if (n == 0) spec.head_splits[0] += spec.kv_replicas;
      bool distinct = true;
      int64_t off = 0;
      for (int64_t v : spec.head_splits) {
        if (v > 0 && (off + v - 1) / spec.kv_replicas - off / spec.kv_replicas != v - 1)
          distinct = false;
        off += v;
      }
      if (!distinct) {
        EXPECT_THROW(make_ulysses_plan(spec.request(0, Path::kCollective)), Error)
            << describe(spec) << " R=" << spec.kv_replicas;
        ++rejected;
        continue;
      }
    }
    const RankBuffers in = random_inputs(spec, rng);
    const RankBuffers want = reference_all_to_all_4d(
        spec.mode, spec.b, spec.d, spec.element_size, spec.seq_splits, spec.head_splits,
        spec.mode == 0 ? repeat_interleave_heads(in, spec.input_shape(0)[2], spec.d,
                                                 spec.element_size, spec.kv_replicas)
                       : in);
    for (Path path : {Path::kPeerToPeer, Path::kCollective}) {
      SimResult res = simulate_world(spec, path, in, static_cast<unsigned char>(rng()));
      ASSERT_TRUE(res.error.empty())
          << res.error << " " << describe(spec) << " R=" << spec.kv_replicas;
      ASSERT_EQ(res.outputs, want) << describe(spec) << " R=" << spec.kv_replicas;
      ++checked;
    }
  }
  std::printf("[kv replicas] %d replays bit-exact, %d duplicate-head geometries rejected\n",
              checked, rejected);
  EXPECT_GT(checked, 400);
}

TEST(PlanValidation, KvReplicasErrorsSayWhat) {
  UlyssesRequest req;
  req.world_size = 4;
  req.rank = 0;
  req.shape = {1, 8, 1, 64};  // MQA: one KV head on 4 ranks
  req.element_size = 2;
  req.kv_replicas = 4;
  EXPECT_EQ(ulysses_output_shape(req), (std::array<int64_t, 4>{1, 32, 1, 64}));
  req.kv_replicas = 8;  // two virtual heads per rank, both copies of head 0
  try {
    make_ulysses_plan(req);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("repeat source head 0"), std::string::npos) << e.what();
  }
  req.kv_replicas = 3;  // 3 virtual heads on 4 ranks
  EXPECT_THROW(make_ulysses_plan(req), Error);
  req.kv_replicas = 0;
  EXPECT_THROW(make_ulysses_plan(req), Error);
  req.mode = 1;  // mode 1: (b, S, 1 virtual head, d) -> (b, s, 4 virtual heads, d) with R=4
  req.kv_replicas = 4;
  req.shape = {1, 32, 1, 64};
  EXPECT_EQ(ulysses_output_shape(req), (std::array<int64_t, 4>{1, 8, 4, 64}));
  req.kv_replicas = 3;  // 4 virtual heads are not a multiple of 3
  EXPECT_THROW(make_ulysses_plan(req), Error);
}

TEST(PlanReplay, FaultyDescriptorIsCaught) {
  // The harness must be able to fail: corrupt one descriptor and the replay has to notice.
  WorldSpec spec;
  spec.world_size = 3;
  spec.mode = 0;
  spec.b = 2;
  spec.d = 8;
  spec.element_size = 2;
  spec.seq_splits = {3, 1, 2};
  spec.head_splits = {2, 2, 1};
  std::mt19937_64 rng(7);
  const RankBuffers in = random_inputs(spec, rng);
  const RankBuffers want =
      reference_all_to_all_4d(0, 2, 8, 2, spec.seq_splits, spec.head_splits, in);
  SimResult good = simulate_world(spec, Path::kPeerToPeer, in, 0x5a);
  ASSERT_TRUE(good.error.empty()) << good.error;
  ASSERT_EQ(good.outputs, want);
  // Shift one row's destination by 16 bytes: a byte goes unwritten, another twice.
  UlyssesPlan bad = good.plans[1];
  bad.puts[2].dst_offset += 16;
  RankBuffers out = good.outputs;
  copy_host(bad.puts[2], in[1].data(), out[2].data());
  EXPECT_NE(out, want);
}

// NOTE [all_to_all_single as a Ulysses call] (backends/nvlink/nvlink_backend.cpp): P equal chunks
// of c bytes per rank, exchanged as Ulysses mode 0 over (1, 1, P, c) bytes, must equal
// all_to_all_single: rank r's output chunk q is rank q's input chunk r. Replayed on the
// peer-to-peer path the nvlink backend uses, for random worlds and chunk sizes.
TEST(PlanReplay, AllToAllSingleAsUlyssesModeZero) {
  std::mt19937_64 rng(test_seed());
  int checked = 0;
  for (int iter = 0; iter < 200; ++iter) {
    const int P = 1 + static_cast<int>(rng() % 8);
    const int64_t c = 16 * (1 + static_cast<int64_t>(rng() % 64));
    WorldSpec spec;
    spec.world_size = P;
    spec.mode = 0;
    spec.b = 1;
    spec.d = c;
    spec.element_size = 1;
    spec.seq_splits.assign(P, 1);
    spec.head_splits.assign(P, 1);
    spec.pass_splits = false;
    const RankBuffers in = random_inputs(spec, rng);
    SimResult res = simulate_world(spec, Path::kPeerToPeer, in, 0xa5);
    ASSERT_TRUE(res.error.empty()) << res.error << " P=" << P << " c=" << c;
    for (int r = 0; r < P; ++r)
      for (int q = 0; q < P; ++q)
        ASSERT_EQ(0, std::memcmp(res.outputs[r].data() + q * c, in[q].data() + r * c,
                                 static_cast<size_t>(c)))
            << "rank " << r << " chunk " << q << " P=" << P << " c=" << c;
    ++checked;
  }
  EXPECT_EQ(checked, 200);
}

TEST(PlanShape, SplitDescCoversTheSameBytes) {
  std::mt19937_64 rng(11);
  int checked = 0;
  for (int trial = 0; trial < 300; ++trial) {
    WorldSpec spec = random_spec(rng);
    if ((spec.d * spec.element_size) % 16 != 0) continue;
    const auto plan = make_ulysses_plan(spec.request(0, Path::kPeerToPeer));
    std::vector<std::byte> src(static_cast<size_t>(plan.in_bytes));
    for (auto& b : src) b = static_cast<std::byte>(rng());
    for (int q = 0; q < spec.world_size; ++q) {
      const CopyDesc& c = plan.puts[q];
      const int64_t dst_size = std::max<int64_t>(c.dst_extent(), 1);
      std::vector<std::byte> whole(static_cast<size_t>(dst_size), std::byte{0x11});
      copy_host(c, src.data(), whole.data());
      for (int parts : {1, 2, 3, 4, 7}) {
        std::vector<std::byte> pieces(whole.size(), std::byte{0x11});
        int64_t bytes = 0;
        const auto split = split_desc(c, parts);
        EXPECT_LE(static_cast<int>(split.size()), std::max(parts, 1) * std::max<int>(1, c.depth));
        for (const CopyDesc& d : split) {
          EXPECT_GT(d.bytes(), 0);
          EXPECT_LE(d.dst_extent(), c.dst_extent());
          bytes += d.bytes();
          copy_host(d, src.data(), pieces.data());
        }
        EXPECT_EQ(bytes, c.bytes());
        ASSERT_EQ(pieces, whole) << "parts " << parts << " " << to_string(c);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 500);
}

TEST(PlanShape, DescriptorsAreCompact) {
  // b == 1: every peer copy is one 2-D pitched copy; a world of one is one flat copy.
  UlyssesRequest req;
  req.world_size = 4;
  req.rank = 1;
  req.shape = {1, 256, 40, 128};
  req.element_size = 2;
  UlyssesPlan p = make_ulysses_plan(req);
  ASSERT_EQ(p.puts.size(), 4u);
  for (const CopyDesc& c : p.puts) {
    EXPECT_EQ(c.depth, 1);
    EXPECT_EQ(c.height, 256);
    EXPECT_EQ(c.width, 10 * 128 * 2);
    EXPECT_EQ(c.src_pitch, 40 * 128 * 2);
    EXPECT_EQ(c.dst_pitch, c.width);
    EXPECT_EQ(c.dst_offset, 256 * 10 * 128 * 2);  // rank 1's sequence block
  }
  EXPECT_EQ(p.out_shape, (std::array<int64_t, 4>{1, 1024, 10, 128}));
  req.world_size = 1;
  req.rank = 0;
  req.shape = {3, 5, 7, 16};
  p = make_ulysses_plan(req);
  EXPECT_EQ(p.puts[0].height, 1);
  EXPECT_EQ(p.puts[0].depth, 1);
  EXPECT_EQ(p.puts[0].bytes(), 3 * 5 * 7 * 16 * 2);
  // b > 1 with several ranks needs the third dimension on the gathered side.
  req.world_size = 2;
  req.rank = 0;
  req.shape = {2, 4, 6, 16};
  p = make_ulysses_plan(req);
  EXPECT_EQ(p.puts[1].depth, 2);
  EXPECT_EQ(p.puts[1].dst_slice_pitch, 8 * 3 * 16 * 2);
}

TEST(PlanShape, OutputShapeAndCounts) {
  UlyssesRequest req;
  req.world_size = 3;
  req.rank = 2;
  req.mode = 1;
  req.shape = {2, 10, 4, 8};
  req.element_size = 4;
  req.seq_splits = std::vector<int64_t>{5, 0, 5};
  req.head_splits = std::vector<int64_t>{1, 2, 4};
  req.path = Path::kCollective;
  EXPECT_EQ(ulysses_output_shape(req), (std::array<int64_t, 4>{2, 5, 7, 8}));
  UlyssesPlan p = make_ulysses_plan(req);
  EXPECT_EQ(p.send_counts, (std::vector<int64_t>{2 * 5 * 4 * 8, 0, 2 * 5 * 4 * 8}));
  EXPECT_EQ(p.recv_counts, (std::vector<int64_t>{2 * 5 * 1 * 8, 2 * 5 * 2 * 8, 2 * 5 * 4 * 8}));
  EXPECT_EQ(p.recv_displs, (std::vector<int64_t>{0, 80, 240}));
  EXPECT_TRUE(p.pack[1].empty());
  EXPECT_EQ(p.pack[1], CopyDesc{});
  EXPECT_EQ(p.send_elems, 2 * 10 * 4 * 8);
  EXPECT_EQ(p.recv_elems, 2 * 5 * 7 * 8);
}

TEST(PlanShape, GeometryKeyTracksTheCall) {
  UlyssesRequest a;
  a.world_size = 2;
  a.shape = {1, 8, 4, 16};
  a.element_size = 2;
  UlyssesRequest b = a;
  b.rank = 1;
  EXPECT_EQ(make_ulysses_plan(a).geometry_key, make_ulysses_plan(b).geometry_key);
  b.element_size = 4;
  EXPECT_NE(make_ulysses_plan(a).geometry_key, make_ulysses_plan(b).geometry_key);
  b = a;
  b.shape[1] = 9;
  EXPECT_NE(make_ulysses_plan(a).geometry_key, make_ulysses_plan(b).geometry_key);
}

}  // namespace
}  // namespace fastcomms::plan
