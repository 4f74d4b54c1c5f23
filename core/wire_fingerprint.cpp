// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [wire fingerprint] (fastcomms/core/wire_fingerprint.hpp): the 16-byte call fingerprint.
#include "fastcomms/core/wire_fingerprint.hpp"

#include <algorithm>
#include <cstdio>

#include "fastcomms/core/reduce_op.hpp"
#include "fastcomms/core/tensor.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

// The head's bit fields: [shift, width).
constexpr int kOpShift = 0, kOpBits = 6;
constexpr int kDtypeShift = 6, kDtypeBits = 6;
constexpr int kReduceShift = 12, kReduceBits = 4;
constexpr int kKindShift = 16, kKindBits = 2;
constexpr int kRootShift = 18, kRootBits = 22;
constexpr int kSeqShift = 40, kSeqBits = 24;
static_assert(kSeqShift + kSeqBits == 64);

constexpr uint64_t kKindCount = 0, kKindDigest = 1, kKindPairing = 2;

constexpr uint64_t field(uint64_t head, int shift, int bits) {
  return (head >> shift) & ((uint64_t{1} << bits) - 1);
}
constexpr uint64_t put(uint64_t value, int shift, int bits) {
  return (value & ((uint64_t{1} << bits) - 1)) << shift;
}

// splitmix64's finalizer: every input bit reaches every output bit.
constexpr uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// What every rank must agree on beyond the head: the count, PREMUL_SUM's factor, the call key.
uint64_t digest(const CallFingerprint& f) {
  return mix(mix(mix(static_cast<uint64_t>(f.count) + 0x9e3779b97f4a7c15ull) ^ f.factor_bits) ^
             f.key);
}

// One (sender, receiver, bytes) triple of a pairing sum.
uint64_t triple(int from, int to, int64_t bytes) {
  return mix(
      mix((static_cast<uint64_t>(static_cast<uint32_t>(from)) << 32) | static_cast<uint32_t>(to)) ^
      static_cast<uint64_t>(bytes));
}

std::string hex(uint64_t v) {
  char s[20];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

// The calls of `ranks` ("rank 3", "ranks 0, 1, 2", "ranks 0, 1, ... and 120 more").
std::string rank_list(const std::vector<int>& ranks) {
  constexpr size_t kShown = 8;
  std::string s = ranks.size() == 1 ? "rank " : "ranks ";
  for (size_t i = 0; i < ranks.size() && i < kShown; ++i)
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > kShown) s += detail::cat(" and ", ranks.size() - kShown, " more");
  return s;
}

}  // namespace

WireCall encode_wire(const CallFingerprint& f, const std::vector<int64_t>& peer_out,
                     const std::vector<int64_t>& peer_in, uint64_t seq, int rank, int size) {
  WireCall c;
  uint64_t kind = kKindCount;
  if (!peer_out.empty() || !peer_in.empty())
    kind = kKindPairing;
  else if (f.factor_bits != 0 || f.key != 0)
    kind = kKindDigest;
  // Out-of-range values (-1: none) become 0 through the + 1; a value past a field's width keeps
  // its low bits (roots past 2^22 - 2 ranks, sequence numbers modulo 2^24): equal calls still
  // encode equally.
  c.wire.head = put(static_cast<uint64_t>(f.op), kOpShift, kOpBits) |
                put(static_cast<uint64_t>(int64_t{f.dtype} + 1), kDtypeShift, kDtypeBits) |
                put(static_cast<uint64_t>(int64_t{f.reduce} + 1), kReduceShift, kReduceBits) |
                put(kind, kKindShift, kKindBits) |
                put(static_cast<uint64_t>(int64_t{f.root} + 1), kRootShift, kRootBits) |
                put(seq, kSeqShift, kSeqBits);
  if (kind == kKindCount) {
    c.wire.body = static_cast<uint64_t>(f.count);
  } else if (kind == kKindDigest) {
    c.wire.body = digest(f);
  } else {
    // NOTE [wire fingerprint]: sums modulo 2^64; triples this rank sends count plus, those it
    // expects minus, so over every rank they cancel exactly when sends and receives pair up.
    uint64_t term = 0;
    for (size_t q = 0; q < peer_out.size() && q < static_cast<size_t>(size); ++q)
      term += triple(rank, static_cast<int>(q), peer_out[q]);
    for (size_t q = 0; q < peer_in.size() && q < static_cast<size_t>(size); ++q)
      term -= triple(static_cast<int>(q), rank, peer_in[q]);
    const uint64_t d = digest(f);
    c.wire.body = term + d;
    c.pair_total = d * static_cast<uint64_t>(size);
  }
  return c;
}

