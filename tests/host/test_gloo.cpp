// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The gloo backend, every op, ranks as threads (world 1, 2, 3, 4, 7) and as processes (2, 4).
// Data are small integers, exactly representable in every dtype, so results are exact; outputs
// are poisoned before each op.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "fastcomms/core/clog.hpp"
#include "fastcomms/core/flight_recorder.hpp"
#include "fastcomms/core/reduce_op.hpp"
#include "harness.hpp"

namespace fastcomms::test {
namespace {

using namespace std::chrono_literals;
const int kWorlds[] = {1, 2, 3, 4, 7};
const DType kReduceTypes[] = {DType::kFloat32, DType::kFloat64, DType::kBFloat16, DType::kFloat16,
                              DType::kInt32,   DType::kInt64,   DType::kUInt8};
const DType kMoveTypes[] = {DType::kFloat32, DType::kBFloat16, DType::kInt64, DType::kUInt8,
                            DType::kFloat8E4M3FN};

CallOptions mode(bool async_op) {
  CallOptions o;
  o.async_op = async_op;
  return o;
}

// Value of element i on rank r for reduction `op`, in the dtype's exact range.
double value(RedOpType op, DType dt, int P, int r, int64_t i) {
  const bool unsigned_t = dt == DType::kUInt8 || dt == DType::kBool;
  const int64_t h = (r * 7 + i * 3 + 1) % 5;
  switch (op) {
    case RedOpType::kProduct:
      return (h % 2) + 1;  // 1 or 2: at most 2^7
    case RedOpType::kAvg:
      return P * (unsigned_t ? h : h - 2);
    case RedOpType::kBand:
    case RedOpType::kBor:
    case RedOpType::kBxor:
      return dt == DType::kBool ? (h & 1) : ((r * 37 + i * 11) % 64);
    default:
      return unsigned_t ? h : h - 2;
  }
}

double combine(RedOpType op, double a, double b) {
  switch (op) {
    case RedOpType::kProduct:
      return a * b;
    case RedOpType::kMin:
      return std::min(a, b);
    case RedOpType::kMax:
      return std::max(a, b);
    case RedOpType::kBand:
      return static_cast<double>(static_cast<int64_t>(a) & static_cast<int64_t>(b));
    case RedOpType::kBor:
      return static_cast<double>(static_cast<int64_t>(a) | static_cast<int64_t>(b));
    case RedOpType::kBxor:
      return static_cast<double>(static_cast<int64_t>(a) ^ static_cast<int64_t>(b));
    default:
      return a + b;
  }
}

double expected_reduce(const ReduceOp& op, DType dt, int P, int64_t i) {
  double acc = value(op.type, dt, P, 0, i) * (op.type == RedOpType::kPremulSum ? op.factor : 1);
  for (int r = 1; r < P; ++r)
    acc = combine(op.type, acc,
                  value(op.type, dt, P, r, i) * (op.type == RedOpType::kPremulSum ? op.factor : 1));
  if (op.type == RedOpType::kAvg) acc /= P;
  return acc;
}

std::vector<ReduceOp> ops_for(DType dt) {
  std::vector<ReduceOp> ops = {ReduceOp::sum(), ReduceOp::product(), ReduceOp::min(),
                               ReduceOp::max()};
  if (dt != DType::kBool) ops.push_back(ReduceOp::avg());  // integers: sums divisible by P
  if (!dtype_is_integral(dt)) ops.push_back(ReduceOp::premul_sum(2.0));
  if (dtype_is_integral(dt)) {
    ops.push_back(ReduceOp::band());
    ops.push_back(ReduceOp::bor());
    ops.push_back(ReduceOp::bxor());
  }
  return ops;
}

TEST(Gloo, AllReduceAndReduceEveryOpAndDtype) {
  for (int P : kWorlds) {
    run_threads(P, [&](Communicator& comm) {
      const int r = comm.rank();
      std::vector<DType> types(std::begin(kReduceTypes), std::end(kReduceTypes));
      types.push_back(DType::kBool);
      for (DType dt : types) {
        std::vector<ReduceOp> ops = ops_for(dt);
        if (dt == DType::kBool)
          ops = {ReduceOp::band(), ReduceOp::bor(), ReduceOp::bxor(), ReduceOp::min(),
                 ReduceOp::max()};
        for (const ReduceOp& op : ops) {
          for (bool async_op : {false, true}) {
            const int64_t n = 37;
            HostTensor t(dt, n);
            for (int64_t i = 0; i < n; ++i) t.set(i, value(op.type, dt, P, r, i));
            auto w = comm.all_reduce(t.view(), op, mode(async_op));
            w->wait();
            EXPECT_EQ(w->status(), WorkStatus::kCompleted);
            for (int64_t i = 0; i < n; ++i)
              ASSERT_EQ(t.get(i), expected_reduce(op, dt, P, i))
                  << "all_reduce " << red_op_name(op.type) << " " << dtype_name(dt) << " i=" << i;
            // reduce to a rotating root
            const int root = (static_cast<int>(op.type) + 1) % P;
            for (int64_t i = 0; i < n; ++i) t.set(i, value(op.type, dt, P, r, i));
            comm.reduce(t.view(), root, op, mode(async_op))->wait();
            if (r == root) {
              for (int64_t i = 0; i < n; ++i)
                ASSERT_EQ(t.get(i), expected_reduce(op, dt, P, i))
                    << "reduce " << red_op_name(op.type) << " " << dtype_name(dt);
            }
          }
        }
      }
    });
  }
}

TEST(Gloo, BroadcastScatterGather) {
  for (int P : kWorlds) {
    run_threads(P, [&](Communicator& comm) {
      const int r = comm.rank();
      for (DType dt : kMoveTypes) {
        for (bool async_op : {false, true}) {
          for (int root = 0; root < P; ++root) {
            const int64_t n = 19 + root;
            HostTensor t(dt, n);
            if (r == root)
              for (int64_t i = 0; i < n; ++i) t.set(i, (i * 5 + root) % 100);
            comm.broadcast(t.view(), root, mode(async_op))->wait();
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(t.get(i), (i * 5 + root) % 100);

            // scatter: root sends chunk q to rank q
            std::vector<HostTensor> ins;
            std::vector<TensorView> in_views;
            if (r == root) {
              for (int q = 0; q < P; ++q) {
                ins.emplace_back(dt, n);
                for (int64_t i = 0; i < n; ++i) ins.back().set(i, (q * 11 + i) % 100);
              }
              for (auto& h : ins) in_views.push_back(h.view());
            }
            HostTensor out(dt, n);
            comm.scatter(out.view(), in_views, root, mode(async_op))->wait();
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(out.get(i), (r * 11 + i) % 100);

            // gather and gather_single
            HostTensor mine(dt, n);
            for (int64_t i = 0; i < n; ++i) mine.set(i, (r * 13 + i) % 100);
            std::vector<HostTensor> outs;
            std::vector<TensorView> out_views;
            if (r == root) {
              for (int q = 0; q < P; ++q) outs.emplace_back(dt, n);
              for (auto& h : outs) out_views.push_back(h.view());
            }
            comm.gather(out_views, mine.view(), root, mode(async_op))->wait();
            HostTensor single(dt, n * P);
            comm.gather_single(single.view(), mine.view(), root, mode(async_op))->wait();
            if (r == root) {
              for (int q = 0; q < P; ++q)
                for (int64_t i = 0; i < n; ++i) {
                  ASSERT_EQ(outs[q].get(i), (q * 13 + i) % 100);
                  ASSERT_EQ(single.get(q * n + i), (q * 13 + i) % 100);
                }
            }
          }
        }
      }
    });
  }
}

TEST(Gloo, AllGatherFamily) {
  for (int P : kWorlds) {
    run_threads(P, [&](Communicator& comm) {
      const int r = comm.rank();
      for (DType dt : kMoveTypes) {
        for (bool async_op : {false, true}) {
          const int64_t n = 23;
          HostTensor in(dt, n);
          for (int64_t i = 0; i < n; ++i) in.set(i, (r * 17 + i) % 100);
          std::vector<HostTensor> outs;
          for (int q = 0; q < P; ++q) outs.emplace_back(dt, n);
          std::vector<TensorView> views;
          for (auto& h : outs) views.push_back(h.view());
          comm.all_gather(views, in.view(), mode(async_op))->wait();
          for (int q = 0; q < P; ++q)
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(outs[q].get(i), (q * 17 + i) % 100);

          HostTensor single(dt, std::vector<int64_t>{P * n});
          comm.all_gather_single(single.view(), in.view(), mode(async_op))->wait();
          for (int q = 0; q < P; ++q)
            for (int64_t i = 0; i < n; ++i) ASSERT_EQ(single.get(q * n + i), (q * 17 + i) % 100);

          // all_gather_v: rank q contributes q + 1 rows of 3 (rank 0 of a 1-world: 1 row)
          HostTensor vin(dt, std::vector<int64_t>{r + 1, 3});
          for (int64_t i = 0; i < vin.numel(); ++i) vin.set(i, (r * 7 + i) % 100);
          std::vector<HostTensor> vouts;
          for (int q = 0; q < P; ++q) vouts.emplace_back(dt, std::vector<int64_t>{q + 1, 3});
          std::vector<TensorView> vviews;
          for (auto& h : vouts) vviews.push_back(h.view());
          comm.all_gather_v(vviews, vin.view(), mode(async_op))->wait();
          for (int q = 0; q < P; ++q)
            for (int64_t i = 0; i < vouts[q].numel(); ++i)
              ASSERT_EQ(vouts[q].get(i), (q * 7 + i) % 100);
        }
      }
    });
  }
}

TEST(Gloo, ReduceScatterFamily) {
  for (int P : kWorlds) {
    run_threads(P, [&](Communicator& comm) {
      const int r = comm.rank();
      for (DType dt : kReduceTypes) {
        for (bool async_op : {false, true}) {
          const ReduceOp op = ReduceOp::sum();
          const int64_t n = 11;
          // list form: input q goes to rank q
          std::vector<HostTensor> ins;
          for (int q = 0; q < P; ++q) {
            ins.emplace_back(dt, n);
            for (int64_t i = 0; i < n; ++i) ins.back().set(i, value(op.type, dt, P, r, q * n + i));
          }
          std::vector<TensorView> views;
          for (auto& h : ins) views.push_back(h.view());
          HostTensor out(dt, n);
          comm.reduce_scatter(out.view(), views, op, mode(async_op))->wait();
          for (int64_t i = 0; i < n; ++i)
            ASSERT_EQ(out.get(i), expected_reduce(op, dt, P, r * n + i)) << dtype_name(dt);

          HostTensor in(dt, n * P);
          for (int64_t i = 0; i < n * P; ++i) in.set(i, value(op.type, dt, P, r, i));
          out.poison();
          comm.reduce_scatter_single(out.view(), in.view(), ReduceOp::max(), mode(async_op))
              ->wait();
          for (int64_t i = 0; i < n; ++i)
            ASSERT_EQ(out.get(i), expected_reduce(ReduceOp::max(), dt, P, r * n + i));

          // v form: rank q's slot has q + 2 elements
          std::vector<HostTensor> vins;
          int64_t off = 0;
          std::vector<int64_t> offs;
          for (int q = 0; q < P; ++q) {
            vins.emplace_back(dt, q + 2);
            offs.push_back(off);
            for (int64_t i = 0; i < q + 2; ++i)
              vins.back().set(i, value(op.type, dt, P, r, off + i));
            off += q + 2;
          }
          std::vector<TensorView> vviews;
          for (auto& h : vins) vviews.push_back(h.view());
          HostTensor vout(dt, r + 2);
          comm.reduce_scatter_v(vout.view(), vviews, op, mode(async_op))->wait();
          for (int64_t i = 0; i < r + 2; ++i)
            ASSERT_EQ(vout.get(i), expected_reduce(op, dt, P, offs[r] + i));
        }
      }
    });
  }
}

TEST(Gloo, AllToAllFamily) {
  for (int P : kWorlds) {
    // Random split matrix shared by every rank: rows[p][q] = rows p sends to q (zeros allowed).
    std::mt19937 rng(1234 + P);
    std::vector<std::vector<int64_t>> rows(P, std::vector<int64_t>(P));
    for (auto& v : rows)
      for (auto& x : v) x = rng() % 4 == 0 ? 0 : rng() % 5 + 1;
    run_threads(P, [&](Communicator& comm) {
      const int r = comm.rank();
      const int64_t width = 3;
      for (DType dt : kMoveTypes) {
        for (bool async_op : {false, true}) {
          // all_to_all_single: 2 rows of `width` per peer
          HostTensor in(dt, std::vector<int64_t>{2 * P, width});
          for (int64_t i = 0; i < in.numel(); ++i) in.set(i, (r * 31 + i) % 100);
          HostTensor out(dt, std::vector<int64_t>{2 * P, width});
          comm.all_to_all_single(out.view(), in.view(), mode(async_op))->wait();
          for (int p = 0; p < P; ++p)
            for (int64_t i = 0; i < 2 * width; ++i)
              ASSERT_EQ(out.get(p * 2 * width + i), (p * 31 + r * 2 * width + i) % 100);

          // all_to_all_v_single with the random split matrix
          std::vector<int64_t> in_splits = rows[r], out_splits(P);
          for (int p = 0; p < P; ++p) out_splits[p] = rows[p][r];
          const int64_t in_rows = std::accumulate(in_splits.begin(), in_splits.end(), int64_t{0});
          const int64_t out_rows =
              std::accumulate(out_splits.begin(), out_splits.end(), int64_t{0});
          HostTensor vin(dt, std::vector<int64_t>{in_rows, width});
          for (int64_t i = 0; i < vin.numel(); ++i) vin.set(i, (r * 29 + i) % 100);
          HostTensor vout(dt, std::vector<int64_t>{out_rows, width});
          comm.all_to_all_v_single(vout.view(), vin.view(), out_splits, in_splits, mode(async_op))
              ->wait();
          int64_t o = 0;
          for (int p = 0; p < P; ++p) {
            int64_t src_off = 0;  // offset of p's chunk for r inside p's input
            for (int q = 0; q < r; ++q) src_off += rows[p][q];
            for (int64_t i = 0; i < rows[p][r] * width; ++i)
              ASSERT_EQ(vout.get(o * width + i), (p * 29 + src_off * width + i) % 100)
                  << "from " << p;
            o += rows[p][r];
          }

          // all_to_all with lists of different sizes
          std::vector<HostTensor> ins, outs;
          for (int q = 0; q < P; ++q) {
            ins.emplace_back(dt, rows[r][q] * width);
            for (int64_t i = 0; i < ins.back().numel(); ++i)
              ins.back().set(i, (r * 3 + q * 5 + i) % 100);
            outs.emplace_back(dt, rows[q][r] * width);
          }
          std::vector<TensorView> iv, ov;
          for (auto& h : ins) iv.push_back(h.view());
          for (auto& h : outs) ov.push_back(h.view());
          comm.all_to_all(ov, iv, mode(async_op))->wait();
          for (int p = 0; p < P; ++p)
            for (int64_t i = 0; i < outs[p].numel(); ++i)
              ASSERT_EQ(outs[p].get(i), (p * 3 + r * 5 + i) % 100);
        }
      }
    });
  }
}

TEST(Gloo, AllToAllWithARankThatMovesNothing) {
  // Rank 0 neither sends nor receives a byte; the others exchange among themselves.
  for (int P : {2, 3, 4}) {
    run_threads(P, [&](Communicator& comm) {
      const int r = comm.rank();
      std::vector<int64_t> in_s(P), out_s(P);
      for (int q = 0; q < P; ++q) {
        in_s[q] = (r == 0 || q == 0) ? 0 : 2;
        out_s[q] = (r == 0 || q == 0) ? 0 : 2;
      }
      for (int iter = 0; iter < 3; ++iter) {
        HostTensor in(DType::kInt32, r == 0 ? 0 : 2 * (P - 1));
        HostTensor out(DType::kInt32, r == 0 ? 0 : 2 * (P - 1));
        for (int64_t i = 0; i < in.numel(); ++i) in.set(i, r * 100 + i);
        comm.all_to_all_v_single(out.view(), in.view(), out_s, in_s, mode(iter % 2 == 1))->wait();
        for (int p = 1, o = 0; p < P && r != 0; ++p, o += 2) {
          const int my_slot = r - 1;  // p's chunk for r sits after its chunks for 1..r-1
          for (int i = 0; i < 2; ++i) ASSERT_EQ(out.get(o + i), p * 100 + my_slot * 2 + i);
        }
      }
    });
  }
}

TEST(Gloo, PointToPointAndBarrier) {
  for (int P : kWorlds) {
    run_threads(P, [&](Communicator& comm) {
      const int r = comm.rank();
      comm.barrier();
      comm.barrier(mode(true))->wait();
      if (P == 1) return;
      for (DType dt : kMoveTypes) {
        // ring: send to r+1, receive from r-1, issued async together
        const int64_t n = 1000 + r;
        const int next = (r + 1) % P, prev = (r + P - 1) % P;
        HostTensor s(dt, n), d(dt, 1000 + prev);
        for (int64_t i = 0; i < n; ++i) s.set(i, (r + i) % 100);
        auto ws = comm.send(s.view(), next, mode(true));
        auto wr = comm.recv(d.view(), prev, mode(true));
        ws->wait();
        wr->wait();
        EXPECT_TRUE(wr->is_completed());
        for (int64_t i = 0; i < d.numel(); ++i) ASSERT_EQ(d.get(i), (prev + i) % 100);

        // batch: everyone sends a distinct message to everyone else
        std::vector<HostTensor> sends, recvs;
        std::vector<P2POp> ops;
        for (int q = 0; q < P; ++q) {
          if (q == r) continue;
          sends.emplace_back(dt, 5 + q);
          for (int64_t i = 0; i < 5 + q; ++i) sends.back().set(i, (r * 10 + q + i) % 100);
          recvs.emplace_back(dt, 5 + r);
        }
        size_t k = 0;
        for (int q = 0; q < P; ++q) {
          if (q == r) continue;
          ops.push_back({P2POp::Kind::kRecv, recvs[k].view(), q});
          ops.push_back({P2POp::Kind::kSend, sends[k].view(), q});
          ++k;
        }
        comm.batch_p2p(ops, mode(false));
        k = 0;
        for (int q = 0; q < P; ++q) {
          if (q == r) continue;
          for (int64_t i = 0; i < 5 + r; ++i) ASSERT_EQ(recvs[k].get(i), (q * 10 + r + i) % 100);
          ++k;
        }
      }
      // sync send/recv pairs in a fixed order
      if (r == 0) {
        HostTensor t(DType::kInt32, 4);
        for (int i = 0; i < 4; ++i) t.set(i, 40 + i);
        comm.send(t.view(), 1);
      } else if (r == 1) {
        HostTensor t(DType::kInt32, 4);
        comm.recv(t.view(), 0);
        for (int i = 0; i < 4; ++i) ASSERT_EQ(t.get(i), 40 + i);
      }
    });
  }
}

TEST(Gloo, SplitIntoSubgroups) {
  run_threads(4, [&](Communicator& comm) {
    const int r = comm.rank();
    const std::vector<int> even = {0, 2}, odd = {3, 1};  // order sets the new ranks
    auto sub = comm.split(r % 2 == 0 ? even : odd, r % 2 == 0 ? "even" : "odd");
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), 2);
    EXPECT_EQ(sub->rank(), r % 2 == 0 ? r / 2 : (r == 3 ? 0 : 1));
    HostTensor t(DType::kInt64, 3);
    for (int i = 0; i < 3; ++i) t.set(i, r + i);
    sub->all_reduce(t.view(), ReduceOp::sum());
    for (int i = 0; i < 3; ++i) ASSERT_EQ(t.get(i), (r % 2 == 0 ? 0 + 2 : 1 + 3) + 2 * i);
    // A rank outside the list gets null; members still work.
    auto only01 = comm.split({0, 1}, "pair");
    EXPECT_EQ(only01 == nullptr, r >= 2);
    if (only01) {
      only01->barrier();
      only01->finalize();
    }
    sub->finalize();
  });
}

