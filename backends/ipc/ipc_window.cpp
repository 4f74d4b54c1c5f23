// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Windows over CUDA IPC: registered buffers mapped into every peer, puts on the copy engines,
// signals on a pad per rank (backends/ipc/ipc_window.hpp).
#include "backends/ipc/ipc_window.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "backends/ipc/records.hpp"
#include "fastcomms/core/store_window.hpp"
#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/signal.hpp"
#include "fastcomms/cuda/vmm.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

// NOTE [one mapping per allocation]: several windows may register tensors of one allocation (a
// caching allocator's segment), and an allocation is opened once per process.
std::shared_ptr<cuda::IpcMapping> ipc_detail::open_shared(const cudaIpcMemHandle_t& handle) {
  static std::mutex mu;
  static std::map<std::string, std::weak_ptr<cuda::IpcMapping>> open;
  const std::string key(reinterpret_cast<const char*>(&handle), sizeof handle);
  std::lock_guard<std::mutex> lock(mu);
  if (auto m = open[key].lock()) return m;
  auto m = std::make_shared<cuda::IpcMapping>(handle);
  open[key] = m;
  return m;
}

namespace {
using ipc_detail::open_shared;

// NOTE [store windows]: make_store_window (fastcomms/core/window.hpp) builds these.
std::shared_ptr<Window> make_ipc_store_window(const StoreWindowInit& init) {
  IpcWindowOptions o;
  o.rank = init.rank;
  o.size = init.size;
  o.device = init.device;
  o.store = init.store;
  o.name = init.name;
  o.timeout = init.timeout;
  o.backend = "store window";
  return std::make_shared<IpcWindow>(std::move(o));
}
[[maybe_unused]] const bool kStoreWindowMaker =
    (set_store_window_maker(&make_ipc_store_window), true);

static_assert(sizeof(cudaIpcMemHandle_t) == ipc_records::kHandleBytes);

// This machine, as ranks compare it: the host name and the kernel's boot id (two containers may
// share a host name; a boot id names one running kernel, so one set of GPUs).
std::string host_identity() {
  char name[256] = {};
  (void)gethostname(name, sizeof name - 1);
  std::string boot;
  if (std::FILE* f = std::fopen("/proc/sys/kernel/random/boot_id", "r")) {
    char b[64] = {};
    if (std::fgets(b, sizeof b, f)) boot = b;
    std::fclose(f);
    while (!boot.empty() && (boot.back() == '\n' || boot.back() == ' ')) boot.pop_back();
  }
  return detail::cat(name, " (boot ", boot.empty() ? "unknown" : boot, ")");
}

}  // namespace

IpcWindow::IpcWindow(IpcWindowOptions options) : opt_(std::move(options)) {
  FASTCOMMS_CHECK(opt_.store != nullptr, kInvalidArgument, prefix("new_window"),
                  "a store is required");
  FASTCOMMS_CHECK(opt_.size >= 1 && opt_.rank >= 0 && opt_.rank < opt_.size, kInvalidArgument,
                  prefix("new_window"), "rank ", opt_.rank, " is not in a group of ", opt_.size);
  // NOTE [windows need one host]: every rank publishes its host and reads every other's before
  // any IPC handle moves, so on a job across hosts every rank raises the same error here.
  {
    const std::string mine = host_identity();
    opt_.store->set_string(detail::cat(opt_.name, "/host/", opt_.rank), mine);
    for (int q = 0; q < opt_.size; ++q) {
      if (q == opt_.rank) continue;
      const std::string theirs =
          opt_.store->get_string(detail::cat(opt_.name, "/host/", q), opt_.timeout);
      FASTCOMMS_CHECK(theirs == mine, kUnsupported, prefix("new_window"), "windows on the ",
                      opt_.backend,
                      " backend map peers' memory through CUDA IPC, which needs every rank on "
                      "one host: rank ",
                      q, " runs on ", theirs, ", this rank on ", mine);
    }
  }
  cuda::DeviceGuard guard(opt_.device);
  const size_t pad_bytes = sizeof(uint64_t) * static_cast<size_t>(opt_.size);
  pad_ = cuda::DeviceBuffer(pad_bytes);
  FASTCOMMS_CUDA_CHECK(cudaMemset(pad_.get(), 0, pad_bytes));
  error_ = cuda::PinnedBuffer(sizeof(int));
  std::memset(error_.get(), 0, sizeof(int));
  FASTCOMMS_CUDA_CHECK(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_.get(), 0));
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t handle;
  FASTCOMMS_CUDA_CHECK(cudaIpcGetMemHandle(&handle, pad_.get()));
  opt_.store->set(detail::cat(opt_.name, "/pad/", opt_.rank),
                  std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&handle),
                                       reinterpret_cast<uint8_t*>(&handle) + sizeof handle));
  pad_maps_.resize(opt_.size);
  peer_pads_.resize(opt_.size);
  for (int q = 0; q < opt_.size; ++q) {
    if (q == opt_.rank) {
      peer_pads_[q] = static_cast<uint64_t*>(pad_.get());
      continue;
    }
    const auto v = opt_.store->get(detail::cat(opt_.name, "/pad/", q), opt_.timeout);
    FASTCOMMS_CHECK(v.size() == sizeof handle, kInternal, prefix("new_window"),
                    "malformed pad record from rank ", q);
    cudaIpcMemHandle_t peer;
    std::memcpy(&peer, v.data(), sizeof peer);
    pad_maps_[q] = open_shared(peer);
    peer_pads_[q] = static_cast<uint64_t*>(pad_maps_[q]->get());
  }
  sent_.assign(opt_.size, 0);
  seen_.assign(opt_.size, 0);
  maps_.resize(opt_.size);
  ptrs_.assign(opt_.size, nullptr);
}