std::string describe(const WireFingerprint& w) {
  const uint64_t op = field(w.head, kOpShift, kOpBits);
  const uint64_t dt = field(w.head, kDtypeShift, kDtypeBits);
  const uint64_t red = field(w.head, kReduceShift, kReduceBits);
  const uint64_t kind = field(w.head, kKindShift, kKindBits);
  const uint64_t root = field(w.head, kRootShift, kRootBits);
  const uint64_t seq = field(w.head, kSeqShift, kSeqBits);
  std::string s = op < static_cast<uint64_t>(OpKind::kCount) ? op_name(static_cast<OpKind>(op))
                                                             : detail::cat("op ", op);
  std::string args;
  const auto add = [&](const std::string& a) { args += (args.empty() ? "" : ", ") + a; };
  if (red != 0)
    add(red - 1 <= static_cast<uint64_t>(RedOpType::kPremulSum)
            ? std::string(red_op_name(static_cast<RedOpType>(red - 1)))
            : detail::cat("reduction ", red - 1));
  if (root != 0) add(detail::cat("root ", root - 1));
  std::string type;
  if (dt != 0)
    type = dt - 1 <= static_cast<uint64_t>(DType::kBool)
               ? std::string(dtype_name(static_cast<DType>(dt - 1)))
               : detail::cat("dtype ", dt - 1);
  if (kind == kKindCount) {
    const auto count = static_cast<int64_t>(w.body);
    if (!type.empty()) add(count >= 0 ? detail::cat(count, " x ", type) : type);
  } else {
    if (!type.empty()) add(type);
    if (kind == kKindDigest)
      add("count, factor and call key digest " + hex(w.body));
    else if (kind == kKindPairing)
      add("sizes per peer, pairing term " + hex(w.body));
    else
      add(detail::cat("body kind ", kind, " ", hex(w.body)));
  }
  return detail::cat(s, "(", args, ") as collective #", seq);
}

std::string wire_mismatch(const WireFingerprint* all, int size, const WireCall& mine) {
  FASTCOMMS_CHECK(all != nullptr && size >= 1, kInvalidArgument, "call check: ", size,
                  " fingerprints");
  // Ranks agree on the head and, but for kind 2, on the body; group them by what they called.
  const auto key = [](const WireFingerprint& w) {
    return field(w.head, kKindShift, kKindBits) == kKindPairing ? WireFingerprint{w.head, 0} : w;
  };
  std::vector<std::pair<WireFingerprint, std::vector<int>>> groups;
  for (int r = 0; r < size; ++r) {
    const WireFingerprint k = key(all[r]);
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == k; });
    if (it == groups.end())
      groups.push_back({k, {r}});
    else
      it->second.push_back(r);
  }
  if (groups.size() > 1) {
    constexpr size_t kShown = 8;
    std::string s = "ranks issued different collectives: ";
    for (size_t g = 0; g < groups.size() && g < kShown; ++g) {
      const WireFingerprint& w = all[groups[g].second.front()];
      s += detail::cat(g ? "; " : "", rank_list(groups[g].second), " called ", describe(w));
    }
    if (groups.size() > kShown) s += detail::cat("; and ", groups.size() - kShown, " other calls");
    return s;
  }
  if (field(all[0].head, kKindShift, kKindBits) != kKindPairing) return {};
  uint64_t total = 0;
  for (int r = 0; r < size; ++r) total += all[r].body;
  if (total == mine.pair_total) return {};
  return detail::cat(
      "ranks disagree on the sizes per peer of ", describe(all[0]),
      ": what some rank sends a peer is not what that peer expects from it (or the ranks' "
      "PREMUL_SUM factors or call keys differ); FASTCOMMS_CHECK_CALLS=strict names the pair");
}

}  // namespace fastcomms
