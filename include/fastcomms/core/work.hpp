// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Work handles: the result of issuing an op.

#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace fastcomms {

/// Where an op stands (torchcomms' WorkStatus).
enum class WorkStatus : int {
  kNotStarted = 0,
  kInProgress = 1,
  kCompleted = 2,
  kTimedOut = 3,
  kError = 4,
};

/// torchcomms' name of `s` ("NOT_STARTED", "INPROGRESS", ...).
const char* work_status_name(WorkStatus s) noexcept;

/// A handle on an issued op. Thread-safe.
///
/// NOTE [work keeps its buffers]: an op's buffers must outlive the op, whatever the caller drops.
/// Whoever drives an op (a backend's worker thread, a CUDA backend's watchdog) holds its Work
/// until the transport is done with the buffers, so everything attached with hold() lives at
/// least that long: a dropped async handle never frees memory under a transfer.
class Work {
 public:
  virtual ~Work() = default;
  /// Keeps `resource` alive as long as this Work (see NOTE [work keeps its buffers]).
  void hold(std::shared_ptr<const void> resource) {
    std::lock_guard<std::mutex> lock(held_mu_);
    held_.push_back(std::move(resource));
  }
  /// Current status; never blocks.
  virtual WorkStatus status() const = 0;
  /// True once the op has finished, successfully or not (a backend written in Python keeps
  /// torchcomms' meaning of its works: complete only as COMPLETED).
  virtual bool is_completed() const {
    const WorkStatus s = status();
    return s == WorkStatus::kCompleted || s == WorkStatus::kTimedOut || s == WorkStatus::kError;
  }
  /// Waits for the op (CPU backends block the host; CUDA backends make the caller's current
  /// stream wait). Rethrows the op's error, if any, every time it is called.
  virtual void wait() = 0;
  /// True once the transport no longer touches the caller's tensors (default: is_completed()).
  /// A Work that finishes inside wait() (an unpack from internal buffers) is done with them
  /// earlier, so a dropped handle that is never waited releases them all the same.
  virtual bool tensors_released() const { return is_completed(); }

  /// NOTE [wait observers]: `fn` runs once, on the thread of the first frontend wait on this
  /// work that returns without an error (the clog's end and wait events): the frontends (the
  /// Python work, the process group's) call waited() after wait(); a work waited before `fn` is
  /// added runs it at once.
  void on_waited(std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(held_mu_);
      if (!was_waited_) {
        on_waited_.push_back(std::move(fn));
        return;
      }
    }
    fn();
  }
  /// Runs the wait observers, once (the frontends call it after a wait that returned).
  void waited() {
    std::vector<std::function<void()>> fns;
    {
      std::lock_guard<std::mutex> lock(held_mu_);
      if (was_waited_) return;
      was_waited_ = true;
      fns.swap(on_waited_);
    }
    for (auto& fn : fns) fn();
  }

 private:
  std::mutex held_mu_;
  std::vector<std::shared_ptr<const void>> held_;
  std::vector<std::function<void()>> on_waited_;
  bool was_waited_ = false;
};

using WorkPtr = std::shared_ptr<Work>;

/// A Work completed by some other thread (a backend's worker, a transport callback).
///
/// It carries a deadline: wait() gives up at the deadline with a Timeout error even when nothing
/// ever completes the op, so a missing peer never hangs a waiter.
class AsyncWork : public Work {
 public:
  /// @param what message prefix for the timeout error ("[rank r/n comm op]")
  /// @param deadline when wait() gives up; time_point::max() for never
  AsyncWork(std::string what, std::chrono::steady_clock::time_point deadline);

  WorkStatus status() const override;
  void wait() override;

  /// Marks the op running.
  void start();
  /// Marks the op completed successfully.
  void complete();
  /// Marks the op failed with `error` (a fastcomms::Error, or anything else).
  void fail(std::exception_ptr error);
  /// Waits at most until `until`; true when the op has finished. Does not throw.
  bool wait_until(std::chrono::steady_clock::time_point until);
  /// Adds a hook run once, outside the lock, on the waiting thread, when a wait() ends in a
  /// timeout (its deadline passed, or the backend timed the op out), before it throws (the
  /// flight recorder's dump); hooks run in the order added.
  void on_timeout(std::function<void()> fn);

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  WorkStatus status_ = WorkStatus::kNotStarted;
  std::exception_ptr error_;
  std::string what_;
  std::chrono::steady_clock::time_point deadline_;
  std::vector<std::function<void()>> on_timeout_;
};

/// A Work that is already complete.
class CompletedWork : public Work {
 public:
  WorkStatus status() const override { return WorkStatus::kCompleted; }
  void wait() override {}
};

}  // namespace fastcomms
