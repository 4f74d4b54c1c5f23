// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// Test harness: worlds of ranks as threads (in-memory store) or processes (file store), and
// typed host buffers for exact checks.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../common/values.hpp"
#include "fastcomms/core/communicator.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::test {

inline std::string unique_name(const std::string& base) {
  static std::atomic<int> n{0};
  return base + "." + std::to_string(::getpid()) + "." + std::to_string(n++);
}

/// Runs fn(comm) on P ranks as threads over one MemoryStore; every rank must succeed.
inline void run_threads(int P, const std::function<void(Communicator&)>& fn,
                        std::chrono::milliseconds timeout = std::chrono::seconds(30),
                        const std::string& backend = "gloo") {
  auto store = std::make_shared<MemoryStore>();
  const std::string name = unique_name("t");
  std::vector<std::string> errors(P);
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r) {
    threads.emplace_back([&, r] {
      try {
        CommOptions o;
        o.store = store;
        o.name = name;
        o.timeout = timeout;
        auto comm = Communicator::create(backend, r, P, Device{}, o);
        fn(*comm);
        comm->finalize();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < P; ++r) EXPECT_EQ(errors[r], "") << "rank " << r << " of " << P;
}

/// Runs fn(comm) on P forked processes over a FileStore; each child's failure message is
/// reported. The parent must be single-threaded when this is called.
inline void run_processes(int P, const std::function<void(Communicator&)>& fn,
                          std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  char dir_template[] = "/tmp/fastcomms-test-XXXXXX";
  ASSERT_NE(::mkdtemp(dir_template), nullptr);
  const std::string dir = dir_template;
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int r = 0; r < P; ++r) {
    int pipefd[2];
    ASSERT_EQ(::pipe(pipefd), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(pipefd[0]);
      std::string err;
      try {
        CommOptions o;
        o.store = std::make_shared<FileStore>(dir);
        o.name = "procs";
        o.timeout = timeout;
        auto comm = Communicator::create("gloo", r, P, Device{}, o);
        fn(*comm);
        comm->finalize();
      } catch (const std::exception& e) {
        err = e.what();
      }
      if (::testing::Test::HasFailure() && err.empty()) err = "an expectation failed in the child";
      if (!err.empty()) (void)!::write(pipefd[1], err.data(), err.size());
      ::close(pipefd[1]);
      ::_exit(err.empty() ? 0 : 1);
    }
    ::close(pipefd[1]);
    pids.push_back(pid);
    fds.push_back(pipefd[0]);
  }
  for (int r = 0; r < P; ++r) {
    std::string msg;
    char buf[512];
    ssize_t n;
    while ((n = ::read(fds[r], buf, sizeof buf)) > 0) msg.append(buf, static_cast<size_t>(n));
    ::close(fds[r]);
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "process rank " << r << " of " << P << " failed: " << msg;
  }
  (void)!std::system(("rm -rf " + dir).c_str());
}

// ---- typed host buffers ----------------------------------------------------------------------

/// A host tensor of `n` elements of `dt`, poisoned on creation.
struct HostTensor {
  DType dt;
  std::vector<uint8_t> bytes;
  std::vector<int64_t> shape;
  HostTensor(DType d, std::vector<int64_t> s) : dt(d), shape(std::move(s)) {
    int64_t n = 1;
    for (auto v : shape) n *= v;
    bytes.assign(static_cast<size_t>(n) * dtype_size(dt), 0xCD);
  }
  HostTensor(DType d, int64_t n) : HostTensor(d, std::vector<int64_t>{n}) {}
  int64_t numel() const { return static_cast<int64_t>(bytes.size() / dtype_size(dt)); }
  void set(int64_t i, double v) { encode(dt, bytes.data() + i * dtype_size(dt), v); }
  double get(int64_t i) const { return decode(dt, bytes.data() + i * dtype_size(dt)); }
  void poison() { std::fill(bytes.begin(), bytes.end(), 0xCD); }
  TensorView view() { return TensorView::contiguous(bytes.data(), dt, shape); }
};

}  // namespace fastcomms::test
