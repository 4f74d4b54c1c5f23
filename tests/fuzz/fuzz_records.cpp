// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// libFuzzer target over NOTE [ipc records]: any bytes a peer (or anyone who can write the
// store) hands the NVLink engine, as a window record, a registration record, a descriptor size
// or an fd-channel address, must end in a record this rank can use safely or a fastcomms::Error:
// never a crash, undefined behaviour (ASan and UBSan are on), or a record that passes while it
// disagrees with the call or points outside what it registered.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "backends/ipc/records.hpp"
#include "fastcomms/error.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fastcomms;
  using namespace fastcomms::ipc_records;
  const std::vector<uint8_t> v(data, data + size);
  int64_t want = 0, mapped = 0;
  if (size >= 16) {
    std::memcpy(&want, data, 8);
    std::memcpy(&mapped, data + 8, 8);
  }
  try {
    const WindowRecord r = decode_window(v, want, size % 2, 1, "", "fuzz");
    if (r.bytes != want || r.kind != static_cast<int64_t>(size % 2)) __builtin_trap();
  } catch (const Error&) {
  }
  try {
    const BufferRecord r = decode_buffer(v, want, 1, "");
    if (r.bytes != want || r.offset < 0) __builtin_trap();
    check_inside(r, mapped, 1, "");
    if (r.offset + r.bytes > mapped) __builtin_trap();
  } catch (const Error&) {
  }
  try {
    check_import_size(want, mapped, 1, "");
    if (want < mapped || want <= 0) __builtin_trap();
  } catch (const Error&) {
  }
  try {
    check_fd_address(std::string(v.begin(), v.end()), 1, "");
  } catch (const Error&) {
  }
  return 0;
}
