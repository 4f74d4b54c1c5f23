// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// bench_nccl_ops (a benchmark, not a test): the nccl backend through the communicator, sync ops
// ordered on the caller's stream, 2 ranks; prints CSV "fastcomms,op,bytes,us" for
// tools/gpu/bench_torch_nccl.py to join with torch.distributed's numbers measured the same way
// (5 warm-up calls, 7 batches of back-to-back calls timed with CUDA events, median per call).
#include <cstring>

#include "fastcomms/core/communicator.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "tools/gpu/bench_common.hpp"

using namespace fastcomms;

namespace {

int rank_main(int rank, int P, int device, std::shared_ptr<Store> store) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  CommOptions o;
  o.store = store;
  o.name = "bench";
  auto comm = Communicator::create("nccl", rank, P, Device{DeviceType::kCUDA, device}, o);
  cuda::Stream stream;
  cudaStream_t st = stream.get();
  cuda::Event t0(true), t1(true);
  const Device dev{DeviceType::kCUDA, device};
  const int64_t max_bytes = int64_t{1} << 30;
  cuda::DeviceBuffer a(static_cast<size_t>(max_bytes) * P), b(static_cast<size_t>(max_bytes) * P);
  FASTCOMMS_CUDA_CHECK(cudaMemset(a.get(), 1, a.size()));
  CallOptions co;
  co.stream = st;
  for (int64_t bytes : {int64_t{8}, int64_t{1} << 10, int64_t{64} << 10, int64_t{1} << 20,
                        int64_t{16} << 20, int64_t{256} << 20, int64_t{1} << 30}) {
    const int64_t n = bytes / 4;
    auto view = [&](void* p, int64_t count) {
      return TensorView::contiguous(p, DType::kFloat32, {count}, dev);
    };
    struct Op {
      const char* name;
      std::function<void()> fn;
    };
    std::vector<Op> ops = {
        {"all_reduce", [&] { comm->all_reduce(view(a.get(), n), ReduceOp::sum(), co); }},
        {"broadcast", [&] { comm->broadcast(view(a.get(), n), 0, co); }},
        {"all_gather_single",
         [&] { comm->all_gather_single(view(b.get(), n * P), view(a.get(), n), co); }},
        {"reduce_scatter_single",
         [&] {
           comm->reduce_scatter_single(view(b.get(), n), view(a.get(), n * P), ReduceOp::sum(), co);
         }},
        {"all_to_all_single",
         [&] { comm->all_to_all_single(view(b.get(), n * P), view(a.get(), n * P), co); }},
    };
    const int iters = bytes >= (int64_t{256} << 20) ? 5 : 50;
    for (auto& op : ops) {
      for (int w = 0; w < 5; ++w) op.fn();
      std::vector<double> samples;
      for (int rep = 0; rep < 7; ++rep)
        samples.push_back(bench::batch_us(st, t0, t1, op.fn, iters));
      if (rank == 0)
        std::printf("fastcomms,%s,%lld,%.2f\n", op.name, (long long)bytes, bench::median(samples));
      std::fflush(stdout);
    }
  }
  comm->finalize();
  return 0;
}

}  // namespace

int main() { return bench::run_two_ranks("bench_nccl_ops", rank_main); }
