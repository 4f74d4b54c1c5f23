// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// NOTE [ipc records]: what the NVLink engine and its windows read from the store and from
/// peers, encoded and validated in one place, with no CUDA, so the fuzzer (tests/fuzz/
/// fuzz_records.cpp) reaches every decoder. A peer's bytes are never used before they pass:
/// the length, the sizes agreeing with this rank's call, offsets inside what was registered,
/// a descriptor's announced size covering what will be written, and fd-channel addresses of
/// the one form FdChannel makes. Anything else raises fastcomms::Error naming the peer.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace fastcomms::ipc_records {

/// Bytes of a cudaIpcMemHandle_t (checked against CUDA's type where CUDA is included).
inline constexpr size_t kHandleBytes = 64;
using Handle = std::array<uint8_t, kHandleBytes>;

/// A Ulysses window's record: the size asked for, how it is shared (0: legacy IPC handle,
/// 1: VMM descriptor over the fd channel) and, for IPC, the handle.
struct WindowRecord {
  Handle handle{};
  int64_t bytes = 0;
  int64_t kind = 0;
};
std::vector<uint8_t> encode(const WindowRecord& r);
/// Peer `peer`'s record for this rank's window of `bytes` shared by `kind`; `where` starts
/// messages and `tag` names the window.
WindowRecord decode_window(const std::vector<uint8_t>& v, int64_t bytes, int64_t kind, int peer,
                           const std::string& where, const std::string& tag);

/// A registered buffer's record (one-sided windows): the allocation's handle, the buffer's
/// offset in it and its size.
struct BufferRecord {
  Handle handle{};
  int64_t offset = 0;
  int64_t bytes = 0;
};
std::vector<uint8_t> encode(const BufferRecord& r);
/// Peer `peer`'s record for a registration of `bytes` on every rank.
BufferRecord decode_buffer(const std::vector<uint8_t>& v, int64_t bytes, int peer,
                           const std::string& where);
/// Whether a record's offset and size lie inside a mapping of `mapped` bytes (throws if not).
void check_inside(const BufferRecord& r, int64_t mapped, int peer, const std::string& where);

/// A VMM descriptor announced as `announced` bytes must cover the `needed` bytes of the window.
void check_import_size(int64_t announced, int64_t needed, int peer, const std::string& where);

/// An fd-channel address from the store: "-" (the peer cannot share VMM memory) or
/// "fastcomms-fd-" and 32 lowercase hex digits.
void check_fd_address(const std::string& a, int peer, const std::string& where);

}  // namespace fastcomms::ipc_records