TEST(Gloo, MissingPeerTimesOut) {
  // Rank 1 never calls all_reduce; rank 0 must get a Timeout within timeout + 1 s.
  const auto timeout = 600ms;
  std::atomic<bool> done{false};
  run_threads(
      2,
      [&](Communicator& comm) {
        if (comm.rank() == 1) {  // alive, connected, but never calls
          while (!done) std::this_thread::sleep_for(5ms);
          return;
        }
        {
          HostTensor t(DType::kFloat32, 8);
          CallOptions o;
          o.options.timeout = timeout;
          const auto t0 = std::chrono::steady_clock::now();
          try {
            comm.all_reduce(t.view(), ReduceOp::sum(), o);
            ADD_FAILURE() << "all_reduce returned without its peer";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
            EXPECT_NE(std::string(e.what()).find("all_reduce"), std::string::npos) << e.what();
          }
          const auto took = std::chrono::steady_clock::now() - t0;
          EXPECT_LT(took, timeout + 1s);
          EXPECT_GE(took, timeout - 50ms);
          // A receive nobody sends to also times out.
          CallOptions o2 = o;
          try {
            comm.recv(t.view(), 1, o2);
            ADD_FAILURE() << "recv returned without a sender";
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
          }
          done = true;
        }
      },
      5s);
}

