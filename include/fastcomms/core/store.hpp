// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Key-value stores for rendezvous: the interface, an in-memory store (ranks as threads), a
/// file-backed store (ranks as processes on one host) and a prefix wrapper.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "fastcomms/core/options.hpp"

namespace fastcomms {

/// A rendezvous store (torch.distributed.Store's operations). Thread-safe.
class Store {
 public:
  virtual ~Store() = default;
  /// Sets `key` to `value` (overwrites).
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  /// Waits up to `timeout` for `key`, then returns its value; kTimeout error otherwise.
  virtual std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  /// Adds `delta` to the integer at `key` (0 when absent) and returns the new value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  /// True when every key exists (does not wait).
  virtual bool check(const std::vector<std::string>& keys) = 0;
  /// Removes `key`; true when it existed.
  virtual bool delete_key(const std::string& key) = 0;
  /// Waits up to `timeout` until every key exists; kTimeout error naming the missing keys.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);

  /// get() with the store's default timeout.
  std::vector<uint8_t> get(const std::string& key) { return get(key, timeout_); }
  /// wait() with the store's default timeout.
  void wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }
  /// The default timeout of get() and wait().
  std::chrono::milliseconds timeout() const { return timeout_; }
  /// Changes the default timeout.
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }

  /// Convenience: set a string value.
  void set_string(const std::string& key, const std::string& value) {
    set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  /// Convenience: get a string value.
  std::string get_string(const std::string& key, std::chrono::milliseconds timeout) {
    auto v = get(key, timeout);
    return std::string(v.begin(), v.end());
  }

 protected:
  std::chrono::milliseconds timeout_ = std::chrono::seconds(300);
};

/// A store in this process's memory: for ranks that are threads.
class MemoryStore : public Store {
 public:
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>> data_;
};

/// A store in a directory shared by processes on one host: one file per key, written atomically
/// (temporary file + rename), created with mode 0600 (the directory 0700); add() is serialized
/// with an flock on a lock file.
class FileStore : public Store {
 public:
  /// @param dir the directory (created if missing)
  explicit FileStore(std::string dir);
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool delete_key(const std::string& key) override;
  /// The directory.
  const std::string& dir() const { return dir_; }

 private:
  std::string path_of(const std::string& key) const;
  std::string dir_;
};

/// A store over a base store: every operation passes through to it, each key with `key_prefix`
/// in front (empty: the keys as they are). The default timeout starts as the base's.
class ForwardingStore : public Store {
 public:
  using Store::get;
  using Store::wait;
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    base_->set(key_prefix_ + key, value);
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    return base_->get(key_prefix_ + key, timeout);
  }
  int64_t add(const std::string& key, int64_t delta) override {
    return base_->add(key_prefix_ + key, delta);
  }
  bool check(const std::vector<std::string>& keys) override { return base_->check(prefixed(keys)); }
  bool delete_key(const std::string& key) override { return base_->delete_key(key_prefix_ + key); }
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override {
    base_->wait(prefixed(keys), timeout);
  }
  /// The underlying store.
  const std::shared_ptr<Store>& base() const { return base_; }

 protected:
  /// A null `base` is the subclass's to refuse (each names itself).
  explicit ForwardingStore(std::shared_ptr<Store> base, std::string key_prefix = {})
      : base_(std::move(base)), key_prefix_(std::move(key_prefix)) {
    if (base_ != nullptr) timeout_ = base_->timeout();
  }
  std::shared_ptr<Store> base_;

 private:
  std::vector<std::string> prefixed(const std::vector<std::string>& keys) const {
    if (key_prefix_.empty()) return keys;
    std::vector<std::string> ks;
    for (const auto& key : keys) ks.push_back(key_prefix_ + key);
    return ks;
  }
  std::string key_prefix_;
};

/// Prepends "prefix/" to every key of an underlying store.
class PrefixStore : public ForwardingStore {
 public:
  /// @param prefix the namespace
  /// @param base the store keys land in
  PrefixStore(std::string prefix, std::shared_ptr<Store> base);
};

/// NOTE [store keys released at finalize]: the key space of one communicator (an incarnation,
/// NOTE [store incarnations]) remembers every key this rank writes through it and has not deleted
/// since (set and add, its splits' keys included). At finalize() every rank publishes that list
/// and counts itself in;
/// the last rank to finalize deletes every rank's keys, the lists and the count, so a store
/// shared by many communicators keeps one key per communicator name (its incarnation counter)
/// instead of growing with every communicator. A rank that never finalizes (it died) leaves its
/// communicator's keys; FASTCOMMS_KEEP_STORE_KEYS=1 keeps them all (post-mortem of a rendezvous).
class KeyTrackingStore : public ForwardingStore {
 public:
  explicit KeyTrackingStore(std::shared_ptr<Store> base);
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool delete_key(const std::string& key) override;
  /// The keys written so far, in order.
  std::vector<std::string> written() const;
  /// The finalize step of the note above for `rank` of `size`; never throws (a store that is
  /// gone leaves the keys). Returns the number of keys deleted (0 unless this rank was last).
  int64_t release(int rank, int size, std::chrono::milliseconds timeout) noexcept;

 private:
  void note(const std::string& key);
  mutable std::mutex mu_;
  std::vector<std::string> keys_;
  std::set<std::string> seen_;
};

}  // namespace fastcomms
