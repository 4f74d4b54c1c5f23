// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// One-sided windows (torchcomms' TorchCommWindow) as a backend hands them out: a buffer every
/// rank registers, mapped into every peer, with signals to order puts. Backends that have them
/// say so (Backend::supports_window) and make them (Backend::new_window).

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

namespace fastcomms {

/// A window of one communicator. Not thread-safe: one thread issues a window's ops, in the same
/// order on every rank for the collective ones. CUDA backends enqueue on `stream` (a
/// cudaStream_t; null: the default stream) and never block the host.
class Window {
 public:
  virtual ~Window() = default;
  /// Collective: registers `bytes` at `ptr` (this rank's device memory) as this rank's buffer;
  /// every rank registers the same size.
  virtual void register_buffer(void* ptr, int64_t bytes) = 0;
  /// Collective: drops the registration.
  virtual void deregister() = 0;
  /// Bytes of the registered buffer (0: none).
  virtual int64_t bytes() const = 0;
  /// Rank q's buffer as a pointer this rank's device can use.
  virtual void* remote(int q) const = 0;
  /// Copies `bytes` from `src` into rank `dst`'s buffer at `offset` bytes.
  virtual void put(const void* src, int64_t bytes, int dst, int64_t offset, void* stream) = 0;
  /// A signal to `peer`, ordered after everything issued before it on `stream`.
  virtual void signal(int peer, void* stream) = 0;
  /// Waits for the next signal from `peer`; later work on `stream` sees its puts. A wait longer
  /// than `timeout` gives up and leaves an error for check_errors (zero or less: the window's
  /// default, the communicator's timeout).
  virtual void wait_signal(int peer, std::chrono::milliseconds timeout, void* stream) = 0;
  /// Throws if a device-side wait failed or timed out.
  virtual void check_errors() = 0;

  // -- the device API (torchcomms' get_device_window; NOTE [device window ordering] in
  // fastcomms/device/window.hpp). Backends without it raise kUnsupported, saying why.

  /// Collective on first call (every rank, after register_buffer): a device pointer to a
  /// fastcomms::device::DeviceWindow with `signal_count` signal ids, `counter_count` counter ids
  /// and `barrier_count` barrier ids (a negative count: the communicator's size; barrier_count
  /// 0 is allowed). Later calls return the same pointer (the counts of the first call stand),
  /// until deregister() drops it.
  virtual void* device_window(int signal_count, int counter_count, int barrier_count);
  /// Not collective: a device pointer to a fastcomms::device::RegisteredBuffer describing
  /// `bytes` at `ptr` (this rank's device memory), the source of device puts. Needs
  /// device_window() first.
  virtual void* register_local_buffer(void* ptr, int64_t bytes);
  /// Frees a handle from register_local_buffer (waits for this device's work first).
  virtual void deregister_local_buffer(void* handle);
  /// Tests only: sets DeviceWindow::flags_ (fault bits) of the device window.
  virtual void arm_device_faults(uint32_t flags);
};

}  // namespace fastcomms
