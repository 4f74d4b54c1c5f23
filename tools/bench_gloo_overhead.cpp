// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Overhead of the gloo backend over raw Gloo calls (a benchmark, not a test): all_reduce and
// all_to_all_single at 4 bytes and 1 MiB, two processes on loopback, median of many iterations
// after warm-up, the two measured alternately in the same run.
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/file_store.h>
#include <gloo/transport/tcp/device.h>
#include <sys/wait.h>
#include <unistd.h>
#include <filesystem>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fastcomms/core/communicator.hpp"
#include "fastcomms/core/store.hpp"

using namespace fastcomms;
using Clock = std::chrono::steady_clock;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Result {
  double raw_us[4], ours_us[4];
};

void sum_floats(void* c, const void* a, const void* b, size_t n) {
  auto* pc = static_cast<float*>(c);
  auto* pa = static_cast<const float*>(a);
  auto* pb = static_cast<const float*>(b);
  for (size_t i = 0; i < n; ++i) pc[i] = pa[i] + pb[i];
}

Result run(int rank, int P, const std::string& dir) {
  ::gloo::transport::tcp::attr attr;
  attr.hostname = "127.0.0.1";
  auto dev = ::gloo::transport::tcp::CreateDevice(attr);
  auto ctx = std::make_shared<::gloo::rendezvous::Context>(rank, P);
  ::gloo::rendezvous::FileStore gstore(dir + "/raw");
  ctx->connectFullMesh(gstore, dev);

  CommOptions o;
  o.store = std::make_shared<FileStore>(dir + "/ours");
  o.name = "overhead";
  auto comm = Communicator::create("gloo", rank, P, Device{}, o);

  const size_t sizes[2] = {4, 1 << 20};
  Result res{};
  for (int si = 0; si < 2; ++si) {
    const size_t bytes = sizes[si];
    const size_t floats = std::max<size_t>(1, bytes / 4);
    std::vector<float> buf(floats, 1.0f);
    std::vector<uint8_t> in(bytes * P), out(bytes * P);
    const int iters = bytes < 1024 ? 3000 : 300, warm = iters / 10;
    std::vector<double> raw_ar, ours_ar, raw_a2a, ours_a2a;
    for (int it = 0; it < warm + iters; ++it) {
      // Alternate which side goes first so that neither always finds the caches warm.
      auto raw_ar_fn = [&] {
        ::gloo::AllreduceOptions ao(ctx);
        ao.setInput(buf.data(), floats);
        ao.setOutput(buf.data(), floats);
        ao.setReduceFunction(sum_floats);
        ao.setTag(1);
        ::gloo::allreduce(ao);
      };
      auto ours_ar_fn = [&] {
        comm->all_reduce(
            TensorView::contiguous(buf.data(), DType::kFloat32, {static_cast<int64_t>(floats)}),
            ReduceOp::sum());
      };
      auto raw_a2a_fn = [&] {
        ::gloo::AlltoallOptions ao(ctx);
        ao.setInput(in.data(), in.size());
        ao.setOutput(out.data(), out.size());
        ao.setTag(2);
        ::gloo::alltoall(ao);
      };
      auto ours_a2a_fn = [&] {
        comm->all_to_all_single(
            TensorView::contiguous(out.data(), DType::kUInt8, {static_cast<int64_t>(out.size())}),
            TensorView::contiguous(in.data(), DType::kUInt8, {static_cast<int64_t>(in.size())}));
      };
      auto time = [](auto&& fn) {
        const auto t = Clock::now();
        fn();
        return std::chrono::duration<double, std::micro>(Clock::now() - t).count();
      };
      double t_raw_ar, t_ours_ar, t_raw_a2a, t_ours_a2a;
      if (it % 2 == 0) {
        t_raw_ar = time(raw_ar_fn);
        t_ours_ar = time(ours_ar_fn);
        t_raw_a2a = time(raw_a2a_fn);
        t_ours_a2a = time(ours_a2a_fn);
      } else {
        t_ours_ar = time(ours_ar_fn);
        t_raw_ar = time(raw_ar_fn);
        t_ours_a2a = time(ours_a2a_fn);
        t_raw_a2a = time(raw_a2a_fn);
      }
      if (it >= warm) {
        raw_ar.push_back(t_raw_ar);
        ours_ar.push_back(t_ours_ar);
        raw_a2a.push_back(t_raw_a2a);
        ours_a2a.push_back(t_ours_a2a);
      }
      std::fill(buf.begin(), buf.end(), 1.0f);
    }
    res.raw_us[si * 2] = median(raw_ar);
    res.ours_us[si * 2] = median(ours_ar);
    res.raw_us[si * 2 + 1] = median(raw_a2a);
    res.ours_us[si * 2 + 1] = median(ours_a2a);
  }
  comm->finalize();
  return res;
}

}  // namespace

int main() {
  const int P = 2;
  char tmpl[] = "/tmp/fastcomms-overhead-XXXXXX";
  if (!::mkdtemp(tmpl)) return 1;
  std::filesystem::create_directories(std::string(tmpl) + "/raw");
  std::filesystem::create_directories(std::string(tmpl) + "/ours");
  std::vector<pid_t> pids;
  int fds[2];
  if (::pipe(fds) != 0) return 1;
  for (int r = 0; r < P; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      Result res = run(r, P, tmpl);
      if (r == 0) (void)!::write(fds[1], &res, sizeof res);
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  ::close(fds[1]);
  Result res{};
  const bool got = ::read(fds[0], &res, sizeof res) == static_cast<ssize_t>(sizeof res);
  for (pid_t pid : pids) ::waitpid(pid, nullptr, 0);
  std::error_code ec;  // no shell: the folder is removed directly
  std::filesystem::remove_all(tmpl, ec);
  if (!got) {
    std::fprintf(stderr, "bench_gloo_overhead: rank 0 reported nothing\n");
    return 1;
  }
  const char* names[4] = {"all_reduce 4 B", "all_to_all_single 4 B/peer", "all_reduce 1 MiB",
                          "all_to_all_single 1 MiB/peer"};
  std::printf("%-30s %12s %12s %10s %8s\n", "op (2 processes, loopback)", "raw gloo us",
              "fastcomms us", "extra us", "extra %");
  for (int i = 0; i < 4; ++i) {
    std::printf("%-30s %12.1f %12.1f %10.1f %7.1f%%\n", names[i], res.raw_us[i], res.ours_us[i],
                res.ours_us[i] - res.raw_us[i], 100.0 * (res.ours_us[i] / res.raw_us[i] - 1));
  }
  return 0;
}
