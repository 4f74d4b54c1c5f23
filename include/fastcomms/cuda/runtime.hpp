// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// RAII for CUDA resources. Copy is deleted, move transfers ownership, destructors do local work
/// only and never throw (a failing release is ignored: the context may already be gone).
///
/// NOTE [legacy stream ordering]: every stream here is non-blocking, so nothing on it waits for
/// the legacy default stream, where the plain `cudaMemset` and `cudaMemcpy` run. A `cudaMemset`
/// of device memory returns before it is done, and a `cudaMemcpy` from pageable host memory
/// returns once the bytes are staged, before their DMA into device memory has landed (CUDA's
/// "API synchronization behavior"). A kernel enqueued next on a non-blocking stream may then read
/// the old bytes. Whatever the library sets up that way for a later kernel is waited for (a
/// `cudaDeviceSynchronize` closing the nvlink group's setup; elsewhere the write goes on a stream
/// of its own, which is synchronized), and the GPU tests upload through `gpu_test::upload`,
/// which waits. Seen once before this rule held everywhere:
/// test_nvlink_ulysses world 4 on one GPU read the second half of one rank's input before its
/// upload had landed (docs/reliability.md).

#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#include "fastcomms/cuda/check.hpp"

namespace fastcomms::cuda {

/// Makes `device` current for the guard's lifetime.
class DeviceGuard {
 public:
  /// @param device the CUDA ordinal to make current
  explicit DeviceGuard(int device) {
    FASTCOMMS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { (void)cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

/// An owned, non-blocking stream.
class Stream {
 public:
  /// @param high_priority create it at the device's highest priority
  explicit Stream(bool high_priority = false) {
    int lo = 0, hi = 0;
    FASTCOMMS_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lo, &hi));
    FASTCOMMS_CUDA_CHECK(
        cudaStreamCreateWithPriority(&s_, cudaStreamNonBlocking, high_priority ? hi : lo));
  }
  ~Stream() {
    if (s_) (void)cudaStreamDestroy(s_);
  }
  Stream(Stream&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Stream& operator=(Stream&& o) noexcept {
    std::swap(s_, o.s_);
    return *this;
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  /// The raw handle.
  cudaStream_t get() const { return s_; }

 private:
  cudaStream_t s_ = nullptr;
};

/// An owned event (timing disabled unless asked for).
class Event {
 public:
  /// @param timing enable cudaEventElapsedTime
  explicit Event(bool timing = false) {
    FASTCOMMS_CUDA_CHECK(
        cudaEventCreateWithFlags(&e_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~Event() {
    if (e_) (void)cudaEventDestroy(e_);
  }
  Event(Event&& o) noexcept : e_(std::exchange(o.e_, nullptr)) {}
  Event& operator=(Event&& o) noexcept {
    std::swap(e_, o.e_);
    return *this;
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  /// Records on `stream`.
  void record(cudaStream_t stream) { FASTCOMMS_CUDA_CHECK(cudaEventRecord(e_, stream)); }
  /// Makes `stream` wait for this event (no host block).
  void wait_on(cudaStream_t stream) const {
    FASTCOMMS_CUDA_CHECK(cudaStreamWaitEvent(stream, e_, 0));
  }
  /// True when the recorded work has finished.
  bool query() const {
    const cudaError_t err = cudaEventQuery(e_);
    if (err == cudaErrorNotReady) return false;
    FASTCOMMS_CUDA_CHECK(err);
    return true;
  }
  /// The raw handle.
  cudaEvent_t get() const { return e_; }

 private:
  cudaEvent_t e_ = nullptr;
};

/// Owned device memory.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  /// @param bytes size (0 allocates nothing)
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes) FASTCOMMS_CUDA_CHECK(cudaMalloc(&p_, bytes));
  }
  ~DeviceBuffer() {
    if (p_) (void)cudaFree(p_);
  }
  DeviceBuffer(DeviceBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

/// Owned pinned host memory.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  /// @param bytes size
  explicit PinnedBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes) FASTCOMMS_CUDA_CHECK(cudaMallocHost(&p_, bytes));
  }
  ~PinnedBuffer() {
    if (p_) (void)cudaFreeHost(p_);
  }
  PinnedBuffer(PinnedBuffer&& o) noexcept
      : p_(std::exchange(o.p_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  void* get() const { return p_; }
  size_t size() const { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

/// A peer's allocation opened through a CUDA IPC handle; closed on destruction.
class IpcMapping {
 public:
  IpcMapping() = default;
  /// @param handle the peer's cudaIpcGetMemHandle result
  explicit IpcMapping(const cudaIpcMemHandle_t& handle) {
    FASTCOMMS_CUDA_CHECK(cudaIpcOpenMemHandle(&p_, handle, cudaIpcMemLazyEnablePeerAccess));
  }
  ~IpcMapping() {
    if (p_) (void)cudaIpcCloseMemHandle(p_);
  }
  IpcMapping(IpcMapping&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  IpcMapping& operator=(IpcMapping&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  IpcMapping(const IpcMapping&) = delete;
  IpcMapping& operator=(const IpcMapping&) = delete;
  void* get() const { return p_; }

 private:
  void* p_ = nullptr;
};

}  // namespace fastcomms::cuda