TEST(Gloo, PeerThatDiesFailsFast) {
  // A peer whose communicator goes away breaks the connection: the waiter fails at once.
  run_threads(
      2,
      [&](Communicator& comm) {
        // Both ranks connected first: a peer leaving during the other's rendezvous would fail
        // that rank's new_comm instead of the op under test.
        comm.barrier();
        if (comm.rank() == 1) return;
        HostTensor t(DType::kFloat32, 8);
        const auto t0 = std::chrono::steady_clock::now();
        try {
          comm.all_reduce(t.view(), ReduceOp::sum());
          ADD_FAILURE() << "all_reduce returned without its peer";
        } catch (const Error& e) {
          EXPECT_TRUE(e.code() == ErrorCode::kBackendError || e.code() == ErrorCode::kTimeout)
              << e.what();
        }
        EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
      },
      10s);
}

TEST(Gloo, AbortUnblocksWaiters) {
  std::atomic<bool> done{false};
  run_threads(
      2,
      [&](Communicator& comm) {
        if (comm.rank() == 1) {
          while (!done) std::this_thread::sleep_for(5ms);
          return;
        }
        HostTensor t(DType::kFloat32, 8);
        bool hook_ran = false;
        auto h = comm.register_abort_hook([&] { hook_ran = true; });
        auto w = comm.all_reduce(t.view(), ReduceOp::sum(), mode(true));
        HostTensor r(DType::kFloat32, 8);
        auto wr = comm.recv(r.view(), 1, mode(true));
        std::thread aborter([&] {
          std::this_thread::sleep_for(200ms);
          comm.abort();
        });
        const auto t0 = std::chrono::steady_clock::now();
        for (auto& work : {w, wr}) {
          try {
            work->wait();
            ADD_FAILURE() << "wait returned after abort";
          } catch (const Error& e) {
            EXPECT_TRUE(e.code() == ErrorCode::kAborted) << e.what();
          }
        }
        aborter.join();
        EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
        EXPECT_TRUE(hook_ran);
        EXPECT_TRUE(comm.is_aborted());
        EXPECT_EQ(w->status(), WorkStatus::kError);
        try {
          comm.barrier();
          ADD_FAILURE() << "an aborted communicator accepted an op";
        } catch (const Error& e) {
          EXPECT_EQ(e.code(), ErrorCode::kAborted);
        }
        done = true;
      },
      60s);
}

