// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The device all-to-all-v's arithmetic (fastcomms/cuda/device_a2av_plan.hpp) replayed on the
// host for whole worlds: every rank publishes its slot as the counts kernel does, plans from the
// same slots, then the pushes and copy-outs run as memcpy with every range checked against its
// buffer. Valid calls must equal the all-to-all-v reference; bad counts (a receiver expecting
// other counts, an overflowing staging, rejected vectors) must copy only what the rules allow and
// never leave a buffer.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "fastcomms/cuda/device_a2av_plan.hpp"

namespace {

using namespace fastcomms::cuda;
using Matrix = std::vector<std::vector<int64_t>>;  // [p][q]

constexpr uint8_t kPoison = 0xA5;

struct World {
  int P = 1;
  int64_t rb = 1;     // row bytes
  int64_t cap = 0;    // staging bytes of every rank
  Matrix send, recv;  // send[p][q]: rows p sends q; recv[q][p]: rows q expects from p
  std::vector<int64_t> in_rows, out_rows;
};

uint8_t byte_of(int rank, int64_t row, int64_t k) {
  return static_cast<uint8_t>(rank * 131 + row * 7 + k * 13 + 1);
}

// A vector's prefix sums and whether the counting kernel accepts it (each >= 0, sum <= rows).
bool check(const std::vector<int64_t>& v, int64_t rows, std::vector<int64_t>& prefix) {
  int64_t sum = 0;
  bool ok = true;
  prefix.assign(v.size(), 0);
  for (size_t i = 0; i < v.size(); ++i) {
    prefix[i] = sum;
    if (v[i] < 0) {
      ok = false;
      continue;
    }
    sum += v[i];
  }
  return ok && sum <= rows;
}

struct Result {
  std::vector<std::vector<uint8_t>> out;  // each rank's output bytes (poisoned first)
  std::vector<bool> send_ok, recv_ok, overflow;
};

// One call of the whole world, as the four kernels would run it.
Result replay(const World& w) {
  const int P = w.P;
  const int64_t words = count_slot_words(P);
  std::vector<uint64_t> slots(static_cast<size_t>(P * words), 0);
  std::vector<std::vector<int64_t>> sprefix(P), oprefix(P);
  Result res;
  res.send_ok.resize(P);
  res.recv_ok.resize(P);
  for (int p = 0; p < P; ++p) {  // publish (the counts kernel's first half)
    res.send_ok[p] = check(w.send[p], w.in_rows[p], sprefix[p]);
    res.recv_ok[p] = check(w.recv[p], w.out_rows[p], oprefix[p]);
    uint64_t* s = slots.data() + p * words;
    s[0] = 1;
    s[1] = static_cast<uint64_t>(w.rb) | (res.send_ok[p] ? 0 : kA2avBadSends) |
           (res.recv_ok[p] ? 0 : kA2avBadRecvs);
    for (int j = 0; j < P; ++j) {
      s[2 + j] = res.send_ok[p] ? static_cast<uint64_t>(w.send[p][j]) : 0;
      s[2 + P + j] = res.recv_ok[p] ? static_cast<uint64_t>(w.recv[p][j]) : 0;
    }
  }
  const A2avCounts c{slots.data(), P};
  const int64_t cap_rows = w.cap / w.rb;
  res.overflow.resize(P);
  for (int q = 0; q < P; ++q) res.overflow[q] = a2av_incoming_rows(c, q) > cap_rows;
  std::vector<std::vector<DeviceA2avPeerPlan>> plan(P, std::vector<DeviceA2avPeerPlan>(P));
  for (int r = 0; r < P; ++r) {
    A2avSelf me;
    me.rank = r;
    me.row_bytes = w.rb;
    me.output_rows = w.out_rows[r];
    me.send_prefix = sprefix[r].data();
    me.out_prefix = oprefix[r].data();
    me.recv_counts = w.recv[r].data();
    me.recv_ok = res.recv_ok[r];
    me.copy = true;
    for (int q = 0; q < P; ++q)
      plan[r][q] = a2av_peer_plan(c, me, q, res.overflow[q], res.overflow[r]);
  }
  // Buffers: inputs, staging and outputs, each checked on every copy.
  std::vector<std::vector<uint8_t>> in(P), staging(P, std::vector<uint8_t>(w.cap, kPoison));
  res.out.assign(P, {});
  for (int p = 0; p < P; ++p) {
    in[p].resize(static_cast<size_t>(w.in_rows[p] * w.rb));
    for (int64_t i = 0; i < w.in_rows[p]; ++i)
      for (int64_t k = 0; k < w.rb; ++k) in[p][i * w.rb + k] = byte_of(p, i, k);
    res.out[p].assign(static_cast<size_t>(w.out_rows[p] * w.rb), kPoison);
  }
  auto copy = [](std::vector<uint8_t>& dst, int64_t d, const std::vector<uint8_t>& src, int64_t s,
                 int64_t n, const char* what) {
    EXPECT_GE(n, 0) << what;
    if (n <= 0) return;
    ASSERT_TRUE(d >= 0 && d + n <= static_cast<int64_t>(dst.size()))
        << what << ": [" << d << ", " << d + n << ") past a destination of " << dst.size();
    ASSERT_TRUE(s >= 0 && s + n <= static_cast<int64_t>(src.size()))
        << what << ": [" << s << ", " << s + n << ") past a source of " << src.size();
    std::memcpy(dst.data() + d, src.data() + s, static_cast<size_t>(n));
  };
  for (int r = 0; r < P; ++r) {  // push
    for (int q = 0; q < P; ++q) {
      const auto& pl = plan[r][q];
      copy(q == r ? res.out[r] : staging[q], pl.send_dst, in[r], pl.send_src, pl.send_bytes,
           "push");
    }
  }
  for (int r = 0; r < P; ++r) {  // copy-out
    for (int q = 0; q < P; ++q) {
      const auto& pl = plan[r][q];
      if (q == r) {
        EXPECT_EQ(pl.recv_bytes, 0);
        continue;
      }
      copy(res.out[r], pl.recv_dst, staging[r], pl.recv_src, pl.recv_bytes, "copy-out");
    }
  }
  return res;
}

// Rows rank r should hold from rank p: the first n rows of p's share for r, at r's offset.
void expect_rows(const World& w, const Result& res, int r, int p, int64_t n) {
  int64_t src = 0, dst = 0;
  for (int q = 0; q < r; ++q) src += w.send[p][q];
  for (int q = 0; q < p; ++q) dst += w.recv[r][q];
  for (int64_t i = 0; i < n; ++i)
    for (int64_t k = 0; k < w.rb; ++k)
      ASSERT_EQ(res.out[r][(dst + i) * w.rb + k], byte_of(p, src + i, k))
          << "rank " << r << " row " << i << " from rank " << p;
}

World random_world(std::mt19937_64& g, int P, int64_t rb, int kind) {
  World w;
  w.P = P;
  w.rb = rb;
  w.send.assign(P, std::vector<int64_t>(P, 0));
  for (int p = 0; p < P; ++p)
    for (int q = 0; q < P; ++q) {
      if (kind == 0) w.send[p][q] = g() % 3 == 0 ? 0 : static_cast<int64_t>(g() % 40);
      if (kind == 1 && q == P - 1) w.send[p][q] = 1 + static_cast<int64_t>(g() % 200);
    }
  w.recv.assign(P, std::vector<int64_t>(P, 0));
  int64_t most = 0;
  for (int q = 0; q < P; ++q) {
    int64_t sum = 0;
    for (int p = 0; p < P; ++p) sum += w.recv[q][p] = w.send[p][q];
    most = std::max(most, sum);
  }
  for (int p = 0; p < P; ++p) {
    int64_t s = 0, o = 0;
    for (int q = 0; q < P; ++q) s += w.send[p][q], o += w.recv[p][q];
    w.in_rows.push_back(s + static_cast<int64_t>(g() % 3));  // slack rows are allowed
    w.out_rows.push_back(o + static_cast<int64_t>(g() % 3));
  }
  w.cap = std::max<int64_t>(most * rb, 256);
  return w;
}

TEST(DeviceA2avPlan, ValidCallsEqualTheReference) {
  std::mt19937_64 g(7);
  for (int P : {1, 2, 3, 4, 5, 8}) {
    for (int64_t rb : {1, 3, 16, 256}) {
      for (int kind : {0, 1, 2}) {  // random with zeros, one receiver, all zero
        for (int rep = 0; rep < 5; ++rep) {
          const World w = random_world(g, P, rb, kind);
          const Result res = replay(w);
          for (int r = 0; r < P; ++r) {
            ASSERT_TRUE(res.send_ok[r] && res.recv_ok[r] && !res.overflow[r]);
            int64_t rows = 0;
            for (int p = 0; p < P; ++p) {
              expect_rows(w, res, r, p, w.recv[r][p]);
              rows += w.recv[r][p];
            }
            for (size_t i = static_cast<size_t>(rows * rb); i < res.out[r].size(); ++i)
              ASSERT_EQ(res.out[r][i], kPoison) << "rank " << r << " wrote past its rows";
          }
        }
      }
    }
  }
}

TEST(DeviceA2avPlan, ReceiverExpectingOtherCountsGetsTheSmallerShare) {
  std::mt19937_64 g(11);
  for (int P : {2, 3, 5}) {
    for (int rep = 0; rep < 20; ++rep) {
      World w = random_world(g, P, 16, 0);
      const int q = static_cast<int>(g() % P), p = static_cast<int>(g() % P);
      const int64_t delta = (g() % 2 ? 1 : -1) * static_cast<int64_t>(1 + g() % 4);
      w.recv[q][p] = std::max<int64_t>(0, w.recv[q][p] + delta);
      int64_t o = 0;
      for (int j = 0; j < P; ++j) o += w.recv[q][j];
      w.out_rows[q] = o;  // the output fits what q expects
      const Result res = replay(w);
      for (int r = 0; r < P; ++r)
        for (int s = 0; s < P; ++s) expect_rows(w, res, r, s, std::min(w.recv[r][s], w.send[s][r]));
    }
  }
}

TEST(DeviceA2avPlan, OverflowingStagingReceivesNothingOthersExact) {
  std::mt19937_64 g(13);
  for (int P : {2, 3, 4}) {
    for (int rep = 0; rep < 20; ++rep) {
      World w = random_world(g, P, 64, 1);  // rank P-1 receives everything
      w.cap = std::max<int64_t>(64, (g() % 50) * 64);
      const Result res = replay(w);
      for (int r = 0; r < P; ++r) {
        for (int p = 0; p < P; ++p) {
          if (res.overflow[r] && p != r) {  // nothing from peers (own rows still move)
            int64_t dst = 0;
            for (int j = 0; j < p; ++j) dst += w.recv[r][j];
            for (int64_t i = 0; i < w.recv[r][p] * w.rb; ++i)
              ASSERT_EQ(res.out[r][dst * w.rb + i], kPoison);
          } else {
            expect_rows(w, res, r, p, w.recv[r][p]);
          }
        }
      }
    }
  }
}

TEST(DeviceA2avPlan, RejectedVectorsMoveNothingAndNeverLeaveABuffer) {
  std::mt19937_64 g(17);
  for (int P : {2, 3, 4}) {
    for (int rep = 0; rep < 20; ++rep) {
      World w = random_world(g, P, 8, 0);
      const int bad = static_cast<int>(g() % P);
      const bool sends = g() % 2;
      if (sends) {
        w.in_rows[bad] = 0;  // its input holds none of the rows it announces (if any)
        w.send[bad][g() % P] = -1 - static_cast<int64_t>(g() % 3) * (g() % 2);
      } else {
        w.out_rows[bad] = std::max<int64_t>(0, w.out_rows[bad] - 50);
        w.recv[bad][g() % P] += 50;
      }
      const Result res = replay(w);  // every copy is range-checked inside
      EXPECT_FALSE(sends ? res.send_ok[bad] : res.recv_ok[bad]);
      for (int r = 0; r < P; ++r) {
        for (int p = 0; p < P; ++p) {
          if (sends && p == bad) continue;
          if (!sends && r == bad) {
            for (uint8_t b : res.out[r]) ASSERT_EQ(b, kPoison) << "a rejected receiver wrote";
            break;
          }
          expect_rows(w, res, r, p, std::min(w.recv[r][p], w.send[p][r]));
        }
      }
    }
  }
}

}  // namespace
