// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// A ring all-reduce in CUDA C++ with the device window (docs/device_api.md): the kernel of
// examples/device_window_cuda.py, which compiles this file with nvcc against fastcomms' installed
// header (fastcomms.get_include()) and launches it through ctypes. No torch here.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastcomms/device/window.hpp"

using namespace fastcomms::device;

// x (float32, n * chunk) becomes the sum over ranks, in one block: a reduce-scatter ring into
// window slots [0, n) (signal 0), then an all-gather ring into slots [n, 2n) (signal 1). Signals
// count steps across calls (`call` calls before this one), so nothing is reset; barrier 0 at
// the start keeps a fast rank from overwriting slots a peer still reads.
__global__ void ring_all_reduce(const DeviceWindow* wp, const RegisteredBuffer* x_buf, float* x,
                                uint64_t chunk, uint64_t call) {
  DeviceWindow w = *wp;
  const int r = w.rank(), n = w.num_ranks();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  const float* land = static_cast<const float*>(w.base());
  const uint64_t cb = chunk * sizeof(float), done = call * (n - 1);
  w.barrier(0, CoopScope::BLOCK);
  for (int s = 0; s < n - 1; ++s) {
    const int c_send = (r - s + n) % n, c_recv = (r - s - 1 + n) % n;
    w.put(c_send * cb, *x_buf, c_send * cb, next, cb, 0, -1, CoopScope::BLOCK);
    w.wait_signal_from(prev, 0, CmpOp::GE, done + s + 1, CoopScope::BLOCK);
    for (uint64_t i = threadIdx.x; i < chunk; i += blockDim.x)
      x[c_recv * chunk + i] += land[c_recv * chunk + i];
    __syncthreads();  // the sum is in x before the next put reads it
  }
  for (int s = 0; s < n - 1; ++s) {
    const int c_send = (r + 1 - s + n) % n, c_recv = (r - s + n) % n;
    w.put((n + c_send) * cb, *x_buf, c_send * cb, next, cb, 1, -1, CoopScope::BLOCK);
    w.wait_signal_from(prev, 1, CmpOp::GE, done + s + 1, CoopScope::BLOCK);
    for (uint64_t i = threadIdx.x; i < chunk; i += blockDim.x)
      x[c_recv * chunk + i] = land[(n + c_recv) * chunk + i];
    __syncthreads();
  }
}

extern "C" int ring_all_reduce_launch(uint64_t win, uint64_t x_buf, uint64_t x, uint64_t chunk,
                                      uint64_t call, uint64_t stream) {
  ring_all_reduce<<<1, 512, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const DeviceWindow*>(win), reinterpret_cast<const RegisteredBuffer*>(x_buf),
      reinterpret_cast<float*>(x), chunk, call);
  return static_cast<int>(cudaGetLastError());
}