TEST(Gloo, HooksSeeIncreasingOpIds) {
  run_threads(2, [&](Communicator& comm) {
    std::vector<uint64_t> pre, post;
    auto h1 = comm.register_pre_hook([&](const OpInfo& i) {
      pre.push_back(i.op_id);
      EXPECT_EQ(i.work, nullptr);
      if (i.op == OpKind::kAllReduce) {  // NOTE [hook op record]: the tensors, in place
        EXPECT_EQ(i.inputs.size(), 1u);
        EXPECT_EQ(i.outputs.size(), 1u);
        EXPECT_EQ(i.inputs[0].numel(), 2);
        EXPECT_EQ(i.inputs[0].data, i.outputs[0].data);
        ASSERT_NE(i.reduce, nullptr);
        EXPECT_EQ(i.reduce->type, RedOpType::kSum);
        EXPECT_EQ(i.frontend, nullptr);
      }
    });
    auto h2 = comm.register_post_hook([&](const OpInfo& i) {
      post.push_back(i.op_id);
      EXPECT_NE(i.work, nullptr);
    });
    HostTensor t(DType::kInt32, 2);
    t.set(0, 1);
    t.set(1, 2);
    comm.all_reduce(t.view(), ReduceOp::sum());
    comm.barrier();
    h1.remove();
    h1.remove();  // idempotent
    comm.barrier();
    h2.remove();
    comm.barrier();
    ASSERT_EQ(pre.size(), 2u);
    ASSERT_EQ(post.size(), 3u);
    EXPECT_LT(pre[0], pre[1]);
    EXPECT_EQ(post[0], pre[0]);
    EXPECT_LT(post[1], post[2]);
  });
}