IpcWindow::~IpcWindow() {
  (void)cudaSetDevice(opt_.device);
  (void)cudaDeviceSynchronize();  // this rank's puts and signals are done before unmapping
}

std::string IpcWindow::prefix(const char* op) const {
  return detail::cat("[rank ", opt_.rank, "/", opt_.size, " ", opt_.name, " ", op, "] ");
}

void IpcWindow::check_peer(const char* op, const char* what, int q) const {
  FASTCOMMS_CHECK(q >= 0 && q < opt_.size, kInvalidArgument, prefix(op), what, " must be in [0, ",
                  opt_.size, "), got ", q);
}

void IpcWindow::register_buffer(void* ptr, int64_t bytes) {
  const std::string where = prefix("tensor_register");
  FASTCOMMS_CHECK(!registered(), kInvalidArgument, where,
                  "a buffer is already registered; call tensor_deregister() first");
  FASTCOMMS_CHECK(ptr != nullptr && bytes > 0, kInvalidArgument, where,
                  "needs a non-empty device buffer, got ", bytes, " bytes");
  cuda::DeviceGuard guard(opt_.device);
  cudaPointerAttributes attr{};
  FASTCOMMS_CUDA_CHECK(cudaPointerGetAttributes(&attr, ptr));
  FASTCOMMS_CHECK(attr.type == cudaMemoryTypeDevice && attr.device == opt_.device, kInvalidArgument,
                  where, "the buffer must be device memory of cuda:", opt_.device,
                  " (the communicator's device)");
  const auto [base, size] = cuda::allocation_of(ptr, where);
  const int64_t offset = static_cast<char*>(ptr) - base;
  FASTCOMMS_CHECK(offset + bytes <= static_cast<int64_t>(size), kInvalidArgument, where,
                  "the buffer runs past its allocation");
  cudaIpcMemHandle_t handle{};
  const cudaError_t rc = cudaIpcGetMemHandle(&handle, base);
  FASTCOMMS_CHECK(rc == cudaSuccess, kInvalidArgument, where,
                  "CUDA IPC cannot export this buffer (", cudaGetErrorString(rc),
                  "); register memory from cudaMalloc (with PyTorch: not from expandable "
                  "segments, PYTORCH_CUDA_ALLOC_CONF)");
  // NOTE [ipc records]
  ipc_records::BufferRecord mine;
  std::memcpy(mine.handle.data(), &handle, sizeof handle);
  mine.offset = offset;
  mine.bytes = bytes;
  const std::string key = detail::cat(opt_.name, "/buf/", generation_, "/");
  opt_.store->set(key + std::to_string(opt_.rank), ipc_records::encode(mine));
  std::vector<std::shared_ptr<cuda::IpcMapping>> maps(opt_.size);
  std::vector<void*> ptrs(opt_.size, nullptr);
  for (int q = 0; q < opt_.size; ++q) {
    if (q == opt_.rank) {
      ptrs[q] = ptr;
      continue;
    }
    const auto peer = ipc_records::decode_buffer(
        opt_.store->get(key + std::to_string(q), opt_.timeout), bytes, q, where);
    cudaIpcMemHandle_t peer_handle;
    std::memcpy(&peer_handle, peer.handle.data(), sizeof peer_handle);
    maps[q] = open_shared(peer_handle);
    // The offset must lie inside what the handle mapped: never write past a peer's allocation.
    // (Where the driver cannot size an imported mapping, the record's own checks stand.)
    int64_t mapped = -1;
    try {
      mapped = static_cast<int64_t>(cuda::allocation_of(maps[q]->get(), where).second);
    } catch (const Error&) {
    }
    if (mapped >= 0) ipc_records::check_inside(peer, mapped, q, where);
    ptrs[q] = static_cast<char*>(maps[q]->get()) + peer.offset;
  }
  ++generation_;
  maps_ = std::move(maps);
  ptrs_ = std::move(ptrs);
  local_ = ptr;
  bytes_ = bytes;
}

