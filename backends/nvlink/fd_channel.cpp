// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "backends/nvlink/fd_channel.hpp"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <thread>

#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

using Clock = std::chrono::steady_clock;

// The sockaddr of abstract address `name` (a leading NUL byte, then the name).
std::pair<sockaddr_un, socklen_t> abstract_address(const std::string& name) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  FASTCOMMS_CHECK(name.size() + 1 < sizeof a.sun_path, kInternal, "fd channel: address too long");
  std::memcpy(a.sun_path + 1, name.data(), name.size());
  return {a, static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())};
}

std::string random_token() {
  std::ifstream urandom("/dev/urandom", std::ios::binary);
  unsigned char bytes[16] = {};
  urandom.read(reinterpret_cast<char*>(bytes), sizeof bytes);
  FASTCOMMS_CHECK(urandom.gcount() == sizeof bytes, kInternal,
                  "fd channel: cannot read /dev/urandom");
  static const char* hex = "0123456789abcdef";
  std::string s = "fastcomms-fd-";
  for (unsigned char b : bytes) s += {hex[b >> 4], hex[b & 15]};
  return s;
}

std::string errno_text() { return std::strerror(errno); }

// One message: a Header in the data, room for one descriptor in the control part.
struct Message {
  FdChannel::Header header;
  iovec io{};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
  msghdr msg{};
  Message() {
    io = {&header, sizeof header};
    msg.msg_iov = &io;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
  }
  Message(const Message&) = delete;
  Message& operator=(const Message&) = delete;
};

}  // namespace

FdChannel::FdChannel() {
  listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  FASTCOMMS_CHECK(listen_fd_ >= 0, kBackendError, "fd channel: socket(): ", errno_text());
  address_ = random_token();
  const auto [a, len] = abstract_address(address_);
  if (::bind(listen_fd_, reinterpret_cast<const sockaddr*>(&a), len) != 0 ||
      ::listen(listen_fd_, 128) != 0) {
    const std::string why = errno_text();
    ::close(listen_fd_);
    throw Error(ErrorCode::kBackendError, "fd channel: cannot listen: " + why);
  }
}

FdChannel::~FdChannel() {
  for (auto& [key, r] : early_) ::close(r.fd);
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void FdChannel::send(const std::string& address, const Header& header, int fd,
                     std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  const auto [a, len] = abstract_address(address);
  for (;;) {
    const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    FASTCOMMS_CHECK(s >= 0, kBackendError, "fd channel: socket(): ", errno_text());
    if (::connect(s, reinterpret_cast<const sockaddr*>(&a), len) == 0) {
      Message m;
      m.header = header;
      cmsghdr* c = CMSG_FIRSTHDR(&m.msg);
      c->cmsg_level = SOL_SOCKET;
      c->cmsg_type = SCM_RIGHTS;
      c->cmsg_len = CMSG_LEN(sizeof(int));
      std::memcpy(CMSG_DATA(c), &fd, sizeof fd);
      ssize_t n;
      do n = ::sendmsg(s, &m.msg, MSG_NOSIGNAL);
      while (n < 0 && errno == EINTR);
      const std::string why = n < 0 ? errno_text() : "";
      ::close(s);
      FASTCOMMS_CHECK(n == static_cast<ssize_t>(sizeof(Header)), kBackendError,
                      "fd channel: sendmsg(): ", n < 0 ? why : "short write");
      return;
    }
    const int err = errno;
    ::close(s);
    FASTCOMMS_CHECK(err == ECONNREFUSED || err == EAGAIN || err == ENOENT || err == EINTR,
                    kBackendError, "fd channel: connect(): ", std::strerror(err));
    FASTCOMMS_CHECK(Clock::now() < deadline, kTimeout,
                    "fd channel: the peer's listener did not accept within the timeout (",
                    std::strerror(err), ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

FdChannel::Received FdChannel::receive(uint64_t tag, int32_t from,
                                       std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (auto it = early_.find({tag, from}); it != early_.end()) {
      const Received r = it->second;
      early_.erase(it);
      return r;
    }
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    FASTCOMMS_CHECK(left > 0, kTimeout, "fd channel: rank ", from,
                    " did not pass its memory handle within the timeout");
    pollfd p{listen_fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (ready < 0 && errno != EINTR)
      throw Error(ErrorCode::kBackendError, "fd channel: poll(): " + errno_text());
    if (ready <= 0) continue;
    const int s = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (s < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) continue;
      throw Error(ErrorCode::kBackendError, "fd channel: accept(): " + errno_text());
    }
    // Only this user's processes may hand us memory.
    ucred cred{};
    socklen_t cl = sizeof cred;
    const bool same_user =
        ::getsockopt(s, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0 && cred.uid == ::getuid();
    Message m;
    // The connection is blocking: the sender wrote before closing, so the data is there or
    // arrives at once.
    pollfd q{s, POLLIN, 0};
    ssize_t n = -1;
    if (::poll(&q, 1, static_cast<int>(std::min<int64_t>(left, 5000))) > 0) {
      do n = ::recvmsg(s, &m.msg, MSG_CMSG_CLOEXEC);
      while (n < 0 && errno == EINTR);
    }
    ::close(s);
    int fd = -1;
    for (cmsghdr* c = CMSG_FIRSTHDR(&m.msg); n > 0 && c != nullptr; c = CMSG_NXTHDR(&m.msg, c))
      if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS)
        std::memcpy(&fd, CMSG_DATA(c), sizeof fd);
    const Header& h = m.header;
    if (n != static_cast<ssize_t>(sizeof h) || fd < 0 || !same_user) {
      if (fd >= 0) ::close(fd);
      continue;  // not one of ours: ignored
    }
    if (auto it = early_.find({h.tag, h.from}); it != early_.end()) ::close(it->second.fd);
    early_[{h.tag, h.from}] = {fd, h.bytes};
  }
}

}  // namespace fastcomms