// NOTE [flight recorder in C++]: the recorder's entries come from the C++ hooks alone: sizes,
// dtypes, sequence ids, states (a sync op completed, an async one once its work completes), the
// ring's bound, and a split's communicator recorded from then on.
TEST(Gloo, FlightRecorderRecordsFromTheHooks) {
  run_threads(2, [&](Communicator& comm) {
    auto fr = std::make_shared<FlightRecorder>(3, false);
    std::atomic<int> dumps{0};
    fr->attach(comm.shared_from_this(), [&](int) { ++dumps; });
    HostTensor t(DType::kFloat32, 4);
    comm.all_reduce(t.view(), ReduceOp::sum());
    CallOptions async;
    async.async_op = true;
    auto w = comm.broadcast(t.view(), 0, async);
    w->wait();
    comm.barrier();
    auto sub = comm.split({0, 1}, "fr_sub");
    ASSERT_NE(sub, nullptr);
    sub->barrier();
    auto e = fr->entries(true);
    ASSERT_EQ(e.size(), 3u);  // the last three of five
    EXPECT_EQ(fr->size(), 5u);
    EXPECT_EQ(e[0].op, "barrier");
    EXPECT_EQ(e[1].op, "split");
    EXPECT_EQ(e[2].op, "barrier");
    EXPECT_EQ(e[2].comm, "fr_sub");
    const auto all = fr->groups();
    ASSERT_EQ(all.size(), 2u);
    EXPECT_EQ(all[0].collective_seq_id, 4u);
    fr->reset();
    comm.all_reduce(t.view(), ReduceOp::sum());
    w = comm.broadcast(t.view(), 0, async);
    w->wait();
    e = fr->entries(true);
    ASSERT_EQ(e.size(), 2u);
    EXPECT_EQ(e[0].input_sizes, std::vector<std::vector<int64_t>>{{4}});
    EXPECT_EQ(e[0].input_dtypes, std::vector<std::string>{"Float"});
    EXPECT_EQ(e[0].state, FlightRecorder::State::kCompleted);
    EXPECT_EQ(e[1].state, FlightRecorder::State::kCompleted);  // read from its work
    EXPECT_TRUE(e[1].async_op);
    EXPECT_EQ(fr->entries(false).size(), 0u);
    fr->detach();
    comm.barrier();
    EXPECT_EQ(fr->size(), 2u);
    EXPECT_EQ(dumps.load(), 0);
    sub->finalize();
  });
}

