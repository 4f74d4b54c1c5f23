// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The Ulysses all-to-all on the gloo collective path, bit-exact against the plan reference over
// random geometries (uneven and empty shards included), worlds of 1, 2, 3, 4 and 7 threads.
#include <gtest/gtest.h>

#include <random>

#include "fastcomms/plan/reference.hpp"
#include "fastcomms/ulysses/transport.hpp"
#include "harness.hpp"

namespace fastcomms::test {
namespace {

struct Geometry {
  int mode;
  DType dt;
  int64_t b, d;
  std::vector<int64_t> seq, heads;
  bool pass_splits;
  plan::RankBuffers inputs, want;
  std::array<int64_t, 4> in_shape(int r) const {
    int64_t S = 0, N = 0;
    for (auto v : seq) S += v;
    for (auto v : heads) N += v;
    return mode == 0 ? std::array<int64_t, 4>{b, seq[r], N, d}
                     : std::array<int64_t, 4>{b, S, heads[r], d};
  }
};

std::vector<Geometry> random_geometries(int P, int count, std::mt19937_64& rng) {
  const DType types[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat64,
                         DType::kUInt8,   DType::kInt32,    DType::kFloat8E5M2};
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::vector<Geometry> out;
  while (static_cast<int>(out.size()) < count) {
    Geometry g;
    g.mode = static_cast<int>(pick(0, 1));
    g.dt = types[pick(0, 5)];
    g.b = pick(1, 3);
    g.d = pick(1, 9);
    g.pass_splits = pick(0, 2) != 0;
    for (int r = 0; r < P; ++r) {
      g.seq.push_back(g.pass_splits ? pick(0, 6) : 0);
      g.heads.push_back(g.pass_splits ? pick(0, 4) : 0);
    }
    if (!g.pass_splits) {
      g.seq.assign(P, pick(1, 6));
      g.heads.assign(P, pick(1, 4));
    }
    g.seq[pick(0, P - 1)] += 1;
    g.heads[pick(0, P - 1)] += 1;
    if (!g.pass_splits) {  // even shards must stay even
      g.seq.assign(P, g.seq[0] + 1);
      g.heads.assign(P, g.heads[0] + 1);
    }
    const auto e = static_cast<int64_t>(dtype_size(g.dt));
    for (int r = 0; r < P; ++r) {
      const auto s = g.in_shape(r);
      g.inputs.emplace_back(static_cast<size_t>(s[0] * s[1] * s[2] * s[3] * e));
      for (auto& byte : g.inputs.back()) byte = static_cast<std::byte>(rng());
    }
    g.want = plan::reference_all_to_all_4d(g.mode, g.b, g.d, e, g.seq, g.heads, g.inputs);
    out.push_back(std::move(g));
  }
  return out;
}

TEST(UlyssesGloo, RandomGeometriesBitExact) {
  const char* env_seed = std::getenv("FASTCOMMS_SEED");
  const uint64_t seed = env_seed ? std::strtoull(env_seed, nullptr, 10) : std::random_device{}();
  std::printf("[ulysses gloo] seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  int checked = 0;
  for (int P : {1, 2, 3, 4, 7}) {
    const auto geos = random_geometries(P, 30, rng);
    std::atomic<int> ok{0};
    run_threads(P, [&](Communicator& comm) {
      auto group =
          make_collective_transport(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
      const int r = comm.rank();
      for (size_t gi = 0; gi < geos.size(); ++gi) {
        const Geometry& g = geos[gi];
        std::vector<std::byte> in = g.inputs[r];
        const auto s = g.in_shape(r);
        TensorView x = TensorView::contiguous(in.data(), g.dt, {s[0], s[1], s[2], s[3]});
        UlyssesArgs args;
        args.mode = g.mode;
        args.async_op = gi % 2 == 1;
        if (g.pass_splits) {
          args.seq_splits = g.seq;
          args.head_splits = g.heads;
        }
        const auto os = group->output_shape(x, args);
        HostTensor out(g.dt, std::vector<int64_t>(os.begin(), os.end()));
        auto w = group->all_to_all_4d(x, out.view(), args, nullptr);
        w->wait();
        ASSERT_EQ(out.bytes.size(), g.want[r].size());
        ASSERT_EQ(std::memcmp(out.bytes.data(), g.want[r].data(), out.bytes.size()), 0)
            << "geometry " << gi << " mode " << g.mode << " dtype " << dtype_name(g.dt);
        ASSERT_EQ(in, g.inputs[r]) << "the input was modified";
      }
      ++ok;
    });
    if (ok == P) checked += static_cast<int>(geos.size());
  }
  std::printf("[ulysses gloo] %d geometries bit-exact on every rank\n", checked);
  EXPECT_EQ(checked, 5 * 30);
}

TEST(UlyssesGloo, MismatchedCallsRaiseOnEveryRank) {
  std::atomic<int> raised{0};
  run_threads(3, [&](Communicator& comm) {
    auto group =
        make_collective_transport(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    const int r = comm.rank();
    // Rank 2 believes in different head splits than ranks 0 and 1.
    HostTensor x(DType::kFloat32, std::vector<int64_t>{1, 2 + r, 6, 4});
    UlyssesArgs args;
    args.seq_splits = std::vector<int64_t>{2, 3, 4};
    args.head_splits = r == 2 ? std::vector<int64_t>{1, 2, 3} : std::vector<int64_t>{2, 2, 2};
    const auto os = group->output_shape(x.view(), args);
    HostTensor out(DType::kFloat32, std::vector<int64_t>(os.begin(), os.end()));
    try {
      group->all_to_all_4d(x.view(), out.view(), args, nullptr);
      ADD_FAILURE() << "rank " << r << " accepted a mismatched call";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      const std::string want =
          r == 2 ? "'s global sequence/head splits differ from this rank's" : "rank 2's global";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
      ++raised;
    }
    // Same splits, different dtype on rank 1.
    HostTensor y(r == 1 ? DType::kInt32 : DType::kFloat32, std::vector<int64_t>{1, 2 + r, 6, 4});
    args.head_splits = std::vector<int64_t>{2, 2, 2};
    const auto ys = group->output_shape(y.view(), args);
    HostTensor yout(y.dt, std::vector<int64_t>(ys.begin(), ys.end()));
    try {
      group->all_to_all_4d(y.view(), yout.view(), args, nullptr);
      ADD_FAILURE() << "rank " << r << " accepted a dtype mismatch";
    } catch (const Error& e) {
      const std::string want = r == 1 ? "rank 0 has dtype float32, this rank has int32"
                                      : "rank 1 has dtype int32, this rank has float32";
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  });
  EXPECT_EQ(raised, 3);
}

TEST(UlyssesGloo, ValidationMessages) {
  run_threads(2, [&](Communicator& comm) {
    auto group =
        make_collective_transport(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
    const std::string p = "[rank " + std::to_string(comm.rank()) + "/2 " + comm.name() + "] ";
    HostTensor x(DType::kFloat32, std::vector<int64_t>{1, 4, 6, 8});
    UlyssesArgs args;
    args.seq_splits = std::vector<int64_t>{4, 4};
    args.head_splits = std::vector<int64_t>{3, 2};
    HostTensor out(DType::kFloat32, std::vector<int64_t>{1, 8, 3, 8});
    try {
      group->all_to_all_4d(x.view(), out.view(), args, nullptr);
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), p + "all_to_all_4d: head_splits sums to 5, x.size(2) is 6");
    }
    HostTensor x3(DType::kFloat32, std::vector<int64_t>{4, 6, 8});
    try {
      group->all_to_all_4d(x3.view(), out.view(), UlyssesArgs{}, nullptr);
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()),
                p + "all_to_all_4d: x must be 4-D (b, s, h, d), got float32[4, 6, 8] cpu");
    }
    HostTensor wrong(DType::kFloat32, std::vector<int64_t>{1, 8, 2, 8});
    try {
      group->all_to_all_4d(x.view(), wrong.view(), UlyssesArgs{}, nullptr);
      ADD_FAILURE();
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()), p + "all_to_all_4d: out has shape float32[1, 8, 2, 8] cpu, "
                                           "expected [1, 8, 3, 8]");
    }
  });
}

}  // namespace
}  // namespace fastcomms::test
