// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/store.hpp"

#include <algorithm>
#include <cstdlib>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <thread>

#include "fastcomms/core/log.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

using Clock = std::chrono::steady_clock;

std::string join_keys(const std::vector<std::string>& keys) {
  std::string out;
  for (const auto& k : keys) out += (out.empty() ? "'" : ", '") + k + "'";
  return out;
}

[[noreturn]] void throw_errno(const std::string& what) {
  throw Error(ErrorCode::kBackendError, what + ": " + std::strerror(errno));
}

// Sleeps a little longer each round, up to 10 ms: cheap polling for file-backed waits.
class Backoff {
 public:
  void sleep() {
    std::this_thread::sleep_for(std::chrono::microseconds(us_));
    us_ = std::min(us_ * 2, 10'000);
  }

 private:
  int us_ = 50;
};

}  // namespace

void Store::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  Backoff backoff;
  while (!check(keys)) {
    if (Clock::now() >= deadline) {
      std::vector<std::string> missing;
      for (const auto& k : keys)
        if (!check({k})) missing.push_back(k);
      throw Error(ErrorCode::kTimeout, detail::cat("store: timed out after ", timeout.count(),
                                                   " ms waiting for ", join_keys(missing)));
    }
    backoff.sleep();
  }
}

// ---- MemoryStore ------------------------------------------------------------------------------

void MemoryStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    data_[key] = value;
  }
  cv_.notify_all();
}

std::vector<uint8_t> MemoryStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);
  std::lock_guard<std::mutex> lock(mu_);
  return data_.at(key);
}

int64_t MemoryStore::add(const std::string& key, int64_t delta) {
  int64_t value = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = data_.find(key);
    if (it != data_.end()) value = std::stoll(std::string(it->second.begin(), it->second.end()));
    value += delta;
    const std::string s = std::to_string(value);
    data_[key] = std::vector<uint8_t>(s.begin(), s.end());
  }
  cv_.notify_all();
  return value;
}

bool MemoryStore::check(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& k : keys)
    if (!data_.count(k)) return false;
  return true;
}

bool MemoryStore::delete_key(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  return data_.erase(key) > 0;
}

void MemoryStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const auto all = [&] {
    for (const auto& k : keys)
      if (!data_.count(k)) return false;
    return true;
  };
  if (!cv_.wait_for(lock, timeout, all)) {
    std::vector<std::string> missing;
    for (const auto& k : keys)
      if (!data_.count(k)) missing.push_back(k);
    throw Error(ErrorCode::kTimeout, detail::cat("store: timed out after ", timeout.count(),
                                                 " ms waiting for ", join_keys(missing)));
  }
}

// ---- FileStore --------------------------------------------------------------------------------

FileStore::FileStore(std::string dir) : dir_(std::move(dir)) {
  if (::mkdir(dir_.c_str(), 0700) != 0 && errno != EEXIST)
    throw_errno("FileStore: cannot create directory '" + dir_ + "'");
}

std::string FileStore::path_of(const std::string& key) const {
  // Keys may hold '/' and anything else: hex-encode them into a flat file name.
  static constexpr char kHex[] = "0123456789abcdef";
  std::string name = "k_";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '_' || c == '-') {
      name += static_cast<char>(c);
    } else {
      name += '%';
      name += kHex[c >> 4];
      name += kHex[c & 15];
    }
  }
  return dir_ + "/" + name;
}

void FileStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  const std::string path = path_of(key);
  const std::string tmp = detail::cat(path, ".tmp.", ::getpid(), ".",
                                      std::hash<std::thread::id>{}(std::this_thread::get_id()));
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) throw_errno("FileStore: cannot create '" + tmp + "'");
  size_t off = 0;
  while (off < value.size()) {
    const ssize_t n = ::write(fd, value.data() + off, value.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      throw_errno("FileStore: cannot write '" + tmp + "'");
    }
    off += static_cast<size_t>(n);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) throw_errno("FileStore: cannot rename to " + path);
}

std::vector<uint8_t> FileStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  wait({key}, timeout);
  const std::string path = path_of(key);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw_errno("FileStore: cannot open '" + path + "'");
  std::vector<uint8_t> out;
  uint8_t buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      throw_errno("FileStore: cannot read '" + path + "'");
    }
    if (n == 0) break;
    out.insert(out.end(), buf, buf + n);
  }
  ::close(fd);
  return out;
}

