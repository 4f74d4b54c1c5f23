// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Device memory through the CUDA virtual memory API (cuMemCreate / cuMemMap), shareable with
/// other processes as a POSIX file descriptor. NOTE [vmm windows]: on 2xH200 the copy engines
/// wrote into a legacy-IPC mapping (cudaIpcOpenMemHandle) of a large cudaMalloc buffer at a rate
/// that fell with the copy's size (383 GB/s at 64 MiB, 274 at 185 MiB, 246 at 554 MiB), while
/// into a cuMemMap mapping of an imported handle it held 382-391 GB/s at every size
/// (docs/benchmarks.md, "copy-engine path"). Windows that peers write are made this way where
/// the driver supports it. The driver entry points are looked up at run time (no link against
/// libcuda, so a build with CUDA still loads on a machine without a driver).

#include <cstddef>
#include <string>
#include <utility>

namespace fastcomms::cuda {

/// The allocation that holds `ptr` (cuMemGetAddressRange): its base and size. Throws
/// kInvalidArgument (prefixed by `where`) when `ptr` is not device memory of this process, and
/// kCudaError when the driver lacks the entry point.
std::pair<char*, size_t> allocation_of(const void* ptr, const std::string& where);

/// True when `device` supports virtual memory management with POSIX file-descriptor handles;
/// otherwise false and `why` says why.
bool vmm_supported(int device, std::string* why);

/// A physical allocation (a driver handle) mapped read-write for one device: what VmmBuffer and
/// VmmImport share. Move-only; the destructor unmaps and releases.
class VmmMapping {
 public:
  VmmMapping() = default;
  ~VmmMapping();
  VmmMapping(VmmMapping&& o) noexcept { swap(o); }
  VmmMapping& operator=(VmmMapping&& o) noexcept {
    swap(o);
    return *this;
  }
  VmmMapping(const VmmMapping&) = delete;
  VmmMapping& operator=(const VmmMapping&) = delete;
  void* get() const { return reinterpret_cast<void*>(ptr_); }
  /// The mapped size.
  size_t size() const { return size_; }

 protected:
  /// Takes `handle` (released on failure) and maps its `bytes` for `device`.
  void map(unsigned long long handle, size_t bytes, int device);
  unsigned long long handle_ = 0;

 private:
  void swap(VmmMapping& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(size_, o.size_);
    std::swap(handle_, o.handle_);
  }
  unsigned long long ptr_ = 0;
  size_t size_ = 0;
};

/// Memory of at least `bytes` on `device`, mapped read-write for it; its size is rounded up to
/// the allocation granularity.
class VmmBuffer : public VmmMapping {
 public:
  VmmBuffer() = default;
  VmmBuffer(size_t bytes, int device);
  /// A new file descriptor for the memory (the caller closes it).
  int export_fd() const;
};

/// Another process's VmmBuffer imported from its file descriptor (`bytes`: its mapped size) and
/// mapped read-write for `device`.
class VmmImport : public VmmMapping {
 public:
  VmmImport() = default;
  VmmImport(int fd, size_t bytes, int device);
};

}  // namespace fastcomms::cuda
