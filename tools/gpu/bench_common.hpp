// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// What the C++ GPU benchmarks (bench_a2a, bench_nccl_ops) share: the median, one batch of
// back-to-back calls timed with CUDA events, and the two-rank main.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fastcomms/cuda/runtime.hpp"
#include "tests/common/gpu_world.hpp"

namespace fastcomms::bench {

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Device µs per call of `fn`: the stream synchronized, then `iters` back-to-back calls on `st`
/// between the events `t0` and `t1`.
inline double batch_us(cudaStream_t st, cuda::Event& t0, cuda::Event& t1,
                       const std::function<void()>& fn, int iters) {
  FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
  t0.record(st);
  for (int i = 0; i < iters; ++i) fn();
  t1.record(st);
  FASTCOMMS_CUDA_CHECK(cudaEventSynchronize(t1.get()));
  float ms = 0;
  FASTCOMMS_CUDA_CHECK(cudaEventElapsedTime(&ms, t0.get(), t1.get()));
  return 1000.0 * ms / iters;
}

/// Runs `rank_main` on 2 ranks (rank r on GPU r % device count): 0 when both succeed, 1 when one
/// fails; with fewer than 2 devices prints "SKIPPED: <name> needs 2 CUDA devices, ..." and
/// returns gpu_test::kSkip.
inline int run_two_ranks(
    const char* name, const std::function<int(int, int, int, std::shared_ptr<Store>)>& rank_main) {
  std::string why;
  const int ndev = gpu_test::device_count_forked(&why);
  if (ndev < 2) {
    std::printf("SKIPPED: %s needs 2 CUDA devices, found %d %s\n", name, ndev, why.c_str());
    return gpu_test::kSkip;
  }
  return gpu_test::run_ranks(2, ndev, rank_main) ? 1 : 0;
}

}  // namespace fastcomms::bench