void IpcWindow::deregister() {
  if (!registered()) return;
  cuda::DeviceGuard guard(opt_.device);
  // Every rank's puts into every buffer are done before any rank lets its buffer go.
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
  const std::string key = detail::cat(opt_.name, "/dereg/", generation_, "/");
  opt_.store->set_string(key + std::to_string(opt_.rank), "1");
  for (int q = 0; q < opt_.size; ++q) opt_.store->wait({key + std::to_string(q)}, opt_.timeout);
  drop_device_window();  // its peer bases and pads go with the registration
  ++generation_;
  maps_.assign(opt_.size, nullptr);
  ptrs_.assign(opt_.size, nullptr);
  local_ = nullptr;
  bytes_ = 0;
}

void* IpcWindow::remote(int q) const {
  check_peer("map_remote_tensor", "rank", q);
  FASTCOMMS_CHECK(registered(), kInvalidArgument, prefix("map_remote_tensor"),
                  "no buffer is registered");
  return ptrs_[q];
}

void IpcWindow::put(const void* src, int64_t bytes, int dst, int64_t offset, void* s) {
  cudaStream_t stream = static_cast<cudaStream_t>(s);
  check_peer("put", "dst_rank", dst);
  FASTCOMMS_CHECK(registered(), kInvalidArgument, prefix("put"), "no buffer is registered");
  FASTCOMMS_CHECK(offset >= 0 && bytes >= 0 && offset + bytes <= bytes_, kInvalidArgument,
                  prefix("put"), "bytes [", offset, ", ", offset + bytes,
                  ") do not fit the window of ", bytes_, " bytes");
  check_errors();
  if (bytes == 0) return;
  cuda::DeviceGuard guard(opt_.device);
  FASTCOMMS_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(ptrs_[dst]) + offset, src,
                                       static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice,
                                       stream));
}

void IpcWindow::signal(int peer, void* s) {
  cudaStream_t stream = static_cast<cudaStream_t>(s);
  check_peer("signal", "peer_rank", peer);
  check_errors();
  cuda::DeviceGuard guard(opt_.device);
  cuda::signal_async(peer_pads_[peer] + opt_.rank, ++sent_[peer], stream);
}

void IpcWindow::wait_signal(int peer, std::chrono::milliseconds timeout, void* s) {
  cudaStream_t stream = static_cast<cudaStream_t>(s);
  check_peer("wait_signal", "peer_rank", peer);
  check_errors();
  cuda::DeviceGuard guard(opt_.device);
  if (timeout.count() <= 0) timeout = opt_.timeout;
  last_wait_timeout_ = timeout;  // what check_errors reports
  const auto ns =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count());
  cuda::wait_signal_async(static_cast<uint64_t*>(pad_.get()) + peer, ++seen_[peer], error_dev_, ns,
                          stream);
}

void IpcWindow::check_errors() {
  const int e = *static_cast<volatile int*>(error_.get());
  if (e == cuda::kBarrierOk) return;
  *static_cast<volatile int*>(error_.get()) = 0;
  throw Error(ErrorCode::kTimeout,
              detail::cat(prefix("wait_signal"),
                          "a device-side wait (wait_signal, or a device window's wait or barrier) "
                          "timed out after ",
                          dev_ ? std::max(last_wait_timeout_, opt_.timeout).count()
                               : last_wait_timeout_.count(),
                          " ms (a peer never signalled)"));
}

}  // namespace fastcomms