// NOTE [clog]: each op's signature fields, by the form of its arguments.
TEST(Clog, SignatureFields) {
  const auto join = [](const OpInfo& i, bool buffers) {
    const auto kv = Clog::signature(i, buffers);
    if (!kv) return std::string("none");
    std::string s;
    for (const auto& f : *kv) s += (s.empty() ? "" : "|") + f;
    return s;
  };
  alignas(8) static char mem[64];
  TensorView a = TensorView::contiguous(mem, DType::kBFloat16, {3, 2});
  TensorView b = TensorView::contiguous(mem + 16, DType::kFloat32, {4});
  TensorView lst[2] = {TensorView::contiguous(mem, DType::kInt64, {1}),
                       TensorView::contiguous(mem + 8, DType::kInt64, {2})};
  const ReduceOp premul{RedOpType::kPremulSum, 0.5};
  OpInfo i{};
  i.op = OpKind::kScatter;  // a list in, one tensor out; the dtype is the single tensor's
  i.inputs = lst;
  i.outputs = {&b, 1};
  i.peer = 1;
  EXPECT_EQ(join(i, false), "in_counts=1,2|out_count=4|dtype=f32|root=1|async_op=f");
  i.op = OpKind::kAllToAll;  // lists both ways: the first input's dtype
  i.outputs = lst;
  i.async_op = true;
  EXPECT_EQ(join(i, false), "in_counts=1,2|out_counts=1,2|dtype=i64|async_op=t");
  i.inputs = {};  // (a rank with no inputs)
  EXPECT_EQ(join(i, false), "in_counts=|out_counts=1,2|dtype=other|async_op=t");
  i = OpInfo{};
  i.op = OpKind::kReduceScatterSingle;
  i.inputs = {&a, 1};
  i.outputs = {&b, 1};
  i.reduce = &premul;
  const auto hex = [](const void* p) {  // as Python writes f"{t.data_ptr():#x}"
    char buf[32];
    std::snprintf(buf, sizeof(buf), "0x%llx",
                  static_cast<unsigned long long>(reinterpret_cast<uintptr_t>(p)));
    return std::string(buf);
  };
  EXPECT_EQ(join(i, true), "in_count=6|out_count=4|dtype=bf16|red_op=premul_sum|async_op=f|in=" +
                               hex(mem) + "|out=" + hex(mem + 16));
  i = OpInfo{};
  i.op = OpKind::kAllToAllVSingle;
  const int64_t ins[] = {1, 2}, outs[] = {2, 1};
  i.inputs = {&a, 1};
  i.outputs = {&a, 1};
  i.input_splits = ins;
  i.output_splits = outs;
  EXPECT_EQ(join(i, false), "in_splits=1,2|out_splits=2,1|dtype=bf16|async_op=f");
  i = OpInfo{};
  i.op = OpKind::kRecv;
  i.outputs = {&b, 1};
  i.peer = 3;
  EXPECT_EQ(join(i, false), "in_count=0|out_count=4|dtype=f32|peer=3|async_op=f");
  i = OpInfo{};
  i.op = OpKind::kBatchP2P;
  i.num_ops = 4;
  EXPECT_EQ(join(i, false), "num_ops=4|async_op=f");
  i.op = OpKind::kBarrier;
  EXPECT_EQ(join(i, true), "async_op=f");
  i.op = OpKind::kFinalize;
  EXPECT_EQ(join(i, false), "none");
}

