// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// What the nccl backend's files share: NCCL results in words and as errors (NOTE [nccl error
// codes]), and RAII over the seam (NOTE [nccl seam]) for devices, streams, events and memory.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <utility>

#include "backends/nccl/nccl_api.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::nccl_backend {

inline const char* nccl_result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    case ncclNumResults:
      break;
  }
  return "an unknown ncclResult_t";
}

// NOTE [nccl error codes]: what a failed NCCL call raises. An argument or a usage NCCL refuses is
// the caller's (kInvalidArgument: a ValueError in Python, and never a process abort, the
// communicator still works); a CUDA failure inside NCCL is kCudaError; a system, remote (a peer
// failed) or internal NCCL failure is the transport's (kBackendError). ncclInProgress cannot come
// from the blocking communicators this backend makes, so it is a broken invariant (kInternal).
inline ErrorCode nccl_error_code(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return ErrorCode::kInvalidArgument;
    case ncclUnhandledCudaError:
      return ErrorCode::kCudaError;
    case ncclInProgress:
      return ErrorCode::kInternal;
    default:
      return ErrorCode::kBackendError;
  }
}

// "ncclSystemError (unhandled system error); NCCL's last error: ...": a result in words.
inline std::string nccl_result_text(NcclApi& api, ncclComm_t comm, ncclResult_t r) {
  std::string text = detail::cat(nccl_result_name(r), " (", api.get_error_string(r), ")");
  if (comm != nullptr) {
    const char* last = api.get_last_error(comm);
    if (last != nullptr && *last != '\0') text += detail::cat("; NCCL's last error: ", last);
  }
  return text;
}

// Throws the Error of a failed NCCL call: `prefix` (rank, communicator, op), the call, its result.
inline void nccl_check(NcclApi& api, ncclComm_t comm, const std::string& prefix, const char* call,
                       ncclResult_t r) {
  if (r != ncclSuccess) [[unlikely]]
    throw Error(nccl_error_code(r),
                detail::cat(prefix, call, " failed: ", nccl_result_text(api, comm, r)));
}

// Throws kCudaError for a failed CUDA runtime call: `prefix`, the call, the CUDA error.
inline void cuda_check(NcclApi& api, const std::string& prefix, const char* call, cudaError_t err) {
  if (err != cudaSuccess) [[unlikely]]
    throw Error(ErrorCode::kCudaError,
                detail::cat(prefix, call, " failed: ", api.cuda_get_error_name(err), " (",
                            api.cuda_get_error_string(err), ")"));
}

// RAII over the seam (NOTE [nccl seam]), as fastcomms/cuda/runtime.hpp has over the runtime:
// copy deleted, destructors do local work only and never throw.
class DeviceGuard {
 public:
  DeviceGuard(NcclApi& api, int device, const std::string& prefix) : api_(api) {
    cuda_check(api_, prefix, "cudaGetDevice", api_.cuda_get_device(&previous_));
    if (device != previous_)
      cuda_check(api_, prefix, "cudaSetDevice", api_.cuda_set_device(device));
  }
  ~DeviceGuard() { (void)api_.cuda_set_device(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  NcclApi& api_;
  int previous_ = 0;
};

// A non-blocking stream of the current device.
class Stream {
 public:
  Stream(NcclApi& api, bool high_priority, const std::string& prefix) : api_(&api) {
    int lo = 0, hi = 0;
    cuda_check(*api_, prefix, "cudaDeviceGetStreamPriorityRange",
               api_->cuda_device_get_stream_priority_range(&lo, &hi));
    cuda_check(*api_, prefix, "cudaStreamCreateWithPriority",
               api_->cuda_stream_create_with_priority(&s_, cudaStreamNonBlocking,
                                                      high_priority ? hi : lo));
  }
  ~Stream() {
    if (s_) (void)api_->cuda_stream_destroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  NcclApi* api_;
  cudaStream_t s_ = nullptr;
};

// An event without timing.
class Event {
 public:
  Event(NcclApi& api, const std::string& prefix) : api_(&api) {
    cuda_check(*api_, prefix, "cudaEventCreateWithFlags",
               api_->cuda_event_create_with_flags(&e_, cudaEventDisableTiming));
  }
  ~Event() {
    if (e_) (void)api_->cuda_event_destroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }
  cudaEvent_t release() { return std::exchange(e_, nullptr); }

 private:
  NcclApi* api_;
  cudaEvent_t e_ = nullptr;
};

// Device memory of the current device.
class DeviceBuffer {
 public:
  DeviceBuffer(NcclApi& api, size_t bytes, const std::string& prefix) : api_(&api) {
    cuda_check(*api_, prefix, "cudaMalloc", api_->cuda_malloc(&p_, bytes));
  }
  ~DeviceBuffer() {
    if (p_) (void)api_->cuda_free(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }

 private:
  NcclApi* api_;
  void* p_ = nullptr;
};

// NOTE [watchdog and graph capture]: this thread's capture mode relaxed for the guard's life, so
// its event queries cannot invalidate a global-mode capture another thread runs.
class RelaxedCapture {
 public:
  explicit RelaxedCapture(NcclApi& api) : api_(api) {
    (void)api_.cuda_thread_exchange_stream_capture_mode(&mode_);
  }
  ~RelaxedCapture() { (void)api_.cuda_thread_exchange_stream_capture_mode(&mode_); }
  RelaxedCapture(const RelaxedCapture&) = delete;
  RelaxedCapture& operator=(const RelaxedCapture&) = delete;

 private:
  NcclApi& api_;
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// Pinned host memory of the current device's context (cudaHostAlloc with `flags`).
class HostBuffer {
 public:
  HostBuffer(NcclApi& api, size_t bytes, unsigned int flags, const std::string& prefix)
      : api_(&api) {
    cuda_check(*api_, prefix, "cudaHostAlloc", api_->cuda_host_alloc(&p_, bytes, flags));
  }
  ~HostBuffer() {
    if (p_) (void)api_->cuda_free_host(p_);
  }
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  void* get() const { return p_; }

 private:
  NcclApi* api_;
  void* p_ = nullptr;
};

}  // namespace fastcomms::nccl_backend
