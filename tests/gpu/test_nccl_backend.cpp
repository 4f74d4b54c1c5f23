// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// GPU tier: the nccl backend through the communicator, world 2 (one process per GPU). Every op,
// sync and async, small-integer data (exact in every dtype), outputs poisoned first, results
// compared with values computed on the host; a captured all_reduce replayed from a CUDA graph;
// a peer that never calls gives a TIMEDOUT work and an aborted communicator, not a hang.
// Exits 77 (SKIPPED) without two GPUs.
#include <cmath>
#include <cstring>
#include <functional>
#include <thread>

#include <random>

#include "../common/values.hpp"
#include "fastcomms/core/communicator.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/plan/reference.hpp"
#include "fastcomms/ulysses/transport.hpp"
#include "tests/common/gpu_world.hpp"
#include "tests/common/ulysses_body.hpp"

using namespace fastcomms;

namespace {

int failures = 0;
// The backend under test: "nccl", then "nvlink" (all_to_all_single peer-to-peer over NVLink,
// every other op through its inner nccl communicator), each over the same checks.
const char* g_backend = "nccl";
#define EXPECT(cond, ...)                                            \
  do {                                                               \
    if (!(cond)) {                                                   \
      ++failures;                                                    \
      std::fprintf(stderr, "FAILED %s:%d: %s\n", __FILE__, __LINE__, \
                   detail::cat(__VA_ARGS__).c_str());                \
    }                                                                \
  } while (0)

using test::decode;
using test::encode;

// A device tensor with a host mirror.
struct Buf {
  DType dt;
  int64_t n;
  int device;
  cuda::DeviceBuffer d;
  std::vector<uint8_t> h;
  Buf(DType t, int64_t count, int dev)
      : dt(t),
        n(count),
        device(dev),
        d(std::max<size_t>(1, count * dtype_size(t))),
        h(count * dtype_size(t)) {}
  TensorView view() {
    return TensorView::contiguous(d.get(), dt, {n}, Device{DeviceType::kCUDA, device});
  }
  void set(int64_t i, double v) { encode(dt, h.data() + i * dtype_size(dt), v); }
  double get(int64_t i) const { return decode(dt, h.data() + i * dtype_size(dt)); }
  void upload() { gpu_test::upload(d.get(), h.data(), h.size()); }
  void poison() { FASTCOMMS_CUDA_CHECK(cudaMemset(d.get(), 0xCD, h.size())); }
  void download(cudaStream_t s) {
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(s));
    FASTCOMMS_CUDA_CHECK(cudaMemcpy(h.data(), d.get(), h.size(), cudaMemcpyDeviceToHost));
  }
};

double val(int r, int64_t i) { return static_cast<double>((r * 5 + i * 3) % 7 - 3); }