// NOTE [wait observers]: run once, at the first waited(); one added after runs at once.
TEST(Clog, WaitObserversRunOnce) {
  CompletedWork w;
  int n = 0;
  w.on_waited([&] { ++n; });
  w.wait();
  EXPECT_EQ(n, 0);  // a wait alone is not a frontend's
  w.waited();
  w.waited();
  EXPECT_EQ(n, 1);
  w.on_waited([&] { n += 10; });
  EXPECT_EQ(n, 11);
}

// NOTE [clog]: the log of a communicator's ops, sync and async (its end and wait at waited()),
// the split line, nothing after detach.
TEST(Gloo, ClogLogsFromTheHooks) {
  const auto dir = std::filesystem::temp_directory_path();
  run_threads(2, [&](Communicator& comm) {
    const auto path = dir / ("fastcomms_clog_" + std::to_string(::getpid()) + "_" +
                             std::to_string(comm.rank()) + ".log");
    auto log = std::make_shared<Clog>(path.string(), Clog::Options{true, true, true, false});
    log->attach(comm.shared_from_this());
    HostTensor t(DType::kFloat32, 4);
    comm.all_reduce(t.view(), ReduceOp::sum());
    auto w = comm.broadcast(t.view(), 0, mode(true));
    w->wait();
    w->waited();
    auto sub = comm.split({0, 1}, "clog_sub");
    log->detach();
    comm.barrier();
    log->close();
    std::ifstream in(path);
    std::vector<std::string> lines;
    for (std::string l; std::getline(in, l);) lines.push_back(l);
    std::filesystem::remove(path);
    ASSERT_EQ(lines.size(), 12u);
    EXPECT_EQ(lines[0].rfind("V|1|base_timestamp=", 0), 0u);
    EXPECT_EQ(lines[1], "new_comm|comm=" + comm.name() + "|rank=" + std::to_string(comm.rank()) +
                            "|world_size=2");
    EXPECT_EQ(lines[2],
              "C1|sig|all_reduce|in_count=4|out_count=4|dtype=f32|red_op=sum|"
              "async_op=f|comm=" +
                  comm.name());
    EXPECT_EQ(lines[3].rfind("C1|Q|work_id=1|+", 0), 0u);
    EXPECT_EQ(lines[4].rfind("C1|S|+", 0), 0u);
    EXPECT_EQ(lines[5].rfind("C1|E|+", 0), 0u);
    EXPECT_EQ(
        lines[6],
        "C2|sig|broadcast|in_count=4|out_count=4|dtype=f32|root=0|async_op=t|comm=" + comm.name());
    EXPECT_EQ(lines[7].rfind("C2|Q|work_id=2|+", 0), 0u);
    EXPECT_EQ(lines[8].rfind("C2|S|+", 0), 0u);
    EXPECT_EQ(lines[9].rfind("C2|E|+", 0), 0u);
    EXPECT_EQ(lines[10].rfind("C2|W|+", 0), 0u);
    EXPECT_EQ(lines[11], "split|parent=" + comm.name() + "|child=clog_sub|ranks=0,1");
    sub->finalize();
  });
}

