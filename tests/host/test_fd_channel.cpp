// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// FdChannel (backends/nvlink, NOTE [vmm windows]): descriptors arrive intact, in any order, and
// a missing one times out instead of hanging. Pipes stand in for GPU memory handles.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <thread>

#include "backends/nvlink/fd_channel.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

using std::chrono::milliseconds;

// Writes `text` into a fresh pipe and returns its read end (the write end is closed).
int pipe_with(const std::string& text) {
  int p[2];
  EXPECT_EQ(::pipe(p), 0);
  EXPECT_EQ(::write(p[1], text.data(), text.size()), static_cast<ssize_t>(text.size()));
  ::close(p[1]);
  return p[0];
}

std::string read_all(int fd) {
  std::string s(64, '\0');
  const ssize_t n = ::read(fd, s.data(), s.size());
  ::close(fd);
  return s.substr(0, n > 0 ? static_cast<size_t>(n) : 0);
}

TEST(FdChannel, DescriptorsArriveInAnyOrder) {
  FdChannel rx;
  // Sent out of order and ahead of the receive: the channel keeps what it was not asked for yet.
  for (const auto& [tag, from, text] :
       {std::tuple{2u, 1, "second from 1"}, {1u, 2, "first from 2"}, {1u, 1, "first from 1"}}) {
    const int fd = pipe_with(text);
    FdChannel::send(rx.address(), {tag, from, 1000 + from}, fd, milliseconds(2000));
    ::close(fd);  // the receiver holds its own copy
  }
  const auto a = rx.receive(1, 1, milliseconds(2000));
  EXPECT_EQ(a.bytes, 1001);
  EXPECT_EQ(read_all(a.fd), "first from 1");
  EXPECT_EQ(read_all(rx.receive(1, 2, milliseconds(2000)).fd), "first from 2");
  EXPECT_EQ(read_all(rx.receive(2, 1, milliseconds(2000)).fd), "second from 1");
}

TEST(FdChannel, SenderOnAnotherThread) {
  FdChannel rx;
  std::thread t([&] {
    std::this_thread::sleep_for(milliseconds(50));
    const int fd = pipe_with("late");
    FdChannel::send(rx.address(), {7, 3, 4}, fd, milliseconds(2000));
    ::close(fd);
  });
  EXPECT_EQ(read_all(rx.receive(7, 3, milliseconds(5000)).fd), "late");
  t.join();
}

TEST(FdChannel, MissingDescriptorTimesOut) {
  FdChannel rx;
  try {
    rx.receive(1, 0, milliseconds(100));
    FAIL() << "no descriptor was sent";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout);
    EXPECT_NE(std::string(e.what()).find("rank 0"), std::string::npos) << e.what();
  }
}

TEST(FdChannel, NobodyListeningTimesOut) {
  std::string address;
  {
    FdChannel gone;
    address = gone.address();
  }
  const int fd = pipe_with("x");
  try {
    FdChannel::send(address, {1, 0, 1}, fd, milliseconds(100));
    FAIL() << "the listener is gone";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
  }
  ::close(fd);
}

TEST(FdChannel, AddressesAreFreshAndUnguessable) {
  FdChannel a, b;
  EXPECT_NE(a.address(), b.address());
  EXPECT_GE(a.address().size(), 32u);
}

}  // namespace
}  // namespace fastcomms
