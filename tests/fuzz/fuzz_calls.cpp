// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// libFuzzer target over what ranks receive from each other before they trust it: a call
// fingerprint (40 bytes from every peer, NOTE [call fingerprint]), turned into words for a
// mismatch message, every rank's call records compared (NOTE [call check]: words of any value,
// for worlds of 1 to 4 ranks), every rank's 16-byte fingerprints as the nccl backend's check
// compares them (NOTE [wire fingerprint]), and the "host|device" entries the transport choice
// parses (nvlink_decision), with an NVML answer drawn from the same bytes; and any bytes as a
// record of the authenticated store (NOTE [authenticated rendezvous]), which must be refused unless
// it carries the right MAC, while a sealed payload always opens to itself. Any input must end in a
// result or a fastcomms::Error, never a crash or undefined behaviour (ASan and UBSan are on).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "fastcomms/core/auth_store.hpp"
#include "fastcomms/core/backend.hpp"
#include "fastcomms/core/wire_fingerprint.hpp"
#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/transport.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fastcomms;
  if (size >= sizeof(CallFingerprint)) {
    CallFingerprint a, b;
    std::memcpy(&a, data, sizeof a);
    std::memcpy(&b, data + size - sizeof b, sizeof b);
    const std::string s = describe(a);
    if (s.empty()) __builtin_trap();
    (void)(a == b);
    // The records as the call check gets them, from a world the first byte picks.
    const int world = 1 + data[0] % 4;
    std::vector<int64_t> all(call_record_words(world) * world, -1);
    std::memcpy(all.data(), data, std::min(size, all.size() * sizeof(int64_t)));
    try {
      check_call_records("[fuzz] ", a, all, world);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) __builtin_trap();
    }
    const auto rec = call_record(a, {1, 2}, {1, 2}, 2);
    if (rec.size() != call_record_words(2)) __builtin_trap();
  }
  // NOTE [wire fingerprint]: any bytes as every rank's 16 bytes, as the nccl backend's call
  // check gets them (worlds of 1 to 4 ranks), and any call of this rank's.
  if (size >= sizeof(WireFingerprint)) {
    const int world = 1 + data[size - 1] % 4;
    std::vector<WireFingerprint> all(static_cast<size_t>(world));
    std::memcpy(static_cast<void*>(all.data()), data,
                std::min(size, all.size() * sizeof(WireFingerprint)));
    WireCall mine;
    mine.wire = all[0];
    std::memcpy(&mine.pair_total, data + size - sizeof(WireFingerprint), sizeof mine.pair_total);
    for (const WireFingerprint& w : all)
      if (describe(w).empty()) __builtin_trap();
    const std::string m = wire_mismatch(all.data(), world, mine);
    // Equal fingerprints whose kind has no pairing sum always agree.
    if (world == 1 && !m.empty() && ((all[0].head >> 16) & 3) != 2) __builtin_trap();
    if (size >= sizeof(CallFingerprint)) {
      CallFingerprint f;
      std::memcpy(&f, data, sizeof f);
      const std::vector<int64_t> out(static_cast<size_t>(world), f.count),
          in(static_cast<size_t>(world), f.count);
      const WireCall c = encode_wire(f, out, in, f.key, 0, world);
      // One rank's own sizes pair up with themselves: sent to itself what it expects.
      if (world == 1 && !wire_mismatch(&c.wire, 1, c).empty()) __builtin_trap();
    }
  }
  if (auth_store_available()) {
    static const AuthStore auth(std::make_shared<MemoryStore>(), "fuzz-secret");
    const std::vector<uint8_t> record(data, data + size);
    try {
      (void)auth.open("k", record);
      __builtin_trap();  // random bytes never carry the right MAC
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) __builtin_trap();
    }
    if (auth.open("k", auth.seal("k", record)) != record) __builtin_trap();
  }
  // The rest as newline-separated entries; the first byte steers the probe's answer.
  const uint8_t mode = size > 0 ? data[0] : 0;
  std::vector<std::string> who;
  std::string cur;
  for (size_t i = 1; i < size && who.size() < 64; ++i) {
    if (data[i] == '\n') {
      who.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(static_cast<char>(data[i]));
    }
  }
  if (!cur.empty()) who.push_back(cur);
  const NvlinkProbe probe = [&](const std::vector<int>& devices) {
    std::pair<std::optional<NvlinkMatrix>, std::string> r{std::nullopt, "fuzzed: unknown"};
    if (mode & 1) {
      NvlinkMatrix m;
      for (size_t i = 0; i < devices.size(); ++i)
        for (size_t j = 0; j < devices.size(); ++j)
          if (i != j) m[{devices[i], devices[j]}] = ((mode >> ((i + j) % 7)) & 1) != 0;
      r.first = std::move(m);
    }
    return r;
  };
  try {
    const auto [ok, why] = nvlink_decision(who, probe);
    if (why.empty()) __builtin_trap();  // every answer says why
    (void)ok;
  } catch (const Error&) {
    // a malformed entry is refused with a message: fine
  }
  return 0;
}