// NOTE [one hook registry], NOTE [op ids]: split and finalize run the hooks too; ids come from
// one sequence for the process (both thread-ranks and their splits draw from it), finalize's is 0.
TEST(Gloo, HooksSeeSplitAndFinalizeWithProcessWideIds) {
  run_threads(2, [&](Communicator& comm) {
    std::vector<OpInfo> seen;
    auto h = comm.register_pre_hook([&](const OpInfo& i) { seen.push_back(i); });
    comm.barrier();
    auto sub = comm.split({0, 1}, "all");
    ASSERT_NE(sub, nullptr);
    std::vector<uint64_t> sub_ids;
    auto hs = sub->register_post_hook([&](const OpInfo& i) { sub_ids.push_back(i.op_id); });
    sub->barrier();
    sub->finalize();
    comm.finalize();
    h.remove();  // (the harness finalizes again after this body)
    hs.remove();
    ASSERT_EQ(seen.size(), 3u);
    EXPECT_EQ(seen[0].op, OpKind::kBarrier);
    EXPECT_EQ(seen[1].op, OpKind::kSplit);
    EXPECT_GT(seen[1].op_id, seen[0].op_id);
    EXPECT_EQ(seen[2].op, OpKind::kFinalize);
    EXPECT_EQ(seen[2].op_id, 0u);
    ASSERT_EQ(sub_ids.size(), 2u);  // the split's barrier, then its finalize
    EXPECT_GT(sub_ids[0], seen[1].op_id);
    EXPECT_EQ(sub_ids[1], 0u);
    EXPECT_STREQ(op_name(OpKind::kFinalize), "finalize");
    const uint64_t first = next_op_id();
    EXPECT_LT(first, next_op_id());
  });
}

TEST(GlooProcesses, EveryOpFamilyAcrossProcesses) {
  for (int P : {2, 4}) {
    run_processes(P, [&](Communicator& comm) {
      const int r = comm.rank();
      HostTensor t(DType::kFloat32, 1 << 16);
      for (int64_t i = 0; i < t.numel(); ++i) t.set(i, (r + i) % 7);
      comm.all_reduce(t.view(), ReduceOp::sum());
      for (int64_t i = 0; i < t.numel(); ++i) {
        double want = 0;
        for (int q = 0; q < P; ++q) want += (q + i) % 7;
        if (t.get(i) != want) throw std::runtime_error("all_reduce mismatch");
      }
      HostTensor in(DType::kInt64, std::vector<int64_t>{P * 3}),
          out(DType::kInt64, std::vector<int64_t>{P * 3});
      for (int64_t i = 0; i < in.numel(); ++i) in.set(i, r * 100 + i);
      comm.all_to_all_single(out.view(), in.view(), mode(true))->wait();
      for (int p = 0; p < P; ++p)
        for (int i = 0; i < 3; ++i)
          if (out.get(p * 3 + i) != p * 100 + r * 3 + i)
            throw std::runtime_error("all_to_all_single mismatch");
      HostTensor b(DType::kUInt8, 100);
      if (r == P - 1)
        for (int i = 0; i < 100; ++i) b.set(i, i);
      comm.broadcast(b.view(), P - 1);
      for (int i = 0; i < 100; ++i)
        if (b.get(i) != i) throw std::runtime_error("broadcast mismatch");
      HostTensor s(DType::kInt32, 10), d(DType::kInt32, 10);
      for (int i = 0; i < 10; ++i) s.set(i, r * 10 + i);
      auto ws = comm.send(s.view(), (r + 1) % P, mode(true));
      comm.recv(d.view(), (r + P - 1) % P);
      ws->wait();
      for (int i = 0; i < 10; ++i)
        if (d.get(i) != ((r + P - 1) % P) * 10 + i) throw std::runtime_error("p2p mismatch");
      comm.barrier();
    });
  }
}

}  // namespace
}  // namespace fastcomms::test
