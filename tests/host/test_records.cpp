// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [ipc records]: the records the NVLink engine and windows exchange round-trip, and a
// peer's record that disagrees or points outside what it registered is refused naming the peer.
#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "backends/ipc/records.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::ipc_records {
namespace {

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(NvlinkRecords, WindowRoundTripAndRefusals) {
  WindowRecord r;
  for (size_t i = 0; i < kHandleBytes; ++i) r.handle[i] = static_cast<uint8_t>(i * 7);
  r.bytes = 123456;
  r.kind = 1;
  const auto v = encode(r);
  const auto back = decode_window(v, 123456, 1, 3, "[w] ", "sync");
  EXPECT_EQ(back.handle, r.handle);
  EXPECT_EQ(back.bytes, r.bytes);
  EXPECT_EQ(back.kind, r.kind);
  EXPECT_NE(message_of([&] {
              decode_window(v, 999, 1, 3, "[w] ", "sync");
            }).find("rank 3 sized its sync window 123456 bytes, this rank 999"),
            std::string::npos);
  EXPECT_NE(message_of([&] { decode_window(v, 123456, 0, 3, "[w] ", "sync"); }).find("by vmm"),
            std::string::npos);
  auto short_v = v;
  short_v.pop_back();
  EXPECT_NE(message_of([&] {
              decode_window(short_v, 123456, 1, 3, "[w] ", "sync");
            }).find("record is 79 bytes, expected 80"),
            std::string::npos);
  r.kind = 7;
  EXPECT_NE(message_of([&] {
              decode_window(encode(r), 123456, 1, 2, "[w] ", "sync");
            }).find("sharing kind 7"),
            std::string::npos);
}

TEST(NvlinkRecords, BufferOffsetsStayInside) {
  BufferRecord r;
  r.offset = 4096;
  r.bytes = 1024;
  const auto back = decode_buffer(encode(r), 1024, 1, "[w] ");
  EXPECT_EQ(back.offset, 4096);
  check_inside(back, 8192, 1, "[w] ");
  EXPECT_NE(message_of([&] {
              check_inside(back, 5000, 1, "[w] ");
            }).find("[4096, 5120) lies outside its allocation of 5000 bytes"),
            std::string::npos);
  r.offset = -16;
  EXPECT_NE(message_of([&] { decode_buffer(encode(r), 1024, 1, "[w] "); }).find("offset -16"),
            std::string::npos);
  r.offset = INT64_MAX - 10;
  EXPECT_NE(message_of([&] { decode_buffer(encode(r), 1024, 1, "[w] "); }).find("overflows"),
            std::string::npos);
  r.offset = 0;
  EXPECT_NE(message_of([&] {
              decode_buffer(encode(r), 2048, 1, "[w] ");
            }).find("registered 1024 bytes, this rank 2048"),
            std::string::npos);
}

TEST(NvlinkRecords, ImportSizesAndAddresses) {
  check_import_size(2 << 20, 1 << 20, 1, "[w] ");
  EXPECT_NE(
      message_of([&] { check_import_size(4096, 8192, 1, "[w] "); }).find("written past its end"),
      std::string::npos);
  check_fd_address("-", 0, "[w] ");
  check_fd_address("fastcomms-fd-0123456789abcdef0123456789abcdef", 0, "[w] ");
  for (const char* bad : {"", "fastcomms-fd-", "fastcomms-fd-0123456789ABCDEF0123456789abcdef",
                          "evil-0123456789abcdef0123456789abcdef0123", "/tmp/socket"}) {
    EXPECT_NE(message_of([&] { check_fd_address(bad, 2, "[w] "); }).find("rank 2"),
              std::string::npos)
        << bad;
  }
}

}  // namespace
}  // namespace fastcomms::ipc_records
