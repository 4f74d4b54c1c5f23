// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The Ulysses all-to-all on the gloo collective path, bit-exact against the plan reference over
// random geometries (uneven and empty shards included), worlds of 1, 2, 3, 4 and 7 threads.
#include <gtest/gtest.h>

#include <random>

#include "fastcomms/plan/reference.hpp"
#include "fastcomms/ulysses/transport.hpp"
#include "harness.hpp"
#include "tests/common/ulysses_body.hpp"

namespace fastcomms::test {
namespace {

TEST(UlyssesGloo, RandomGeometriesBitExact) {
  const char* env_seed = std::getenv("FASTCOMMS_SEED");
  const uint64_t seed = env_seed ? std::strtoull(env_seed, nullptr, 10) : std::random_device{}();
  std::printf("[ulysses gloo] seed %llu\n", static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  int checked = 0;
  for (int P : {1, 2, 3, 4, 7}) {
    const auto cases = random_cases(P, 30, rng, /*align16=*/false);
    std::atomic<int> ok{0};
    run_threads(P, [&](Communicator& comm) {
      // The shared transport body (tests/common/ulysses_body.hpp), as the GPU tests run it on
      // the CUDA collective and NVLink transports.
      auto t =
          make_collective_transport(std::shared_ptr<Communicator>(&comm, [](Communicator*) {}));
      const int failed = run_ulysses_body(*t, cases, comm.rank(), host_memory(), "ulysses gloo");
      EXPECT_EQ(failed, 0);
      if (failed == 0) ++ok;
    });
    if (ok == P) checked += static_cast<int>(cases.size());
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
