// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// One-sided windows over CUDA IPC (torchcomms' TorchCommWindow), what the nvlink and nccl
/// backends hand out: a buffer registered by every rank of a group on one host and mapped into
/// every peer through CUDA IPC (over NVLink where the GPUs have it, else PCIe), with a signal pad
/// beside it. `put`
/// copies into a peer's buffer (copy engine), `signal`/`wait_signal` order a sender's puts before
/// a receiver's later work (NOTE [window signal ordering] in fastcomms/cuda/signal.hpp),
/// `remote` gives a peer's buffer as a pointer kernels can use. Setup needs only the store.
/// Signal values are fixed when an op is enqueued, so window ops are not for CUDA graph capture.

#include <cuda_runtime_api.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fastcomms/core/store.hpp"
#include "fastcomms/core/window.hpp"
#include "fastcomms/cuda/runtime.hpp"

namespace fastcomms {

/// A rank's place in a group of ranks on one host that set up through a store (IPC handles
/// travel through it): what a window group and the NVLink engine's group both start from.
struct IpcGroupOptions {
  int rank = 0;
  int size = 1;
  int device = 0;                              ///< This rank's CUDA ordinal.
  std::shared_ptr<Store> store;                ///< Rendezvous (IPC handles travel through it).
  std::chrono::milliseconds timeout{600'000};  ///< Store waits and device waits.
};

/// Setup of a window group (the timeout bounds store waits and device signal waits).
struct IpcWindowOptions : IpcGroupOptions {
  std::string name = "window";     ///< Key namespace in the store.
  std::string backend = "nvlink";  ///< Named in errors.
};

/// A window: one registered buffer per rank, mapped into every peer.
class IpcWindow final : public Window {
 public:
  /// Collective: checks that every rank runs on this host (CUDA IPC maps nothing across hosts;
  /// otherwise every rank raises kUnsupported naming the hosts), then allocates and exchanges
  /// the signal pads.
  explicit IpcWindow(IpcWindowOptions options);
  ~IpcWindow() override;
  IpcWindow(const IpcWindow&) = delete;
  IpcWindow& operator=(const IpcWindow&) = delete;

  /// Collective: registers `bytes` at `ptr` (device memory of this rank's device, any offset
  /// inside a cudaMalloc'd allocation) as this rank's buffer. Every rank registers the same size.
  void register_buffer(void* ptr, int64_t bytes) override;
  /// Collective: drops the registration (waits for this device's work first).
  void deregister() override;
  /// Whether a buffer is registered.
  bool registered() const { return bytes_ > 0; }
  /// Bytes of the registered buffer (the same on every rank).
  int64_t bytes() const override { return bytes_; }
  /// Rank q's buffer as a pointer on this device (this rank's own buffer for q == rank).
  void* remote(int q) const override;

  /// Enqueues a copy of `bytes` from `src` into rank `dst`'s buffer at `offset` bytes.
  void put(const void* src, int64_t bytes, int dst, int64_t offset, void* stream) override;
  /// Enqueues a signal to `peer` ordered after everything enqueued before it on `stream`.
  void signal(int peer, void* stream) override;
  /// Enqueues a wait for the next signal from `peer`; later work on `stream` sees its puts.
  void wait_signal(int peer, std::chrono::milliseconds timeout, void* stream) override;
  /// Throws if a device-side wait timed out (reads pinned memory; no sync).
  void check_errors() override;

  // The device API (backends/ipc/ipc_device_window.cpp, NOTE [device window resources]).
  void* device_window(int signal_count, int counter_count, int barrier_count) override;
  void* register_local_buffer(void* ptr, int64_t bytes) override;
  void deregister_local_buffer(void* handle) override;
  void arm_device_faults(uint32_t flags) override;

 private:
  struct DeviceState;  // the device window's memory and mappings (ipc_device_window.cpp)
  void drop_device_window();
  std::string prefix(const char* op) const;
  void check_peer(const char* op, const char* what, int q) const;

  IpcWindowOptions opt_;
  std::chrono::milliseconds last_wait_timeout_ = opt_.timeout;  // the latest wait's limit
  cuda::DeviceBuffer pad_;  // size slots: [q] = signals received from q
  std::vector<std::shared_ptr<cuda::IpcMapping>> pad_maps_;
  std::vector<uint64_t*> peer_pads_;  // [q]: q's pad, mapped here
  cuda::PinnedBuffer error_;
  int* error_dev_ = nullptr;
  std::vector<uint64_t> sent_, seen_;  // signals sent to / consumed from each peer
  void* local_ = nullptr;
  int64_t bytes_ = 0;
  std::vector<std::shared_ptr<cuda::IpcMapping>> maps_;  // [q]: q's allocation, mapped here
  std::vector<void*> ptrs_;                              // [q]: q's buffer, mapped here
  uint64_t generation_ = 0;
  std::shared_ptr<DeviceState> dev_;            // the device window, once asked for
  std::map<void*, cuda::DeviceBuffer> locals_;  // register_local_buffer's handles
};

namespace ipc_detail {
/// One mapping per peer allocation per process (NOTE [one mapping per allocation]).
std::shared_ptr<cuda::IpcMapping> open_shared(const cudaIpcMemHandle_t& handle);
}  // namespace ipc_detail

}  // namespace fastcomms