int64_t FileStore::add(const std::string& key, int64_t delta) {
  const std::string lock_path = dir_ + "/.lock";
  const int lock_fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) throw_errno("FileStore: cannot open lock '" + lock_path + "'");
  while (::flock(lock_fd, LOCK_EX) != 0) {
    if (errno != EINTR) {
      ::close(lock_fd);
      throw_errno("FileStore: flock");
    }
  }
  int64_t value = 0;
  try {
    if (check({key})) {
      auto v = get(key, std::chrono::milliseconds(0));
      value = std::stoll(std::string(v.begin(), v.end()));
    }
    value += delta;
    const std::string s = std::to_string(value);
    set(key, std::vector<uint8_t>(s.begin(), s.end()));
  } catch (...) {
    ::flock(lock_fd, LOCK_UN);
    ::close(lock_fd);
    throw;
  }
  ::flock(lock_fd, LOCK_UN);
  ::close(lock_fd);
  return value;
}

bool FileStore::check(const std::vector<std::string>& keys) {
  for (const auto& k : keys)
    if (::access(path_of(k).c_str(), F_OK) != 0) return false;
  return true;
}

bool FileStore::delete_key(const std::string& key) { return ::unlink(path_of(key).c_str()) == 0; }

// ---- PrefixStore ------------------------------------------------------------------------------

PrefixStore::PrefixStore(std::string prefix, std::shared_ptr<Store> base)
    : ForwardingStore(std::move(base), std::move(prefix) + "/") {
  FASTCOMMS_CHECK(base_ != nullptr, kInvalidArgument, "PrefixStore: base store is null");
}

// ---- KeyTrackingStore ---------------------------------------------------------------------

KeyTrackingStore::KeyTrackingStore(std::shared_ptr<Store> base) : ForwardingStore(std::move(base)) {
  FASTCOMMS_CHECK(base_ != nullptr, kInvalidArgument, "KeyTrackingStore: base store is null");
}

void KeyTrackingStore::note(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (seen_.insert(key).second) keys_.push_back(key);
}
void KeyTrackingStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  note(key);
  base_->set(key, value);
}
int64_t KeyTrackingStore::add(const std::string& key, int64_t delta) {
  note(key);
  return base_->add(key, delta);
}
bool KeyTrackingStore::delete_key(const std::string& key) {
  {  // a key deleted before finalize is not finalize's to delete (and is not remembered forever)
    std::lock_guard<std::mutex> lock(mu_);
    if (seen_.erase(key) != 0) keys_.erase(std::find(keys_.begin(), keys_.end(), key));
  }
  return base_->delete_key(key);
}
std::vector<std::string> KeyTrackingStore::written() const {
  std::lock_guard<std::mutex> lock(mu_);
  return keys_;
}

int64_t KeyTrackingStore::release(int rank, int size, std::chrono::milliseconds timeout) noexcept {
  try {
    if (const char* keep = std::getenv("FASTCOMMS_KEEP_STORE_KEYS"); keep && *keep && *keep != '0')
      return 0;
    // The list: keys joined by '\n' (keys never hold a newline: they are built by fastcomms).
    std::string list;
    for (const auto& k : written()) list += k + "\n";
    base_->set(detail::cat("finalized/keys/", rank),
               std::vector<uint8_t>(list.begin(), list.end()));
    if (base_->add("finalized/count", 1) != size) return 0;
    int64_t deleted = 0;
    for (int r = 0; r < size; ++r) {
      const std::string lk = detail::cat("finalized/keys/", r);
      const auto v = base_->get(lk, timeout);  // set before that rank counted itself in
      std::string k;
      for (uint8_t c : v) {
        if (c != '\n') {
          k.push_back(static_cast<char>(c));
        } else if (!k.empty()) {
          deleted += base_->delete_key(k);
          k.clear();
        }
      }
      base_->delete_key(lk);
    }
    base_->delete_key("finalized/count");
    return deleted;
  } catch (...) {  // the store may be gone with its host: the keys stay, finalize returns
    FASTCOMMS_LOG(kInfo, "finalize: the communicator's store keys were not deleted: ",
                  log::current_exception_text());
    return 0;
  }
}

}  // namespace fastcomms
