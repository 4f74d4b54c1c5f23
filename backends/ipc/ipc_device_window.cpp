// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The device API of windows over CUDA IPC (torchcomms' get_device_window): the memory a
// fastcomms::device::DeviceWindow points at, made once per registration.
//
// NOTE [device window resources]: per window, after register_buffer,
//  - a pad this rank exports through CUDA IPC: signals [signal_count][size] then barrier slots
//    [barrier_count][size] (uint64 each, zeroed before any peer can map it, and the exchange
//    through the store orders that before every peer's first signal);
//  - private device memory: counters [counter_count], barrier epochs [barrier_count], the
//    arrays of peers' bases, signal pads and barrier slots as mapped here, and the DeviceWindow
//    itself (what get_device_window returns: Triton kernels take its address);
//  - the window's pinned error word, which a timed-out device wait sets.
// All of it lives until deregister() (collective, after cudaDeviceSynchronize on every rank) or
// the window's destruction.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "backends/ipc/ipc_window.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/device/window.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

struct IpcWindow::DeviceState {
  cuda::DeviceBuffer pad;      // exported: signals, then barrier slots
  cuda::DeviceBuffer privmem;  // counters, epochs, peer arrays, the DeviceWindow
  std::vector<std::shared_ptr<cuda::IpcMapping>> maps;  // [q]: q's pad, mapped here
  device::DeviceWindow host;                            // the copy in privmem, as the host has it
  device::DeviceWindow* dev = nullptr;                  // its address in privmem
};

void* IpcWindow::device_window(int signal_count, int counter_count, int barrier_count) {
  const std::string where = prefix("get_device_window");
  FASTCOMMS_CHECK(registered(), kInvalidArgument, where,
                  "no tensor is registered; call tensor_register first (collective) and then "
                  "get_device_window on every rank");
  if (dev_) return dev_->dev;
  const int n = opt_.size;
  if (signal_count < 0) signal_count = n;
  if (counter_count < 0) counter_count = n;
  FASTCOMMS_CHECK(barrier_count >= 0, kInvalidArgument, where, "barrier_count must be >= 0, got ",
                  barrier_count);
  // Bounded so that the byte counts below cannot wrap: 2^20 ids of 2^16 ranks is 2^39 bytes.
  constexpr int kMaxIds = 1 << 20;
  FASTCOMMS_CHECK(signal_count <= kMaxIds && counter_count <= kMaxIds && barrier_count <= kMaxIds,
                  kInvalidArgument, where,
                  "signal_count, counter_count and barrier_count must be "
                  "at most ",
                  kMaxIds, ", got ", signal_count, ", ", counter_count, ", ", barrier_count);
  cuda::DeviceGuard guard(opt_.device);
  auto st = std::make_shared<DeviceState>();
  const size_t signal_slots = static_cast<size_t>(signal_count) * n;
  const size_t barrier_slots = static_cast<size_t>(barrier_count) * n;
  const size_t pad_bytes = 8 * std::max<size_t>(1, signal_slots + barrier_slots);
  st->pad = cuda::DeviceBuffer(pad_bytes);
  FASTCOMMS_CUDA_CHECK(cudaMemset(st->pad.get(), 0, pad_bytes));
  // privmem: counters | epochs | peer bases | peer signal pads | peer barrier slots | window
  const size_t words =
      static_cast<size_t>(counter_count) + barrier_count + 3 * static_cast<size_t>(n);
  const size_t win_off = ((8 * words + 15) / 16) * 16;
  st->privmem = cuda::DeviceBuffer(win_off + sizeof(device::DeviceWindow));
  FASTCOMMS_CUDA_CHECK(cudaMemset(st->privmem.get(), 0, win_off));
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());  // zeroed before any peer maps the pad

  cudaIpcMemHandle_t handle{};
  FASTCOMMS_CUDA_CHECK(cudaIpcGetMemHandle(&handle, st->pad.get()));
  const std::string key = detail::cat(opt_.name, "/dwin/", generation_, "/");
  opt_.store->set(key + std::to_string(opt_.rank),
                  std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&handle),
                                       reinterpret_cast<uint8_t*>(&handle) + sizeof handle));
  st->maps.resize(n);
  std::vector<uint64_t*> peer_pads(n);
  for (int q = 0; q < n; ++q) {
    if (q == opt_.rank) {
      peer_pads[q] = static_cast<uint64_t*>(st->pad.get());
      continue;
    }
    const auto v = opt_.store->get(key + std::to_string(q), opt_.timeout);
    FASTCOMMS_CHECK(v.size() == sizeof handle, kInternal, where,
                    "malformed device pad record from rank ", q, ": ", v.size(),
                    " bytes, expected ", sizeof handle);
    cudaIpcMemHandle_t peer;
    std::memcpy(&peer, v.data(), sizeof peer);
    st->maps[q] = ipc_detail::open_shared(peer);
    peer_pads[q] = static_cast<uint64_t*>(st->maps[q]->get());
  }

  auto* words_dev = static_cast<uint64_t*>(st->privmem.get());
  std::vector<uint64_t> table(3 * static_cast<size_t>(n));
  for (int q = 0; q < n; ++q) {
    table[q] = reinterpret_cast<uint64_t>(ptrs_[q]);
    table[n + q] = reinterpret_cast<uint64_t>(peer_pads[q]);
    table[2 * n + q] = reinterpret_cast<uint64_t>(peer_pads[q] + signal_slots);
  }
  uint64_t* table_dev = words_dev + counter_count + barrier_count;
  FASTCOMMS_CUDA_CHECK(
      cudaMemcpy(table_dev, table.data(), table.size() * 8, cudaMemcpyHostToDevice));

  device::DeviceWindow& w = st->host;
  w.base_ = local_;
  w.size_ = static_cast<size_t>(bytes_);
  w.rank_ = opt_.rank;
  w.num_ranks_ = n;
  w.signal_count_ = signal_count;
  w.counter_count_ = counter_count;
  w.barrier_count_ = barrier_count;
  w.flags_ = 0;
  w.peer_bases_ = reinterpret_cast<void* const*>(table_dev);
  w.signals_ = static_cast<uint64_t*>(st->pad.get());
  w.peer_signals_ = reinterpret_cast<uint64_t* const*>(table_dev + n);
  w.counters_ = words_dev;
  w.barriers_ = static_cast<uint64_t*>(st->pad.get()) + signal_slots;
  w.peer_barriers_ = reinterpret_cast<uint64_t* const*>(table_dev + 2 * n);
  w.barrier_epochs_ = words_dev + counter_count;
  w.error_ = error_dev_;
  w.timeout_ns_ = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(opt_.timeout).count());
  st->dev =
      reinterpret_cast<device::DeviceWindow*>(static_cast<char*>(st->privmem.get()) + win_off);
  FASTCOMMS_CUDA_CHECK(cudaMemcpy(st->dev, &w, sizeof w, cudaMemcpyHostToDevice));
  // Every rank's pad is mapped before any rank's kernel may signal into it: a peer signalling
  // into a pad that is not yet mapped here is fine (it is that rank's memory), but a rank must
  // not reuse this generation's keys; the store wait below is the rendezvous.
  const std::string ready = detail::cat(opt_.name, "/dwin_ready/", generation_, "/");
  opt_.store->set_string(ready + std::to_string(opt_.rank), "1");
  for (int q = 0; q < n; ++q) opt_.store->wait({ready + std::to_string(q)}, opt_.timeout);
  dev_ = std::move(st);
  return dev_->dev;
}