int rank_main(int rank, int P, int device, std::shared_ptr<Store> store) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  CommOptions o;
  o.store = store;
  o.name = std::string(g_backend) + "-test";
  o.timeout = std::chrono::seconds(60);
  auto comm = Communicator::create(g_backend, rank, P, Device{DeviceType::kCUDA, device}, o);
  cuda::Stream stream;
  cudaStream_t st = stream.get();
  int checks = 0;
  for (bool async_op : {false, true}) {
    CallOptions co;
    co.async_op = async_op;
    co.stream = st;
    auto done = [&](const WorkPtr& w) {
      w->wait();
      FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
    };
    for (DType dt : {DType::kFloat32, DType::kBFloat16, DType::kInt32, DType::kInt64}) {
      const int64_t n = 1000;
      std::vector<std::pair<ReduceOp, const char*>> ops = {{ReduceOp::sum(), "sum"},
                                                           {ReduceOp::product(), "prod"},
                                                           {ReduceOp::min(), "min"},
                                                           {ReduceOp::max(), "max"}};
      if (!dtype_is_integral(dt)) ops.push_back({ReduceOp::avg(), "avg"});
      if (dt == DType::kFloat32) ops.push_back({ReduceOp::premul_sum(2.0), "premul"});
      for (auto& [op, name] : ops) {
        Buf t(dt, n, device);
        for (int64_t i = 0; i < n; ++i)
          t.set(i, val(rank, i) * (op.type == RedOpType::kAvg ? P : 1));
        t.upload();
        done(comm->all_reduce(t.view(), op, co));
        t.download(st);
        for (int64_t i = 0; i < n; ++i) {
          double want = val(0, i) * (op.type == RedOpType::kAvg ? P : 1);
          for (int r = 1; r < P; ++r) {
            const double v = val(r, i) * (op.type == RedOpType::kAvg ? P : 1);
            want = op.type == RedOpType::kProduct ? want * v
                   : op.type == RedOpType::kMin   ? std::min(want, v)
                   : op.type == RedOpType::kMax   ? std::max(want, v)
                                                  : want + v;
          }
          if (op.type == RedOpType::kAvg) want /= P;
          if (op.type == RedOpType::kPremulSum) want *= 2;
          if (t.get(i) != want) {
            EXPECT(false, "all_reduce ", name, " ", dtype_name(dt), " i=", i, " got ", t.get(i),
                   " want ", want);
            break;
          }
        }
        ++checks;
      }
      // reduce_scatter_single and all_gather_single
      Buf in(dt, n * P, device), out(dt, n, device);
      for (int64_t i = 0; i < n * P; ++i) in.set(i, val(rank, i));
      in.upload();
      out.poison();
      done(comm->reduce_scatter_single(out.view(), in.view(), ReduceOp::sum(), co));
      out.download(st);
      for (int64_t i = 0; i < n; ++i) {
        double want = 0;
        for (int r = 0; r < P; ++r) want += val(r, rank * n + i);
        if (out.get(i) != want) {
          EXPECT(false, "reduce_scatter_single ", dtype_name(dt), " i=", i);
          break;
        }
      }
      Buf g(dt, n * P, device);
      g.poison();
      done(comm->all_gather_single(g.view(), out.view(), co));
      g.download(st);
      for (int r = 0; r < P; ++r)
        for (int64_t i = 0; i < n; ++i) {
          double want = 0;
          for (int q = 0; q < P; ++q) want += val(q, r * n + i);
          if (g.get(r * n + i) != want) {
            EXPECT(false, "all_gather_single ", dtype_name(dt));
            r = P;
            break;
          }
        }
      checks += 2;
    }
    // Data movement on raw bytes (fp8 included): broadcast, all_to_all_v_single, p2p, scatter,
    // gather, all_gather (v), reduce_scatter (v), all_to_all.
    for (DType dt : {DType::kUInt8, DType::kFloat8E4M3FN, DType::kFloat32}) {
      for (int root = 0; root < P; ++root) {
        Buf b(dt, 333, device);
        for (int64_t i = 0; i < b.n; ++i) b.set(i, rank == root ? (i * 7 + root) % 100 : 0);
        b.upload();
        done(comm->broadcast(b.view(), root, co));
        b.download(st);
        for (int64_t i = 0; i < b.n; ++i)
          if (b.get(i) != (i * 7 + root) % 100) {
            EXPECT(false, "broadcast root ", root, " ", dtype_name(dt));
            break;
          }
        ++checks;
      }
      // all_to_all_single, eager: chunks of 16-byte multiples (the nvlink backend moves them
      // peer-to-peer) and of other sizes (its inner nccl moves them); poisoned outputs
      for (int64_t rows : {int64_t{64}, int64_t{1000}, int64_t{7}, int64_t{4096}}) {
        Buf a(dt, rows * P, device), b(dt, rows * P, device);
        for (int64_t i = 0; i < a.n; ++i) a.set(i, (rank * 31 + i * 3) % 100);
        a.upload();
        b.poison();
        done(comm->all_to_all_single(b.view(), a.view(), co));
        b.download(st);
        for (int p = 0; p < P; ++p)
          for (int64_t i = 0; i < rows; ++i)
            if (b.get(p * rows + i) != (p * 31 + (rank * rows + i) * 3) % 100) {
              EXPECT(false, "all_to_all_single ", rows, " rows from ", p, " ", dtype_name(dt));
              p = P;
              break;
            }
        ++checks;
      }
      // uneven all_to_all_v_single: rank r sends (q + r + 1) rows of 3 to q
      std::vector<int64_t> in_s(P), out_s(P);
      int64_t in_rows = 0, out_rows = 0;
      for (int q = 0; q < P; ++q) {
        in_rows += in_s[q] = q + rank + 1;
        out_rows += out_s[q] = rank + q + 1;
      }
      Buf a(dt, in_rows * 3, device), b(dt, out_rows * 3, device);
      for (int64_t i = 0; i < a.n; ++i) a.set(i, (rank * 50 + i) % 100);
      a.upload();
      b.poison();
      TensorView av = a.view(), bv = b.view();
      av.shape = {in_rows, 3};
      av.strides = {3, 1};
      bv.shape = {out_rows, 3};
      bv.strides = {3, 1};
      done(comm->all_to_all_v_single(bv, av, out_s, in_s, co));
      b.download(st);
      int64_t off = 0;
      for (int p = 0; p < P; ++p) {
        int64_t src = 0;
        for (int q = 0; q < rank; ++q) src += q + p + 1;
        for (int64_t i = 0; i < out_s[p] * 3; ++i)
          if (b.get(off + i) != (p * 50 + src * 3 + i) % 100) {
            EXPECT(false, "all_to_all_v_single from ", p, " ", dtype_name(dt));
            break;
          }
        off += out_s[p] * 3;
      }
      // p2p ring + batch
      Buf s(dt, 77, device), r(dt, 77, device);
      for (int64_t i = 0; i < 77; ++i) s.set(i, (rank + i) % 100);
      s.upload();
      r.poison();
      done(comm->batch_p2p({{P2POp::Kind::kSend, s.view(), (rank + 1) % P},
                            {P2POp::Kind::kRecv, r.view(), (rank + P - 1) % P}},
                           co));
      r.download(st);
      for (int64_t i = 0; i < 77; ++i)
        if (r.get(i) != ((rank + P - 1) % P + i) % 100) {
          EXPECT(false, "batch p2p ", dtype_name(dt));
          break;
        }
      // scatter / gather from root 1
      const int root = P - 1;
      std::vector<Buf> parts;
      std::vector<TensorView> pv;
      for (int q = 0; q < P; ++q) {
        parts.emplace_back(dt, 50, device);
        for (int64_t i = 0; i < 50; ++i) parts.back().set(i, (q * 9 + i) % 100);
        parts.back().upload();
      }
      for (auto& x : parts) pv.push_back(x.view());
      Buf one(dt, 50, device);
      one.poison();
      done(comm->scatter(one.view(), rank == root ? pv : std::vector<TensorView>{}, root, co));
      one.download(st);
      for (int64_t i = 0; i < 50; ++i)
        if (one.get(i) != (rank * 9 + i) % 100) {
          EXPECT(false, "scatter ", dtype_name(dt));
          break;
        }
      for (auto& x : parts) x.poison();
      done(comm->gather(rank == root ? pv : std::vector<TensorView>{}, one.view(), root, co));
      if (rank == root) {
        for (int q = 0; q < P; ++q) {
          parts[q].download(st);
          for (int64_t i = 0; i < 50; ++i)
            if (parts[q].get(i) != (q * 9 + i) % 100) {
              EXPECT(false, "gather from ", q, " ", dtype_name(dt));
              break;
            }
        }
      }
      // all_gather_v: rank q contributes q + 10 elements
      std::vector<Buf> outs;
      std::vector<TensorView> ov;
      for (int q = 0; q < P; ++q) {
        outs.emplace_back(dt, q + 10, device);
        outs.back().poison();
      }
      for (auto& x : outs) ov.push_back(x.view());
      Buf mine(dt, rank + 10, device);
      for (int64_t i = 0; i < mine.n; ++i) mine.set(i, (rank * 3 + i) % 100);
      mine.upload();
      done(comm->all_gather_v(ov, mine.view(), co));
      for (int q = 0; q < P; ++q) {
        outs[q].download(st);
        for (int64_t i = 0; i < q + 10; ++i)
          if (outs[q].get(i) != (q * 3 + i) % 100) {
            EXPECT(false, "all_gather_v from ", q, " ", dtype_name(dt));
            break;
          }
      }
      // all_to_all with lists
      std::vector<Buf> ins2, outs2;
      std::vector<TensorView> iv2, ov2;
      for (int q = 0; q < P; ++q) {
        ins2.emplace_back(dt, 20 + q, device);
        for (int64_t i = 0; i < 20 + q; ++i) ins2.back().set(i, (rank * 11 + q + i) % 100);
        ins2.back().upload();
        outs2.emplace_back(dt, 20 + rank, device);
        outs2.back().poison();
      }
      for (auto& x : ins2) iv2.push_back(x.view());
      for (auto& x : outs2) ov2.push_back(x.view());
      done(comm->all_to_all(ov2, iv2, co));
      for (int p = 0; p < P; ++p) {
        outs2[p].download(st);
        for (int64_t i = 0; i < 20 + rank; ++i)
          if (outs2[p].get(i) != (p * 11 + rank + i) % 100) {
            EXPECT(false, "all_to_all from ", p, " ", dtype_name(dt));
            break;
          }
      }
      done(comm->barrier(co));
      checks += 7;
    }
    // reduce_scatter_v (float32): rank q's slot has q + 5 elements
    {
      std::vector<Buf> ins;
      std::vector<TensorView> iv;
      int64_t base = 0;
      std::vector<int64_t> offs;
      for (int q = 0; q < P; ++q) {
        ins.emplace_back(DType::kFloat32, q + 5, device);
        offs.push_back(base);
        for (int64_t i = 0; i < q + 5; ++i) ins.back().set(i, val(rank, base + i));
        ins.back().upload();
        base += q + 5;
      }
      for (auto& x : ins) iv.push_back(x.view());
      Buf out(DType::kFloat32, rank + 5, device);
      out.poison();
      done(comm->reduce_scatter_v(out.view(), iv, ReduceOp::sum(), co));
      out.download(st);
      for (int64_t i = 0; i < rank + 5; ++i) {
        double want = 0;
        for (int r = 0; r < P; ++r) want += val(r, offs[rank] + i);
        if (out.get(i) != want) {
          EXPECT(false, "reduce_scatter_v i=", i);
          break;
        }
      }
      ++checks;
    }
  }
  // split on ncclCommSplit: reversed order swaps the ranks; a one-rank split leaves the other
  // rank with null.
  {
    auto swapped = comm->split({1, 0}, "swapped");
    EXPECT(swapped && swapped->rank() == 1 - rank && swapped->size() == 2, "split({1, 0})");
    if (swapped) {
      Buf t(DType::kInt64, 8, device);
      for (int i = 0; i < 8; ++i) t.set(i, rank * 10 + i);
      t.upload();
      CallOptions co;
      co.stream = st;
      swapped->all_reduce(t.view(), ReduceOp::sum(), co);
      t.download(st);
      for (int i = 0; i < 8; ++i) EXPECT(t.get(i) == 10 + 2 * i, "split all_reduce i=", i);
      swapped->finalize();
    }
    auto solo = comm->split({0}, "solo");
    EXPECT((solo != nullptr) == (rank == 0), "split({0}) on rank ", rank);
    if (solo) EXPECT(solo->size() == 1 && solo->rank() == 0, "solo shape");
    checks += 2;
  }
  // The Ulysses collective path on CUDA: the shared transport body (tests/common/
  // ulysses_body.hpp: random geometries, uneven and empty shards, element sizes 1/2/4/8, any d,
  // poisoned outputs) against the plan's host reference, through the Ulysses layer.
  {
    TransportInit ti;
    ti.rank = rank;
    ti.size = P;
    ti.device = comm->device();
    ti.comm = std::shared_ptr<Communicator>(comm.get(), [](Communicator*) {});
    auto transport = make_transport("collective", ti);  // a CUDA communicator: cuda_collective
    EXPECT(transport->kind() == "cuda_collective", "collective on CUDA took ", transport->kind());
    std::mt19937_64 rng(4242);  // same cases on both ranks
    const auto cases = test::random_cases(P, 40, rng, /*align16=*/false);
    const int bad = test::run_ulysses_body(*transport, cases, rank,
                                           gpu_test::device_memory(device, st), "cuda_collective");
    EXPECT(bad == 0, "cuda_collective transport body: ", bad, " failed checks");
    checks += static_cast<int>(cases.size()) * 2;
  }
  // CUDA graph: a captured sync all_reduce replays bit-exact.
  {
    Buf t(DType::kFloat32, 4096, device);
    CallOptions co;
    co.stream = st;
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FASTCOMMS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
    comm->all_reduce(t.view(), ReduceOp::sum(), co);
    FASTCOMMS_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
    FASTCOMMS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int rep = 0; rep < 3; ++rep) {
      for (int64_t i = 0; i < t.n; ++i) t.set(i, val(rank + rep, i));
      t.upload();
      FASTCOMMS_CUDA_CHECK(cudaGraphLaunch(exec, st));
      t.download(st);
      for (int64_t i = 0; i < t.n; ++i) {
        double want = 0;
        for (int r = 0; r < P; ++r) want += val(r + rep, i);
        if (t.get(i) != want) {
          EXPECT(false, "graph replay ", rep, " i=", i);
          break;
        }
      }
      ++checks;
    }
    FASTCOMMS_CUDA_CHECK(cudaGraphExecDestroy(exec));
    FASTCOMMS_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  // Every other op family captured in sync mode and replayed twice with fresh data.
  {
    CallOptions co;
    co.stream = st;
    const int64_t n = 256;
    Buf in(DType::kFloat32, n * P, device), out(DType::kFloat32, n * P, device);
    struct Captured {
      const char* name;
      std::function<void()> issue;
      std::function<bool(int rep)> check;
    };
    auto expect_sum = [&](int64_t i, int rep) {
      double w = 0;
      for (int r = 0; r < P; ++r) w += val(r + rep, i);
      return w;
    };
    std::vector<Captured> ops = {
        {"broadcast", [&] { comm->broadcast(in.view(), 0, co); },
         [&](int rep) {
           for (int64_t i = 0; i < n * P; ++i)
             if (in.get(i) != val(0 + rep, i)) return false;
           return true;
         }},
        {"all_gather_single",
         [&] {
           TensorView src = in.view();
           src.shape = {n};
           comm->all_gather_single(out.view(), src, co);
         },
         [&](int rep) {
           for (int r = 0; r < P; ++r)
             for (int64_t i = 0; i < n; ++i)
               if (out.get(r * n + i) != val(r + rep, i)) return false;
           return true;
         }},
        {"reduce_scatter_single",
         [&] {
           TensorView dst = out.view();
           dst.shape = {n};
           comm->reduce_scatter_single(dst, in.view(), ReduceOp::sum(), co);
         },
         [&](int rep) {
           for (int64_t i = 0; i < n; ++i)
             if (out.get(i) != expect_sum(rank * n + i, rep)) return false;
           return true;
         }},
        {"all_to_all_single", [&] { comm->all_to_all_single(out.view(), in.view(), co); },
         [&](int rep) {
           for (int p = 0; p < P; ++p)
             for (int64_t i = 0; i < n; ++i)
               if (out.get(p * n + i) != val(p + rep, rank * n + i)) return false;
           return true;
         }},
        {"barrier", [&] { comm->barrier(co); }, [&](int) { return true; }},
    };
    for (auto& op : ops) {
      FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      FASTCOMMS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      op.issue();
      FASTCOMMS_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
      FASTCOMMS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      for (int rep = 0; rep < 2; ++rep) {
        for (int64_t i = 0; i < n * P; ++i) in.set(i, val(rank + rep, i));
        in.upload();
        out.poison();
        FASTCOMMS_CUDA_CHECK(cudaGraphLaunch(exec, st));
        in.download(st);
        out.download(st);
        EXPECT(op.check(rep), "captured ", op.name, " replay ", rep);
        ++checks;
      }
      FASTCOMMS_CUDA_CHECK(cudaGraphExecDestroy(exec));
      FASTCOMMS_CUDA_CHECK(cudaGraphDestroy(graph));
    }
  }
  // Timeout: rank 1 never calls; rank 0's op must end TIMEDOUT within timeout + 1 s.
  std::string timeout_note = "not run";
  {
    Buf t(DType::kFloat32, 16, device);
    comm->barrier(CallOptions{false, {}, st});
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
    if (rank == 0) {
      CallOptions co;
      co.async_op = true;
      co.stream = st;
      co.options.timeout = std::chrono::milliseconds(1500);
      const auto t0 = std::chrono::steady_clock::now();
      auto w = comm->all_reduce(t.view(), ReduceOp::sum(), co);
      while (w->status() == WorkStatus::kInProgress &&
             std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10))
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      const double took =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT(w->status() == WorkStatus::kTimedOut, "status ", work_status_name(w->status()),
             " after ", took, " s");
      EXPECT(took < 2.5, "timeout took ", took, " s (timeout 1.5 s)");
      bool raised = false;
      try {
        w->wait();
      } catch (const Error& e) {
        raised = e.code() == ErrorCode::kTimeout;
      }
      EXPECT(raised, "wait() on a timed-out op did not raise Timeout");
      timeout_note = detail::cat(work_status_name(w->status()), " after ", took, " s");
    } else {
      std::this_thread::sleep_for(std::chrono::seconds(4));  // alive, never calls
      timeout_note = "peer stayed silent";
    }
  }
  std::printf("rank %d/%d (GPU %d): %s backend %s, %d checks, %d failures, timeout: %s\n", rank, P,
              device, g_backend, comm->backend_version().c_str(), checks, failures,
              timeout_note.c_str());
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

}  // namespace

int main() {
  std::string why;
  const int ndev = gpu_test::device_count_forked(&why);
  if (ndev < 2) {
    std::printf("SKIPPED: test_nccl_backend needs 2 CUDA devices, found %d%s%s\n", ndev,
                why.empty() ? "" : ": ", why.c_str());
    return gpu_test::kSkip;
  }
  int passed = 0, failed = 0;
  for (const char* backend : {"nccl", "nvlink"}) {
    g_backend = backend;
    const int bad = gpu_test::run_ranks(2, ndev, rank_main);
    std::printf("%s backend: %s\n", backend, bad ? "FAILED" : "passed");
    std::fflush(stdout);
    (bad ? failed : passed) += 1;
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
