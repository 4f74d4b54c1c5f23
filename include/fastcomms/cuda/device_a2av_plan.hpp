// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The arithmetic of the device all-to-all-v (NOTE [device all-to-all-v] in
/// fastcomms/cuda/device_a2av.hpp): the buffer layout, and what one rank plans from every rank's
/// published counts. Pure arithmetic, no CUDA: the counts kernel runs it on the GPU, and
/// tests/host/test_device_a2av_plan.cpp replays it for whole worlds on the host with bounds-
/// checked copies.

#include <cstdint>

#ifdef __CUDACC__
#define FASTCOMMS_A2AV_HD __host__ __device__
#else
#define FASTCOMMS_A2AV_HD
#endif

namespace fastcomms::cuda {

/// u64 words of one count slot: flag, key, size send counts, size receive counts.
FASTCOMMS_A2AV_HD inline constexpr int64_t count_slot_words(int size) {
  return 2 + int64_t{2} * size;
}
/// u64 words of the count pad: [2 halves][size senders][count_slot_words].
FASTCOMMS_A2AV_HD inline constexpr int64_t count_pad_words(int size) {
  return int64_t{2} * size * count_slot_words(size);
}
/// Byte offset of the staging in a rank's buffer (after both pads, 256-byte aligned).
FASTCOMMS_A2AV_HD inline constexpr int64_t staging_offset(int size) {
  const int64_t pads = (count_pad_words(size) + size) * 8;
  return (pads + 255) / 256 * 256;
}

/// Key bits of a count slot: the sender rejected its input_split_sizes (it sends nothing) / its
/// output_split_sizes (it receives nothing). The rest of the key is the row size in bytes.
inline constexpr uint64_t kA2avBadSends = 1ull << 63;
inline constexpr uint64_t kA2avBadRecvs = 1ull << 62;
inline constexpr uint64_t kA2avKeyBits = kA2avBadSends | kA2avBadRecvs;
inline constexpr int64_t kA2avMax = 0x7fffffffffffffffll;

/// Per peer, what one rank moves in one call (byte offsets and sizes).
struct DeviceA2avPeerPlan {
  int64_t send_src = 0;    ///< Offset in the input of the rows for this peer.
  int64_t send_dst = 0;    ///< Offset in the peer's staging (own rank: in the output).
  int64_t send_bytes = 0;  ///< 0 where nothing goes (or the peer's staging overflowed).
  int64_t recv_src = 0;    ///< Offset in this rank's staging of the peer's rows.
  int64_t recv_dst = 0;    ///< Offset in the output.
  int64_t recv_bytes = 0;  ///< Bytes to copy out (0 for this rank: the push moved them).
};

/// One call's count slots as a rank reads them (its pad's half for the call): slot p is rank
/// p's, the same on every rank once every flag was seen.
struct A2avCounts {
  const volatile uint64_t* slots = nullptr;  ///< [size][count_slot_words(size)]
  int size = 1;
  FASTCOMMS_A2AV_HD uint64_t key(int p) const { return slots[p * count_slot_words(size) + 1]; }
  /// Rows rank p sends rank q (0 where p rejected its sends).
  FASTCOMMS_A2AV_HD int64_t sent(int p, int q) const {
    return static_cast<int64_t>(slots[p * count_slot_words(size) + 2 + q]);
  }
  /// Rows rank q expects from rank p (0 where q rejected its receives).
  FASTCOMMS_A2AV_HD int64_t expected(int q, int p) const {
    return static_cast<int64_t>(slots[q * count_slot_words(size) + 2 + size + p]);
  }
};

/// Rows every other rank sends rank q (saturating: a huge count cannot wrap into a small one).
FASTCOMMS_A2AV_HD inline int64_t a2av_incoming_rows(const A2avCounts& c, int q) {
  int64_t total = 0;
  for (int p = 0; p < c.size; ++p) {
    if (p == q) continue;
    const int64_t s = c.sent(p, q);
    total = s > kA2avMax - total ? kA2avMax : total + s;
  }
  return total;
}

/// Where rank `sender`'s rows start in rank `receiver`'s staging (rows): after those of every
/// lower sender; a rank's own rows never go there.
FASTCOMMS_A2AV_HD inline int64_t a2av_staging_row(const A2avCounts& c, int sender, int receiver) {
  int64_t at = 0;
  for (int p = 0; p < sender; ++p)
    if (p != receiver) at += c.sent(p, receiver);
  return at;
}

/// What one rank knows of itself in a call.
struct A2avSelf {
  int rank = 0;
  int64_t row_bytes = 0;
  int64_t output_rows = 0;
  const int64_t* send_prefix = nullptr;  ///< [size] rows of the input before each peer's
  const int64_t* out_prefix = nullptr;   ///< [size] rows of the output before each peer's
  const int64_t* recv_counts = nullptr;  ///< [size] its output_split_sizes
  bool recv_ok = true;                   ///< Its output_split_sizes were accepted.
  bool copy = true;                      ///< The call copies (row sizes agree, no timeout).
};

/// The plan of rank `me` for peer q. `overflow_q` / `overflow_me`: whether q's / this rank's
/// staging would overflow (a2av_incoming_rows past the capacity): then nothing goes there.
FASTCOMMS_A2AV_HD inline DeviceA2avPeerPlan a2av_peer_plan(const A2avCounts& c, const A2avSelf& me,
                                                           int q, bool overflow_q,
                                                           bool overflow_me) {
  DeviceA2avPeerPlan pl{};
  const int r = me.rank;
  const int64_t rb = me.row_bytes;
  if (q != r) {
    pl.send_src = me.send_prefix[q] * rb;
    pl.send_dst = a2av_staging_row(c, r, q) * rb;
    pl.send_bytes = me.copy && !overflow_q ? c.sent(r, q) * rb : 0;
  }
  // From q: at most what q sends and what this rank expects, inside the output.
  int64_t n = 0;
  if (me.recv_ok && me.copy) {
    const int64_t got = c.sent(q, r), want = me.recv_counts[q];
    n = got < want ? got : want;
    const int64_t room = me.output_rows - me.out_prefix[q];
    n = n < room ? n : room;
    n = n < 0 ? 0 : n;
  }
  if (q == r) {  // own rows: input to output in the push kernel
    pl.send_src = me.send_prefix[r] * rb;
    pl.send_dst = me.out_prefix[r] * rb;
    pl.send_bytes = n * rb;
  } else {
    pl.recv_src = a2av_staging_row(c, q, r) * rb;
    pl.recv_dst = me.out_prefix[q] * rb;
    pl.recv_bytes = overflow_me ? 0 : n * rb;
  }
  return pl;
}

}  // namespace fastcomms::cuda
