// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

// (Private to backends/nvlink.) File descriptors between the processes of one host: each
// process listens on an abstract-namespace unix socket whose name is a fresh random token
// (published through the store only); a sender connects, writes a header and passes the
// descriptor as SCM_RIGHTS. The receiver accepts only connections from its own user id, and
// keeps messages that arrive before they are asked for. NOTE [vmm windows] uses it to share
// cuMemCreate allocations.

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

namespace fastcomms {

class FdChannel {
 public:
  /// What travels beside a descriptor.
  struct Header {
    uint64_t tag = 0;   ///< The exchange it belongs to (the same on every rank).
    int32_t from = -1;  ///< The sender's rank.
    int64_t bytes = 0;  ///< The size of what the descriptor refers to.
  };
  /// A received descriptor (owned by the caller) and its size.
  struct Received {
    int fd = -1;
    int64_t bytes = 0;
  };

  /// Starts listening on a fresh abstract address.
  FdChannel();
  ~FdChannel();
  FdChannel(const FdChannel&) = delete;
  FdChannel& operator=(const FdChannel&) = delete;

  /// The address peers pass to send().
  const std::string& address() const { return address_; }
  /// Passes `fd` (not consumed) with `header` to the channel listening at `address`; retries a
  /// refused or full listener until `timeout`.
  static void send(const std::string& address, const Header& header, int fd,
                   std::chrono::milliseconds timeout);
  /// The descriptor rank `from` sent for `tag`, waiting up to `timeout` (throws kTimeout).
  Received receive(uint64_t tag, int32_t from, std::chrono::milliseconds timeout);

 private:
  int listen_fd_ = -1;
  std::string address_;
  std::map<std::pair<uint64_t, int32_t>, Received> early_;  // arrived before asked for
};

}  // namespace fastcomms
