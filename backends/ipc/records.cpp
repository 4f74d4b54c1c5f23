// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [ipc records] (records.hpp).
#include "backends/ipc/records.hpp"

#include <cstring>
#include <tuple>

#include "fastcomms/error.hpp"

namespace fastcomms::ipc_records {
namespace {

// Both records share one wire form: the handle, then two int64 fields.
constexpr size_t kRecordBytes = kHandleBytes + 2 * sizeof(int64_t);

std::vector<uint8_t> pack(const Handle& h, int64_t a, int64_t b) {
  std::vector<uint8_t> v(kRecordBytes);
  std::memcpy(v.data(), h.data(), kHandleBytes);
  std::memcpy(v.data() + kHandleBytes, &a, sizeof a);
  std::memcpy(v.data() + kHandleBytes + sizeof a, &b, sizeof b);
  return v;
}

// The handle and the two fields of peer `peer`'s record `what`; throws on another length.
std::tuple<Handle, int64_t, int64_t> unpack(const std::vector<uint8_t>& v, const std::string& what,
                                            int peer, const std::string& where) {
  FASTCOMMS_CHECK(v.size() == kRecordBytes, kInvalidArgument, where, "rank ", peer, "'s ", what,
                  " record is ", v.size(), " bytes, expected ", kRecordBytes);
  Handle h;
  int64_t a = 0, b = 0;
  std::memcpy(h.data(), v.data(), kHandleBytes);
  std::memcpy(&a, v.data() + kHandleBytes, sizeof a);
  std::memcpy(&b, v.data() + kHandleBytes + sizeof a, sizeof b);
  return {h, a, b};
}

}  // namespace

std::vector<uint8_t> encode(const WindowRecord& r) { return pack(r.handle, r.bytes, r.kind); }

WindowRecord decode_window(const std::vector<uint8_t>& v, int64_t bytes, int64_t kind, int peer,
                           const std::string& where, const std::string& tag) {
  WindowRecord r;
  std::tie(r.handle, r.bytes, r.kind) = unpack(v, tag + " window", peer, where);
  FASTCOMMS_CHECK(r.bytes == bytes, kInvalidArgument, where, "rank ", peer, " sized its ", tag,
                  " window ", r.bytes, " bytes, this rank ", bytes,
                  ": the ranks issued different calls");
  FASTCOMMS_CHECK(r.kind == 0 || r.kind == 1, kInvalidArgument, where, "rank ", peer, "'s ", tag,
                  " window record names sharing kind ", r.kind, ", expected 0 (ipc) or 1 (vmm)");
  FASTCOMMS_CHECK(r.kind == kind, kInternal, where, "rank ", peer, " shares its ", tag,
                  " window by ", r.kind ? "vmm" : "ipc", ", this rank by ", kind ? "vmm" : "ipc");
  return r;
}

std::vector<uint8_t> encode(const BufferRecord& r) { return pack(r.handle, r.offset, r.bytes); }

BufferRecord decode_buffer(const std::vector<uint8_t>& v, int64_t bytes, int peer,
                           const std::string& where) {
  BufferRecord r;
  std::tie(r.handle, r.offset, r.bytes) = unpack(v, "registration", peer, where);
  FASTCOMMS_CHECK(r.bytes == bytes, kInvalidArgument, where, "rank ", peer, " registered ", r.bytes,
                  " bytes, this rank ", bytes, ": every rank registers the same size");
  FASTCOMMS_CHECK(r.offset >= 0, kInvalidArgument, where, "rank ", peer,
                  "'s registration record has offset ", r.offset, ", expected >= 0");
  int64_t end = 0;
  FASTCOMMS_CHECK(!__builtin_add_overflow(r.offset, r.bytes, &end), kInvalidArgument, where,
                  "rank ", peer, "'s registration record overflows: offset ", r.offset, " + ",
                  r.bytes, " bytes");
  return r;
}

void check_inside(const BufferRecord& r, int64_t mapped, int peer, const std::string& where) {
  FASTCOMMS_CHECK(r.offset + r.bytes <= mapped, kInvalidArgument, where, "rank ", peer,
                  "'s registered buffer [", r.offset, ", ", r.offset + r.bytes,
                  ") lies outside its allocation of ", mapped, " bytes");
}

void check_import_size(int64_t announced, int64_t needed, int peer, const std::string& where) {
  FASTCOMMS_CHECK(announced >= needed && announced > 0, kInvalidArgument, where, "rank ", peer,
                  " announced a memory descriptor of ", announced, " bytes for a window of ",
                  needed, ": it would be written past its end");
}

void check_fd_address(const std::string& a, int peer, const std::string& where) {
  static const std::string kPrefix = "fastcomms-fd-";
  bool ok = a == "-";
  if (!ok && a.size() == kPrefix.size() + 32 && a.compare(0, kPrefix.size(), kPrefix) == 0) {
    ok = true;
    for (size_t i = kPrefix.size(); i < a.size(); ++i)
      ok = ok && ((a[i] >= '0' && a[i] <= '9') || (a[i] >= 'a' && a[i] <= 'f'));
  }
  FASTCOMMS_CHECK(ok, kInvalidArgument, where, "rank ", peer, "'s fd-channel address '",
                  a.substr(0, 64), "' is not one fastcomms makes (\"-\" or ", kPrefix,
                  " and 32 hex digits)");
}

}  // namespace fastcomms::ipc_records
