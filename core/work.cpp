// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/work.hpp"

#include "fastcomms/error.hpp"

namespace fastcomms {

AsyncWork::AsyncWork(std::string what, std::chrono::steady_clock::time_point deadline)
    : what_(std::move(what)), deadline_(deadline) {}

WorkStatus AsyncWork::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return status_;
}

void AsyncWork::start() {
  std::lock_guard<std::mutex> lock(mu_);
  if (status_ == WorkStatus::kNotStarted) status_ = WorkStatus::kInProgress;
}

void AsyncWork::complete() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_ == WorkStatus::kCompleted || status_ == WorkStatus::kError ||
        status_ == WorkStatus::kTimedOut)
      return;
    status_ = WorkStatus::kCompleted;
  }
  cv_.notify_all();
}

void AsyncWork::fail(std::exception_ptr error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (status_ == WorkStatus::kCompleted || status_ == WorkStatus::kError ||
        status_ == WorkStatus::kTimedOut)
      return;
    bool timeout = false;
    try {
      std::rethrow_exception(error);
    } catch (const Error& e) {
      timeout = e.code() == ErrorCode::kTimeout;
    } catch (...) {
    }
    status_ = timeout ? WorkStatus::kTimedOut : WorkStatus::kError;
    error_ = error;
  }
  cv_.notify_all();
}

void AsyncWork::on_timeout(std::function<void()> fn) {
  std::lock_guard<std::mutex> lock(mu_);
  on_timeout_.push_back(std::move(fn));
}

bool AsyncWork::wait_until(std::chrono::steady_clock::time_point until) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_until(lock, until, [&] {
    return status_ == WorkStatus::kCompleted || status_ == WorkStatus::kError ||
           status_ == WorkStatus::kTimedOut;
  });
}

void AsyncWork::wait() {
  if (!wait_until(deadline_)) {
    std::vector<std::function<void()>> hooks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      hooks.swap(on_timeout_);
    }
    for (auto& hook : hooks) hook();
    fail(std::make_exception_ptr(
        Error(ErrorCode::kTimeout, what_ + "timed out: the op did not complete in time")));
  }
  std::exception_ptr err;
  std::vector<std::function<void()>> hooks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    err = error_;
    // A backend that times the op out itself (its worker failed it with a timeout) ends this
    // wait in a timeout too: the hooks run here, on the waiting thread, never on the worker.
    if (status_ == WorkStatus::kTimedOut) hooks.swap(on_timeout_);
  }
  for (auto& hook : hooks) hook();
  if (err) std::rethrow_exception(err);
}

}  // namespace fastcomms
