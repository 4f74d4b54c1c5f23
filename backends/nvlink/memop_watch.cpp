// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [memop watchdog] (backends/nvlink/memop_watch.hpp).
#include "backends/nvlink/memop_watch.hpp"

#include <algorithm>

#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/check.hpp"

namespace fastcomms {
namespace {
using Clock = std::chrono::steady_clock;
// How long a stage runs before the slots are read for a differing token, and how often then.
constexpr auto kProbeAfter = std::chrono::milliseconds(2);
constexpr auto kProbeEvery = std::chrono::milliseconds(5);
// The poll period while a call is pending.
constexpr auto kPoll = std::chrono::microseconds(100);

bool done(cudaEvent_t e) {
  const cudaError_t r = cudaEventQuery(e);
  (void)cudaGetLastError();
  // Not ready: still pending. Any other error is sticky (nothing more completes): stop watching.
  return r != cudaErrorNotReady;
}
}  // namespace

MemopWatch::MemopWatch(int device, int rank, int size, uint64_t* slots,
                       std::vector<uint64_t*> peers, volatile int* error,
                       std::chrono::milliseconds timeout)
    : device_(device),
      rank_(rank),
      size_(size),
      slots_(slots),
      peers_(std::move(peers)),
      error_(error),
      timeout_(timeout),
      stream_(false),
      host_(sizeof(uint64_t) * static_cast<size_t>(size)) {
  thread_ = std::thread([this] { loop(); });
}

MemopWatch::~MemopWatch() {
  stop_ = true;
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (const Ticket& t : pending_) free_.insert(free_.end(), {t.start, t.mid, t.end});
  for (cudaEvent_t e : free_) (void)cudaEventDestroy(e);
}

MemopWatch::Ticket MemopWatch::take() {
  Ticket t;
  std::lock_guard<std::mutex> lock(mu_);
  for (cudaEvent_t* e : {&t.start, &t.mid, &t.end}) {
    if (!free_.empty()) {
      *e = free_.back();
      free_.pop_back();
    } else {
      FASTCOMMS_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
  }
  return t;
}

void MemopWatch::submit(Ticket t) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.push_back(t);
  }
  cv_.notify_one();
}

void MemopWatch::loop() {
  (void)cudaSetDevice(device_);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    if (pending_.empty()) {
      cv_.wait_for(lock, std::chrono::milliseconds(50));
      continue;
    }
    Ticket& front = pending_.front();
    if (finished(front)) {
      free_.insert(free_.end(), {front.start, front.mid, front.end});
      pending_.pop_front();
      continue;
    }
    lock.unlock();
    std::this_thread::sleep_for(kPoll);
    lock.lock();
  }
}

bool MemopWatch::finished(Ticket& t) {
  if (done(t.end)) return true;
  if (!done(t.start)) return false;
  const int stage = done(t.mid) ? 1 : 0;
  const auto now = Clock::now();
  if (stage != t.stage) {
    t.stage = stage;
    t.since = now;
  }
  const uint64_t token = t.tokens[stage];
  int error = cuda::kBarrierOk;
  if (t.generation < doomed_) {
    release(stage, token);  // an earlier stage of this generation failed: do not wait again
    return false;
  }
  if (now - t.since > timeout_) {
    error = cuda::kBarrierTimeout;
  } else if (now - t.since > kProbeAfter && now - last_probe_ > kProbeEvery) {
    last_probe_ = now;
    // Only while the stage still runs after the read: a stage that finished meanwhile may have
    // let the next call's tokens in.
    if (peer_differs(stage, token) && !done(stage == 0 ? t.mid : t.end))
      error = cuda::kBarrierMismatch;
  }
  if (error == cuda::kBarrierOk || done(stage == 0 ? t.mid : t.end)) return false;
  *error_ = error;
  doomed_ = std::max(doomed_, t.generation + 1);
  poison_peers(stage, token);
  release(stage, token);
  return false;
}

bool MemopWatch::peer_differs(int stage, uint64_t token) {
  auto* words = static_cast<uint64_t*>(host_.get());
  const size_t bytes = sizeof(uint64_t) * static_cast<size_t>(size_);
  if (cudaMemcpyAsync(words, slots_ + static_cast<size_t>(stage) * size_, bytes,
                      cudaMemcpyDeviceToHost, stream_.get()) != cudaSuccess ||
      cudaStreamSynchronize(stream_.get()) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  // A token of this generation with other key bits: the peer waits at another geometry. An
  // older generation's token is a late write from before an error, which no wait accepts.
  constexpr int kGenShift = 40;
  for (int q = 0; q < size_; ++q) {
    const uint64_t v = words[q];
    if (q != rank_ && v != 0 && v != token && (v >> kGenShift) == (token >> kGenShift)) return true;
  }
  return false;
}

void MemopWatch::poison_peers(int stage, uint64_t token) {
  constexpr uint64_t kKeyBits = (uint64_t{1} << 40) - 1;
  uint64_t poison = token | kKeyBits;
  if (poison == token) poison ^= 1;
  auto* word = static_cast<uint64_t*>(host_.get());
  for (int q = 0; q < size_; ++q) {
    if (q == rank_ || peers_[q] == nullptr) continue;
    *word = poison;
    (void)cudaMemcpyAsync(peers_[q] + static_cast<size_t>(stage) * size_ + rank_, word,
                          sizeof(uint64_t), cudaMemcpyHostToDevice, stream_.get());
    (void)cudaStreamSynchronize(stream_.get());
  }
  (void)cudaGetLastError();
}

void MemopWatch::release(int stage, uint64_t token) {
  auto* words = static_cast<uint64_t*>(host_.get());
  std::fill(words, words + size_, token);
  (void)cudaMemcpyAsync(slots_ + static_cast<size_t>(stage) * size_, words,
                        sizeof(uint64_t) * static_cast<size_t>(size_), cudaMemcpyHostToDevice,
                        stream_.get());
  (void)cudaStreamSynchronize(stream_.get());
  (void)cudaGetLastError();
}

}  // namespace fastcomms
