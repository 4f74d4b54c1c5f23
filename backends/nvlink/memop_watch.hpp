// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// (Private to backends/nvlink.) NOTE [memop watchdog]: the host side of the SM-free barriers
/// (NOTE [memop barrier] in fastcomms/cuda/memops.hpp). A stream memory wait has no timeout, so
/// every call on that path hands this watchdog three events (before its entry barrier, between
/// the barriers, after its exit barrier) and the tokens it waits for. One thread watches the
/// oldest unfinished call: once its current stage has waited `timeout`, or a peer's slot holds a
/// token of this generation that differs from the expected one (the peer runs another
/// geometry), it stores the error into the group's error word and releases the wait by writing
/// the expected tokens into this rank's own slots, so the stream never hangs; later calls of
/// that generation are released on sight. On its own error it also writes a poison token (this
/// generation, every key bit set) into this rank's slot of every peer for that stage, so a peer
/// that arrives late fails on it too instead of passing on the tokens this rank wrote before
/// giving up. The error surfaces on the next call (check_errors),
/// which also starts a new generation, so tokens a late peer still writes can never satisfy a
/// later wait. Released calls have written into peers' windows of the same size (never out of
/// bounds) and every rank is told. The thread sleeps while no call is pending.

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "fastcomms/cuda/runtime.hpp"

namespace fastcomms {

class MemopWatch {
 public:
  /// `slots`: this rank's memop slots on `device`, [2 stages][size senders]; `peers[q]`: peer
  /// q's slots mapped here; `error`: the group's host-visible error word (BarrierError values);
  /// `timeout`: per stage.
  MemopWatch(int device, int rank, int size, uint64_t* slots, std::vector<uint64_t*> peers,
             volatile int* error, std::chrono::milliseconds timeout);
  /// Stops the thread; the owner lets the device finish first (pending waits are released by
  /// the watchdog only while it runs).
  ~MemopWatch();
  MemopWatch(const MemopWatch&) = delete;
  MemopWatch& operator=(const MemopWatch&) = delete;

  /// The three events of one call (pooled).
  struct Ticket {
    cudaEvent_t start = nullptr, mid = nullptr, end = nullptr;
    uint64_t tokens[2] = {0, 0};  ///< Entry and exit tokens.
    uint64_t generation = 0;
    std::chrono::steady_clock::time_point since{};  // when the current stage was seen running
    int stage = -1;                                 // -1: not started
  };
  /// Events for a new call (record `start`, `mid`, `end` on the call's stream, then submit).
  Ticket take();
  /// Hands the recorded call to the watchdog.
  void submit(Ticket t);

 private:
  void loop();
  bool finished(Ticket& t);  // polls the front call; releases or flags it when due
  void release(int stage, uint64_t token);
  void poison_peers(int stage, uint64_t token);
  bool peer_differs(int stage, uint64_t token);

  int device_, rank_, size_;
  uint64_t* slots_;
  std::vector<uint64_t*> peers_;
  volatile int* error_;
  std::chrono::milliseconds timeout_;
  cuda::Stream stream_;            // the watchdog's own copies
  cuda::PinnedBuffer host_;        // [size] words read from or written to the slots
  std::vector<cudaEvent_t> free_;  // pooled events
  std::deque<Ticket> pending_;     // in stream order
  uint64_t doomed_ = 0;            // generations <= this - 1 are released on sight
  std::chrono::steady_clock::time_point last_probe_{};
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace fastcomms
