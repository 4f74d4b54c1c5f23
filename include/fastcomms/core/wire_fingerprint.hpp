// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// A collective's call (NOTE [call fingerprint]) in 16 bytes, for backends that compare calls
/// beside the op instead of before it (the nccl backend's default check, NOTE [nccl call check]
/// in backends/nccl/call_checker.hpp): every rank's 16 bytes are all-gathered with the op and
/// compared once they have landed. No CUDA, no communication: pure arithmetic, tested and fuzzed
/// on the host.

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "fastcomms/core/backend.hpp"

namespace fastcomms {

/// NOTE [wire fingerprint]: one rank's call in two words. `head` holds, as bit fields, the op
/// (bits 0-5), dtype + 1 (6-11; 0: none), reduction + 1 (12-15; 0: none), the body's kind (16-17),
/// root + 1 (18-39; 0: none) and the collective's sequence number on its communicator modulo
/// 2^24 (40-63). `body` is, by kind: the element count (kind 0: no PREMUL_SUM factor, no call
/// key, no per-peer sizes; -1 where the op has none); a digest of count, factor and call key
/// (kind 1); or, for the forms
/// whose sizes differ per peer (kind 2), this rank's term of a pairing sum: the sum over every
/// rank of the hashes of the (sender, receiver, bytes) triples it sends minus those it expects,
/// which is 0 over all ranks exactly when every rank expects from each peer what that peer sends
/// it (a disagreement slips through with probability about 2^-64), plus the digest of count,
/// factor and call key, which the sum must then hold `size` times. Every field but the kind-2 body
/// must be equal on every rank; the kind-2 bodies must add up.
struct WireFingerprint {
  uint64_t head = 0;  ///< op, dtype, reduction, body kind, root, sequence number
  uint64_t body = 0;  ///< count, digest or pairing term (by the head's kind)
  bool operator==(const WireFingerprint&) const = default;
};
static_assert(sizeof(WireFingerprint) == 16 && std::is_trivially_copyable_v<WireFingerprint>);

/// One rank's encoded call: what it sends, and what the kind-2 pairing sum must come to.
struct WireCall {
  WireFingerprint wire;     ///< the 16 bytes every rank receives
  uint64_t pair_total = 0;  ///< kind 2: what the bodies of every rank must add up to
};

/// Encodes `f` as collective number `seq` of rank `rank` of `size`; `peer_out` / `peer_in` are the
/// bytes this rank sends to / expects from each peer (both empty where the op has no per-peer
/// sizes, as OpContext has them).
WireCall encode_wire(const CallFingerprint& f, const std::vector<int64_t>& peer_out,
                     const std::vector<int64_t>& peer_in, uint64_t seq, int rank, int size);

/// "all_reduce(SUM, 1024 x float32) as collective #3": a fingerprint in words, whatever its bits
/// (fields out of range are printed as numbers).
std::string describe(const WireFingerprint& w);

/// Compares every rank's fingerprint (`all`: `size` of them, rank order, as they landed) with
/// this rank's call `mine`: empty where they agree; else the disagreement in words, naming the
/// call of every rank (ranks that made the same call grouped, "ranks 0, 2 called ..."). Ranks
/// compare the same bytes, so every rank finds a mismatch where one does.
std::string wire_mismatch(const WireFingerprint* all, int size, const WireCall& mine);

}  // namespace fastcomms
