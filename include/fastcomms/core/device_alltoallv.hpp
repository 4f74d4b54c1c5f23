// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// torchcomms' `device_alltoallv_single`: an all-to-all-v whose split sizes are int64 tensors on
/// the GPU, never read by the host (NOTE [device all-to-all-v] in fastcomms/cuda/device_a2av.hpp
/// says how it moves). Core knows only this interface; the implementation over CUDA IPC lives
/// in backends/ipc and registers itself, so the binding (which may not see CUDA or a backend)
/// makes one through make_device_alltoallv().

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "fastcomms/core/store.hpp"
#include "fastcomms/core/tensor.hpp"

namespace fastcomms {

/// What a device all-to-all-v group is set up from (collectively: every rank of the
/// communicator, in the same order as its collectives).
struct DeviceAlltoallvInit {
  int rank = 0;
  int size = 1;
  Device device;                 ///< This rank's CUDA device.
  std::shared_ptr<Store> store;  ///< A namespace of the communicator's store for this group.
  std::string name;              ///< The communicator's name (in messages).
  std::string backend;           ///< The communicator's backend (in messages).
  std::chrono::milliseconds timeout{600'000};  ///< Store waits and the default device wait.
  /// Bytes this rank asks of the receive buffer; every rank's buffer is the largest request.
  int64_t capacity_bytes = 0;
};

/// One group's device all-to-all-v. Thread safety: calls on one group are serialised by the
/// caller (one communicator's ops are issued in one order). Owns its buffers (mapped into every
/// peer); the destructor waits for this device's work and never throws.
class DeviceAlltoallv {
 public:
  virtual ~DeviceAlltoallv() = default;
  /// Enqueues the exchange on `stream` (a cudaStream_t), capturable in a CUDA graph; the host
  /// reads no count. `output_splits` / `input_splits` are contiguous int64 tensors of size()
  /// elements on this device: rows of dim 0 received from / sent to each rank. A count that does
  /// not fit (the output, the input, a receive buffer) or does not match the peer's is flagged on
  /// the device and raised by check_errors(); nothing is written past any buffer. `timeout` bounds
  /// each device-side wait (zero or less: the group's). `input_index` (null: input's rows in
  /// order): a contiguous int64 tensor on this device whose entry i names the input row that is
  /// row i of what the splits count (NOTE [indexed push] in fastcomms/cuda/device_a2av.hpp; an
  /// entry outside input's rows sends a zero row), so scattered rows go without a packing copy.
  virtual void run(const TensorView& output, const TensorView& input,
                   const TensorView& output_splits, const TensorView& input_splits, void* stream,
                   std::chrono::milliseconds timeout, const TensorView* input_index = nullptr) = 0;
  /// Throws what a call flagged on the device since the last check (reads pinned memory; no
  /// sync). A device wait that timed out is reported by every later check (the group's epochs
  /// no longer agree).
  virtual void check_errors() = 0;
  /// Bytes of every rank's receive buffer.
  virtual int64_t capacity_bytes() const = 0;
  /// Calls issued from the host (a captured call counts once).
  virtual uint64_t calls() const = 0;
};

using DeviceAlltoallvFactory =
    std::function<std::unique_ptr<DeviceAlltoallv>(const DeviceAlltoallvInit&)>;

/// Registers the implementation (a static initializer of backends/ipc).
void register_device_alltoallv(DeviceAlltoallvFactory factory);

/// Collective: sets up a group. Throws kUnsupported when this build has no CUDA layer or the
/// ranks are not on one host (CUDA IPC maps nothing across hosts).
std::unique_ptr<DeviceAlltoallv> make_device_alltoallv(const DeviceAlltoallvInit& init);

}  // namespace fastcomms
