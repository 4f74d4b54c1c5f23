// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [nccl call check] (call_checker.hpp): fingerprint slots, their copies, and the comparison.
#include "backends/nccl/call_checker.hpp"

#include <cstring>

#include "fastcomms/core/log.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::nccl_backend {
namespace {

// What the mismatched op's error says after the mismatch and this rank's call.
constexpr const char* kFoundBeside =
    "; found by the call check beside the op (FASTCOMMS_CHECK_CALLS=1, NOTE [nccl call check]), "
    "so NCCL may have run the op and its outputs may hold mixed data. The communicator was "
    "aborted; FASTCOMMS_CHECK_CALLS=strict compares calls before any data moves";

}  // namespace

CallChecker::CallChecker(std::shared_ptr<NcclApi> api, int size, CheckPlacement placement)
    : api_(std::move(api)),
      size_(size),
      placement_(placement),
      stride_(sizeof(WireFingerprint) * (static_cast<size_t>(size) + 1)) {}

CallChecker::~CallChecker() { close(); }

char* CallChecker::host_slot(int slot) const {
  return static_cast<char*>(slabs_[slot / kSlabSlots].host->get()) + stride_ * (slot % kSlabSlots);
}
char* CallChecker::device_slot(int slot) const {
  return static_cast<char*>(slabs_[slot / kSlabSlots].device->get()) +
         stride_ * (slot % kSlabSlots);
}
cudaEvent_t CallChecker::landed(int slot) const {
  return slabs_[slot / kSlabSlots].landed[slot % kSlabSlots]->get();
}
cudaEvent_t CallChecker::staged(int slot) const {
  return slabs_[slot / kSlabSlots].staged[slot % kSlabSlots]->get();
}

int CallChecker::acquire(const WireCall& call, const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  FASTCOMMS_CHECK(!closed_, kInternal, prefix, "call check: the communicator is closed");
  if (free_.empty()) {
    // A slot is free again once its check is compared, so slabs are added only while more than
    // all of them are in flight (a rank far ahead of its GPU or of a peer); they are kept.
    const bool copies = !placement_.mapped;
    const bool side = copies && !placement_.fuse;
    Slab slab;
    const size_t bytes = stride_ * kSlabSlots;
    slab.host = std::make_unique<HostBuffer>(
        *api_, bytes, cudaHostAllocPortable | (copies ? 0u : cudaHostAllocMapped), prefix);
    std::memset(slab.host->get(), 0, bytes);
    if (copies) slab.device = std::make_unique<DeviceBuffer>(*api_, bytes, prefix);
    for (int i = 0; i < kSlabSlots; ++i) {
      slab.landed.push_back(std::make_unique<Event>(*api_, prefix));
      if (side) slab.staged.push_back(std::make_unique<Event>(*api_, prefix));
    }
    if (side && !side_) side_ = std::make_unique<Stream>(*api_, false, prefix);
    const int base = static_cast<int>(slabs_.size()) * kSlabSlots;
    slabs_.push_back(std::move(slab));
    calls_.resize(static_cast<size_t>(base + kSlabSlots));
    for (int i = kSlabSlots - 1; i >= 0; --i) free_.push_back(base + i);
  }
  const int slot = free_.back();
  free_.pop_back();
  calls_[static_cast<size_t>(slot)] = call;
  std::memcpy(host_slot(slot), &call.wire, sizeof call.wire);
  return slot;
}

const void* CallChecker::send_buffer(int slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  return placement_.mapped ? host_slot(slot) : device_slot(slot);
}

void* CallChecker::recv_buffer(int slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  return (placement_.mapped ? host_slot(slot) : device_slot(slot)) + sizeof(WireFingerprint);
}

void CallChecker::stage(int slot, cudaStream_t stream, const std::string& prefix) {
  if (placement_.mapped) return;  // NCCL reads the host slot itself
  std::lock_guard<std::mutex> lock(mu_);
  cuda_check(*api_, prefix, "cudaMemcpyAsync",
             api_->cuda_memcpy_async(device_slot(slot), host_slot(slot), sizeof(WireFingerprint),
                                     cudaMemcpyHostToDevice, stream));
}

