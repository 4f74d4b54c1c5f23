// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [window memory allocator]: the allocator `TorchComm.get_mem_allocator()` hands out (as
// torchcomms does, for `torch.cuda.MemPool`): every block is a cudaMalloc of its own, so CUDA
// IPC can export it whatever the caching allocator's settings (expandable segments cannot be
// exported) and a window maps exactly the block registered. PyTorch loads the two functions by
// name (torch.cuda.memory.CUDAPluggableAllocator) from libfastcomms.so.
#include <cuda_runtime_api.h>
#include <sys/types.h>

extern "C" {

__attribute__((visibility("default"))) void* fastcomms_window_alloc(ssize_t size, int device,
                                                                    cudaStream_t /*stream*/) {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  void* p = nullptr;
  if (size <= 0 || cudaSetDevice(device) != cudaSuccess ||
      cudaMalloc(&p, static_cast<size_t>(size)) != cudaSuccess) {
    (void)cudaGetLastError();  // PyTorch reports a null block as out of memory
    p = nullptr;
  }
  if (previous >= 0) (void)cudaSetDevice(previous);
  return p;
}

__attribute__((visibility("default"))) void fastcomms_window_free(void* ptr, ssize_t /*size*/,
                                                                  int device,
                                                                  cudaStream_t /*stream*/) {
  int previous = -1;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
  if (cudaSetDevice(device) == cudaSuccess) (void)cudaFree(ptr);  // waits for the device's work
  (void)cudaGetLastError();
  if (previous >= 0) (void)cudaSetDevice(previous);
}

}  // extern "C"
