// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// Multi-process GPU worlds: fork P ranks (rank r on GPU r % device_count) before the parent
// touches CUDA, each over a FileStore; exit code 77 means SKIPPED.
#include <cuda_runtime_api.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "fastcomms/core/store.hpp"
#include "tests/common/ulysses_body.hpp"

namespace fastcomms::gpu_test {

constexpr int kSkip = 77;

/// Copies n bytes of pageable host memory to the device and waits until they have landed
/// (NOTE [legacy stream ordering] in fastcomms/cuda/runtime.hpp): every host-to-device upload
/// of the GPU tests and tools goes through here.
inline void upload(void* dst, const void* src, size_t n) {
  cudaError_t e = cudaMemcpy(dst, src, n, cudaMemcpyHostToDevice);
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) throw Error(ErrorCode::kCudaError, cudaGetErrorString(e));
}

/// Device memory of `device` for the shared Ulysses body; work is enqueued on `stream`.
inline test::BodyMemory device_memory(int device, cudaStream_t stream) {
  const auto check = [](cudaError_t e) {
    if (e != cudaSuccess) throw Error(ErrorCode::kCudaError, cudaGetErrorString(e));
  };
  test::BodyMemory m;
  m.device = Device{DeviceType::kCUDA, device};
  m.stream = stream;
  m.alloc = [check](size_t n) {
    void* p = nullptr;
    check(cudaMalloc(&p, n));
    return p;
  };
  m.release = [](void* p) { (void)cudaFree(p); };
  m.upload = [](void* d, const void* s, size_t n) { upload(d, s, n); };
  m.download = [check](void* d, const void* s, size_t n) {
    check(cudaMemcpy(d, s, n, cudaMemcpyDeviceToHost));
  };
  m.fill = [check, stream](void* p, int v, size_t n) { check(cudaMemsetAsync(p, v, n, stream)); };
  m.sync = [check, stream] { check(cudaStreamSynchronize(stream)); };
  return m;
}

/// Device count in a child process, so the parent never initializes CUDA before forking.
inline int device_count_forked(std::string* why) {
  int fds[2];
  if (::pipe(fds) != 0) return 0;
  std::fflush(stdout);
  const pid_t pid = ::fork();
  if (pid == 0) {
    int n = 0;
    const cudaError_t err = cudaGetDeviceCount(&n);
    char msg[256];
    const int len = std::snprintf(msg, sizeof msg, "%d %s", err == cudaSuccess ? n : 0,
                                  err == cudaSuccess ? "" : cudaGetErrorString(err));
    (void)!::write(fds[1], msg, static_cast<size_t>(len));
    ::_exit(0);
  }
  ::close(fds[1]);
  char buf[256] = {};
  (void)!::read(fds[0], buf, sizeof buf - 1);
  ::close(fds[0]);
  ::waitpid(pid, nullptr, 0);
  int n = 0;
  char reason[200] = {};
  std::sscanf(buf, "%d %199[^\n]", &n, reason);
  if (why) *why = reason;
  return n;
}

/// Runs fn(rank, size, device, store) in P processes; returns the number that failed.
inline int run_ranks(int P, int ndev,
                     const std::function<int(int, int, int, std::shared_ptr<Store>)>& fn) {
  char tmpl[] = "/tmp/fastcomms-gpu-XXXXXX";
  if (!::mkdtemp(tmpl)) return P;
  std::vector<pid_t> pids;
  std::fflush(stdout);  // children must not inherit (and print again) unflushed output
  std::fflush(stderr);
  for (int r = 0; r < P; ++r) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      int rc = 1;
      try {
        rc = fn(r, P, r % ndev, std::make_shared<FileStore>(std::string(tmpl) + "/store"));
      } catch (const std::exception& e) {
        std::fprintf(stderr, "rank %d/%d: %s\n", r, P, e.what());
      }
      std::fflush(stdout);
      ::_exit(rc);
    }
    pids.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  (void)!std::system((std::string("rm -rf ") + tmpl).c_str());
  return failed;
}

}  // namespace fastcomms::gpu_test