void IpcWindow::arm_device_faults(uint32_t flags) {
  FASTCOMMS_CHECK(dev_ != nullptr, kInvalidArgument, prefix("arm_device_faults"),
                  "no device window; call get_device_window first");
  cuda::DeviceGuard guard(opt_.device);
  dev_->host.flags_ = flags;
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
  FASTCOMMS_CUDA_CHECK(
      cudaMemcpy(dev_->dev, &dev_->host, sizeof dev_->host, cudaMemcpyHostToDevice));
}

void IpcWindow::drop_device_window() {
  // Called with this device synchronized and every rank past the same point (deregister), or
  // from the destructor after a device synchronize.
  dev_.reset();
}

void* IpcWindow::register_local_buffer(void* ptr, int64_t bytes) {
  const std::string where = prefix("register_local_buffer");
  FASTCOMMS_CHECK(dev_ != nullptr, kInvalidArgument, where,
                  "no device window; call get_device_window() first (torchcomms' order)");
  FASTCOMMS_CHECK(ptr != nullptr && bytes > 0, kInvalidArgument, where,
                  "needs a non-empty tensor, got ", bytes, " bytes");
  cuda::DeviceGuard guard(opt_.device);
  cudaPointerAttributes attr{};
  FASTCOMMS_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  FASTCOMMS_CHECK(attr.type == cudaMemoryTypeDevice && attr.device == opt_.device, kInvalidArgument,
                  where, "the tensor must be device memory of cuda:", opt_.device,
                  " (the communicator's device)");
  device::RegisteredBuffer rb;
  rb.base_ptr = ptr;
  rb.size = static_cast<size_t>(bytes);
  cuda::DeviceBuffer buf(sizeof rb);
  FASTCOMMS_CUDA_CHECK(cudaMemcpy(buf.get(), &rb, sizeof rb, cudaMemcpyHostToDevice));
  void* handle = buf.get();
  locals_.emplace(handle, std::move(buf));
  return handle;
}

void IpcWindow::deregister_local_buffer(void* handle) {
  auto it = locals_.find(handle);
  FASTCOMMS_CHECK(it != locals_.end(), kInvalidArgument, prefix("deregister_local_buffer"),
                  "handle ", reinterpret_cast<uintptr_t>(handle),
                  " was not returned by register_local_buffer on this window (or was "
                  "deregistered already)");
  cuda::DeviceGuard guard(opt_.device);
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());  // no kernel still reads the descriptor
  locals_.erase(it);
}

}  // namespace fastcomms