void CallChecker::land(int slot, cudaStream_t stream, const std::string& prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  const size_t bytes = sizeof(WireFingerprint) * static_cast<size_t>(size_);
  const auto copy_back = [&](cudaStream_t s) {
    cuda_check(*api_, prefix, "cudaMemcpyAsync",
               api_->cuda_memcpy_async(host_slot(slot) + sizeof(WireFingerprint),
                                       device_slot(slot) + sizeof(WireFingerprint), bytes,
                                       cudaMemcpyDeviceToHost, s));
  };
  if (placement_.mapped) {  // NCCL wrote the host slot: landed once the all-gather is done
    cuda_check(*api_, prefix, "cudaEventRecord", api_->cuda_event_record(landed(slot), stream));
  } else if (placement_.fuse) {  // after the op's group, on its stream
    copy_back(stream);
    cuda_check(*api_, prefix, "cudaEventRecord", api_->cuda_event_record(landed(slot), stream));
  } else {  // beside the op: a side stream copies while the op runs (or hangs)
    cuda_check(*api_, prefix, "cudaEventRecord", api_->cuda_event_record(staged(slot), stream));
    cuda_check(*api_, prefix, "cudaStreamWaitEvent",
               api_->cuda_stream_wait_event(side_->get(), staged(slot), 0));
    copy_back(side_->get());
    cuda_check(*api_, prefix, "cudaEventRecord",
               api_->cuda_event_record(landed(slot), side_->get()));
  }
}

void CallChecker::join(int slot, cudaStream_t stream, const std::string& prefix) {
  if (placement_.mapped || placement_.fuse) return;  // landed before the op's end already
  std::lock_guard<std::mutex> lock(mu_);
  cuda_check(*api_, prefix, "cudaStreamWaitEvent",
             api_->cuda_stream_wait_event(stream, landed(slot), 0));
}

void CallChecker::track(int slot, const CallFingerprint& mine, std::shared_ptr<CheckedWork> work) {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_) {  // compared no more (the communicator is gone, or this rank's device is)
    if (!closed_) free_.push_back(slot);
    return;
  }
  checks_.push_back(Check{slot, calls_[static_cast<size_t>(slot)], mine, std::move(work)});
}

void CallChecker::abandon(int slot) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!closed_) free_.push_back(slot);
}

bool CallChecker::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  if (cancelled_) return !mismatch_.empty();
  std::vector<WireFingerprint> all(static_cast<size_t>(size_));
  while (!checks_.empty()) {
    Check& c = checks_.front();
    const cudaError_t q = api_->cuda_event_query(landed(c.slot));
    if (q == cudaErrorNotReady) break;
    if (q != cudaSuccess) {
      // A failed device: the op's own wait and the watchdog report it; the check stops here.
      (void)api_->cuda_get_last_error();
      FASTCOMMS_LOG(kWarn, "nccl: the call check stops: its event query failed with ",
                    api_->cuda_get_error_name(q));
      cancelled_ = true;
      checks_.clear();
      break;
    }
    std::memcpy(static_cast<void*>(all.data()), host_slot(c.slot) + sizeof(WireFingerprint),
                all.size() * sizeof(WireFingerprint));
    std::string m = wire_mismatch(all.data(), size_, c.call);
    if (m.empty()) {
      free_.push_back(c.slot);
      checks_.pop_front();
      continue;
    }
    // Every rank compares the same bytes, so every rank fails here. Later ops went to an
    // aborted communicator; their slots are never reused (no copy of an aborted kernel's is
    // waited for).
    mismatch_ = std::move(m);
    if (c.work)
      c.work->fail(ErrorCode::kInvalidArgument, detail::cat(mismatch_, " (this rank called ",
                                                            describe(c.mine), ")", kFoundBeside));
    checks_.pop_front();
    for (Check& later : checks_)
      if (later.work)
        later.work->fail(ErrorCode::kInvalidArgument,
                         detail::cat("a collective issued before this one was mismatched across "
                                     "ranks, so the communicator was aborted: ",
                                     mismatch_));
    checks_.clear();
    cancelled_ = true;
    break;
  }
  return !mismatch_.empty();
}

std::string CallChecker::mismatch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return mismatch_;
}

bool CallChecker::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return !checks_.empty();
}

void CallChecker::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  checks_.clear();
}

void CallChecker::close() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = closed_ = true;
  checks_.clear();
  free_.clear();
  calls_.clear();
  slabs_.clear();
  side_.reset();
}

}  // namespace fastcomms::nccl_backend
