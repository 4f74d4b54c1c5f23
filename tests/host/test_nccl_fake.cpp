// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The nccl backend's host logic over a fake NCCL (NOTE [nccl seam]), on a machine with no GPU:
// ranks as threads through the communicator, each on its own fake device. What is checked is
// the backend's: the error each NCCL result raises and what its message names, the watchdog's
// timeout and abort, the asynchronous error, abort(), split, batches in one group, the order of
// finalize, and NOTE [nccl backend streams]. Every test also requires that the backend broke
// none of NCCL's rules the fake checks and released every stream, event and buffer.
#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <latch>
#include <set>
#include <thread>

#include "backends/nccl/nccl_backend.hpp"
#include "backends/nccl/nccl_config.hpp"
#include "fake_nccl.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/half.hpp"
#include "fastcomms/core/reduce_op.hpp"
#include "fastcomms/core/wire_fingerprint.hpp"
#include "harness.hpp"

namespace fastcomms {
// Failures print codes and statuses by name.
void PrintTo(ErrorCode c, std::ostream* os) { *os << error_code_name(c); }
void PrintTo(WorkStatus s, std::ostream* os) { *os << work_status_name(s); }
}  // namespace fastcomms

namespace fastcomms::test {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A fake and a backend name whose backends are the nccl backend over it.
struct FakeWorld {
  std::shared_ptr<FakeNccl> fake = std::make_shared<FakeNccl>();
  std::string backend = unique_name("nccl_fake");
  // `lazy`: the backend is nccl-lazy over the fake (NOTE [nccl-lazy]).
  explicit FakeWorld(bool lazy = false) {
    register_backend(backend, [f = fake, lazy](const BackendInit& init) {
      return lazy ? nccl_backend::make_nccl_lazy_backend(init, f)
                  : nccl_backend::make_nccl_backend(init, f);
    });
  }
  // Every communicator is gone: nothing left alive, no rule broken (but the mismatched
  // collectives and sizes a test makes on purpose, where `mismatches` says so).
  void expect_clean(bool mismatches = false) const {
    const auto v = fake->violations();
    for (const auto& what : v)
      if (!mismatches ||
          (what.rfind("mismatched collective", 0) != 0 && what.rfind("ncclSend of ", 0) != 0))
        ADD_FAILURE() << "fake NCCL: " << what;
    const FakeNccl::Live l = fake->live();
    EXPECT_EQ(l.comms, 0) << "communicators neither destroyed nor aborted";
    EXPECT_EQ(l.streams, 0) << "streams not destroyed";
    EXPECT_EQ(l.events, 0) << "events not destroyed";
    EXPECT_EQ(l.buffers, 0) << "device buffers not freed";
    EXPECT_EQ(l.host_buffers, 0) << "pinned host buffers not freed";
  }
};

Device cuda(int r) { return Device{DeviceType::kCUDA, r}; }

// Runs fn(comm, rank) on P ranks as threads (rank r on fake device r), then finalizes and drops
// each communicator. Returns each rank's error ("" where it succeeded).
// `hints`: the communicator's hints on rank r (hints_of(r)), e.g. check_calls.
std::vector<std::string> run_ranks(FakeWorld& w, int P,
                                   const std::function<void(Communicator&, int)>& fn,
                                   std::chrono::milliseconds timeout = 10s,
                                   const std::function<Hints(int)>& hints_of = nullptr) {
  auto store = std::make_shared<MemoryStore>();
  const std::string name = unique_name("fake");
  std::vector<std::string> errors(static_cast<size_t>(P));
  std::vector<std::thread> threads;
  for (int r = 0; r < P; ++r)
    threads.emplace_back([&, r] {
      try {
        CommOptions o;
        o.store = store;
        o.name = name;
        o.timeout = timeout;
        if (hints_of) o.hints = hints_of(r);
        auto comm = Communicator::create(w.backend, r, P, cuda(r), o);
        fn(*comm, r);
        comm->finalize();
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
      EXPECT_EQ(FakeNccl::group_depth(), 0) << "rank " << r << " left a group open";
    });
  for (auto& t : threads) t.join();
  return errors;
}

void expect_ok(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

// A host tensor labelled as device r's.
struct Buf {
  HostTensor t;
  int rank;
  Buf(DType dt, int64_t n, int r) : t(dt, n), rank(r) {}
  TensorView view() {
    TensorView v = t.view();
    v.device = cuda(rank);
    return v;
  }
};

// Polls until the op leaves INPROGRESS (the host never blocks on a CUDA op) or `limit` passes.
WorkStatus settle(const WorkPtr& w, std::chrono::milliseconds limit = 5s) {
  const auto until = Clock::now() + limit;
  while (w->status() == WorkStatus::kInProgress && Clock::now() < until)
    std::this_thread::sleep_for(1ms);
  return w->status();
}

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The error `fn` throws; fails the test where it throws none or another type.
Error thrown(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "no fastcomms::Error thrown";
  return Error(ErrorCode::kInternal, "(none)");
}

CallOptions async_with_timeout(std::chrono::milliseconds t) {
  CallOptions o;
  o.async_op = true;
  o.options.timeout = t;
  return o;
}

// ---- the ops move the bytes (the fake and the backend agree on what each call means) ---------

TEST(NcclFake, CollectivesMoveTheBytes) {
  FakeWorld w;
  const int P = 3;
  expect_ok(run_ranks(w, P, [](Communicator& comm, int r) {
    Buf a(DType::kFloat32, 4, r);
    for (int i = 0; i < 4; ++i) a.t.set(i, r + i);
    EXPECT_EQ(settle(comm.all_reduce(a.view(), ReduceOp::sum())), WorkStatus::kCompleted);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(a.t.get(i), 0 + 1 + 2 + 3 * i) << "all_reduce " << i;

    Buf p(DType::kFloat64, 2, r);
    p.t.set(0, r + 1);
    p.t.set(1, 2 * (r + 1));
    EXPECT_EQ(settle(comm.all_reduce(p.view(), ReduceOp::premul_sum(0.5))), WorkStatus::kCompleted);
    EXPECT_EQ(p.t.get(0), 3.0);  // (1 + 2 + 3) / 2
    EXPECT_EQ(p.t.get(1), 6.0);

    Buf b(DType::kInt64, 3, r);
    for (int i = 0; i < 3; ++i) b.t.set(i, r == 2 ? 40 + i : -1);
    EXPECT_EQ(settle(comm.broadcast(b.view(), 2)), WorkStatus::kCompleted);
    for (int i = 0; i < 3; ++i) EXPECT_EQ(b.t.get(i), 40 + i) << "broadcast " << i;

    Buf in(DType::kInt32, 2, r);
    in.t.set(0, 10 * r);
    in.t.set(1, 10 * r + 1);
    std::vector<Buf> outs;
    for (int q = 0; q < P; ++q) outs.emplace_back(DType::kInt32, 2, r);
    std::vector<TensorView> views;
    for (auto& o : outs) views.push_back(o.view());
    EXPECT_EQ(settle(comm.all_gather(views, in.view())), WorkStatus::kCompleted);
    for (int q = 0; q < P; ++q) {
      EXPECT_EQ(outs[q].t.get(0), 10 * q) << "all_gather from " << q;
      EXPECT_EQ(outs[q].t.get(1), 10 * q + 1) << "all_gather from " << q;
    }
    EXPECT_EQ(settle(comm.barrier()), WorkStatus::kCompleted);
  }));
  w.expect_clean();
}

// NOTE [nccl backend streams]: an op waits for the caller's stream through an event, runs on the
// internal stream, records its completion event there, and a sync op makes the caller's stream
// wait on it; the host never blocks. (The call check's own calls, on by default, are
// CallCheckCostInCalls's.)
TEST(NcclFake, StreamsNote) {
  FakeWorld w;
  auto& fake = *w.fake;
  expect_ok(run_ranks(
      w, 2,
      [&](Communicator& comm, int r) {
        cudaStream_t caller = nullptr;
        ASSERT_EQ(fake.cuda_stream_create_with_priority(&caller, cudaStreamNonBlocking, 0),
                  cudaSuccess);
        const size_t mark = fake.calls().size();
        Buf a(DType::kFloat32, 8, r);
        CallOptions o;
        o.stream = caller;
        auto work = comm.all_reduce(a.view(), ReduceOp::sum(), o);
        std::vector<FakeNccl::Call>
            mine;  // this thread's calls during the op, device switches aside
        const auto all = fake.calls();
        for (size_t i = mark; i < all.size(); ++i)
          if (all[i].thread == std::this_thread::get_id() && all[i].name != "cudaGetDevice" &&
              all[i].name != "cudaSetDevice")
            mine.push_back(all[i]);
        std::vector<std::string> names;
        for (const auto& c : mine) names.push_back(c.name);
        const std::vector<std::string> want = {
            "cudaStreamIsCapturing",    "cudaEventRecord", "cudaStreamWaitEvent", "ncclAllReduce",
            "cudaEventCreateWithFlags", "cudaEventRecord", "cudaStreamWaitEvent"};
        ASSERT_EQ(names, want) << "rank " << r;
        const void* internal = mine[3].stream;
        EXPECT_NE(internal, static_cast<const void*>(caller));
        EXPECT_EQ(mine[0].stream, caller) << "captured calls are told apart first";
        EXPECT_EQ(mine[1].stream, caller) << "ready is recorded on the caller's stream";
        EXPECT_EQ(mine[2].stream, internal) << "the internal stream waits for ready";
        EXPECT_EQ(mine[2].event, mine[1].event);
        EXPECT_EQ(mine[5].stream, internal) << "done is recorded on the internal stream";
        EXPECT_NE(mine[5].event, mine[1].event) << "done is an event of its own";
        EXPECT_EQ(mine[6].stream, caller) << "the caller's stream waits for done (the sync op)";
        EXPECT_EQ(mine[6].event, mine[5].event);
        EXPECT_EQ(settle(work), WorkStatus::kCompleted);
        ASSERT_EQ(fake.cuda_stream_destroy(caller), cudaSuccess);
      },
      10s,
      [](int) {
        return Hints{{"check_calls", "0"}};
      }));
  w.expect_clean();
}

// ---- NOTE [nccl error codes] ------------------------------------------------------------------

TEST(NcclFake, ErrorMapping) {
  struct Case {
    ncclResult_t result;
    const char* name;
    ErrorCode code;
  };
  const Case cases[] = {
      {ncclUnhandledCudaError, "ncclUnhandledCudaError", ErrorCode::kCudaError},
      {ncclSystemError, "ncclSystemError", ErrorCode::kBackendError},
      {ncclInternalError, "ncclInternalError", ErrorCode::kBackendError},
      {ncclInvalidArgument, "ncclInvalidArgument", ErrorCode::kInvalidArgument},
      {ncclInvalidUsage, "ncclInvalidUsage", ErrorCode::kInvalidArgument},
      {ncclRemoteError, "ncclRemoteError", ErrorCode::kBackendError},
      {ncclInProgress, "ncclInProgress", ErrorCode::kInternal},
  };
  FakeWorld w;
  auto& fake = *w.fake;
  fake.set_last_error("fake detail of the last failure");
  std::latch failed_all(2);
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    Buf a(DType::kFloat32, 4, r);
    for (const Case& c : cases) {
      fake.fail("ncclAllReduce", c.result, r);
      const Error e = thrown([&] { comm.all_reduce(a.view(), ReduceOp::sum()); });
      EXPECT_EQ(e.code(), c.code) << c.name << ": " << e.what();
      const std::string msg = e.what();
      const std::string where = "[rank " + std::to_string(r) + "/2 " + comm.name() + " all_reduce]";
      EXPECT_EQ(msg.rfind(where, 0), 0u) << msg;
      EXPECT_NE(msg.find("ncclAllReduce failed"), std::string::npos) << msg;
      EXPECT_NE(msg.find(c.name), std::string::npos) << msg;
      EXPECT_NE(msg.find("fake detail of the last failure"), std::string::npos) << msg;
    }
    failed_all.arrive_and_wait();
    // A refused call leaves the communicator working.
    for (int i = 0; i < 4; ++i) a.t.set(i, 1);
    EXPECT_EQ(settle(comm.all_reduce(a.view(), ReduceOp::sum())), WorkStatus::kCompleted);
    EXPECT_EQ(a.t.get(3), 2.0);
  }));
  w.expect_clean();
}

// A failure inside a group raises that call's error and still closes the group; a failing
// ncclGroupEnd is named as such; nothing was issued outside a group meanwhile.
TEST(NcclFake, ErrorInsideAGroup) {
  FakeWorld w;
  auto& fake = *w.fake;
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    Buf s(DType::kUInt8, 16, r), d(DType::kUInt8, 16, r);
    const std::vector<P2POp> batch = {{P2POp::Kind::kRecv, d.view(), 1 - r},
                                      {P2POp::Kind::kSend, s.view(), 1 - r}};
    fake.fail("ncclSend", ncclRemoteError, r);
    Error e = thrown([&] { comm.batch_p2p(batch); });
    EXPECT_EQ(e.code(), ErrorCode::kBackendError) << e.what();
    EXPECT_EQ(std::string(e.what()).rfind("[rank " + std::to_string(r) + "/2 " + comm.name() +
                                              " batch_op_issue] nccl: ncclSend failed: "
                                              "ncclRemoteError",
                                          0),
              0u)
        << e.what();
    EXPECT_EQ(FakeNccl::group_depth(), 0) << "the group was left open";

    fake.fail("ncclGroupEnd", ncclSystemError, r);
    e = thrown([&] { comm.batch_p2p(batch); });
    EXPECT_EQ(e.code(), ErrorCode::kBackendError) << e.what();
    EXPECT_NE(std::string(e.what()).find("ncclGroupEnd failed: ncclSystemError"), std::string::npos)
        << e.what();
    // The batch goes through afterwards.
    for (int i = 0; i < 16; ++i) s.t.set(i, 10 * r + i);
    EXPECT_EQ(settle(comm.batch_p2p(batch)), WorkStatus::kCompleted);
    for (int i = 0; i < 16; ++i) EXPECT_EQ(d.t.get(i), 10 * (1 - r) + i);
  }));
  for (const auto& c : fake.calls()) {
    if (c.name == "ncclSend" || c.name == "ncclRecv") {
      EXPECT_TRUE(c.in_group) << c.name;
    }
  }
  w.expect_clean();
}

// A communicator that cannot be made says which rank and which call; what it had made is freed.
TEST(NcclFake, InitFailure) {
  FakeWorld w;
  w.fake->fail("ncclCommInitRankConfig", ncclSystemError, 0);
  const auto errors = run_ranks(w, 1, [](Communicator&, int) {});
  EXPECT_NE(errors[0].find("new_comm] nccl: ncclCommInitRankConfig failed: ncclSystemError"),
            std::string::npos)
      << errors[0];
  EXPECT_EQ(errors[0].rfind("[rank 0/1 ", 0), 0u) << errors[0];
  w.expect_clean();
}

// A failing CUDA runtime call is kCudaError naming the op and the call.
TEST(NcclFake, CudaFailure) {
  FakeWorld w;
  w.fake->fail_cuda("cudaStreamWaitEvent", cudaErrorLaunchFailure, 0);
  expect_ok(run_ranks(w, 1, [](Communicator& comm, int r) {
    Buf a(DType::kFloat32, 4, r);
    const Error e = thrown([&] { comm.all_reduce(a.view(), ReduceOp::sum()); });
    EXPECT_EQ(e.code(), ErrorCode::kCudaError) << e.what();
    EXPECT_NE(std::string(e.what()).find(
                  "all_reduce] nccl: cudaStreamWaitEvent failed: cudaErrorLaunchFailure"),
              std::string::npos)
        << e.what();
  }));
  w.expect_clean();
}

// ---- the watchdog ------------------------------------------------------------------------------

// A peer that never calls: the op is TIMEDOUT within its timeout (plus the watchdog's tick), the
// communicator is aborted with ncclCommAbort (not destroyed), and later ops say why.
TEST(NcclFake, StuckOpTimesOut) {
  FakeWorld w;
  auto& fake = *w.fake;
  std::latch rank0_done(2);
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    if (r == 1) {  // alive, never calls
      rank0_done.arrive_and_wait();
      return;
    }
    Buf a(DType::kFloat32, 4, r);
    const auto t0 = Clock::now();
    auto work = comm.all_reduce(a.view(), ReduceOp::sum(), async_with_timeout(300ms));
    EXPECT_EQ(settle(work), WorkStatus::kTimedOut);
    const double took = seconds_since(t0);
    EXPECT_GE(took, 0.3);
    EXPECT_LT(took, 1.0) << "the watchdog took " << took << " s to see a 0.3 s timeout";
    const auto until = Clock::now() + 2s;  // ncclCommAbort follows the mark
    while (fake.count("ncclCommAbort", 0) == 0 && Clock::now() < until)
      std::this_thread::sleep_for(1ms);
    EXPECT_EQ(fake.count("ncclCommAbort", 0), 1);
    Error e = thrown([&] { work->wait(); });
    EXPECT_EQ(e.code(), ErrorCode::kTimeout) << e.what();
    EXPECT_EQ(
        std::string(e.what()).rfind("[rank 0/2 " + comm.name() +
                                        " all_reduce] nccl: "
                                        "timed out after 300 ms; the communicator was aborted",
                                    0),
        0u)
        << e.what();
    e = thrown([&] { comm.broadcast(a.view(), 0); });
    EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    EXPECT_NE(std::string(e.what()).find("broadcast] nccl: the communicator was aborted after "
                                         "all_reduce (op "),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("timed out after 300 ms"), std::string::npos) << e.what();
    rank0_done.arrive_and_wait();
  }));
  EXPECT_EQ(fake.count("ncclCommDestroy", 0), 0) << "an aborted communicator is not destroyed";
  EXPECT_EQ(fake.count("ncclCommDestroy", 1), 1);
  EXPECT_EQ(fake.count("ncclCommAbort", 1), 0);
  w.expect_clean();
}

// An op whose launch the device holds (the peer took part) is stuck all the same.
TEST(NcclFake, HeldOpTimesOut) {
  FakeWorld w;
  auto& fake = *w.fake;
  fake.hold(0);
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    Buf a(DType::kFloat32, 4, r);
    for (int i = 0; i < 4; ++i) a.t.set(i, 1);
    auto work = comm.all_reduce(a.view(), ReduceOp::sum(), async_with_timeout(200ms));
    EXPECT_EQ(settle(work), r == 0 ? WorkStatus::kTimedOut : WorkStatus::kCompleted);
    EXPECT_EQ(a.t.get(0), 2.0) << "the bytes moved; only the completion was held";
  }));
  EXPECT_EQ(fake.count("ncclCommAbort", 0), 1);
  EXPECT_EQ(fake.count("ncclCommAbort", 1), 0);
  w.expect_clean();
}

// NOTE [nccl async errors]: an error NCCL reports outside any call ends the ops in flight with
// that error (its code per NOTE [nccl error codes]) and aborts the communicator; with nothing in
// flight, the next op says why the communicator is gone.
TEST(NcclFake, AsyncError) {
  FakeWorld w;
  auto& fake = *w.fake;
  std::latch both_checked(2);
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    Buf a(DType::kFloat32, 4, r);
    if (r == 0) {  // an op in flight (rank 1 never joins it)
      auto work = comm.all_reduce(a.view(), ReduceOp::sum(), async_with_timeout(60s));
      std::this_thread::sleep_for(100ms);
      EXPECT_EQ(work->status(), WorkStatus::kInProgress);
      const auto t0 = Clock::now();
      fake.set_async_error(0, ncclRemoteError);
      EXPECT_EQ(settle(work), WorkStatus::kError);
      EXPECT_LT(seconds_since(t0), 1.0);
      const Error e = thrown([&] { work->wait(); });
      EXPECT_EQ(e.code(), ErrorCode::kBackendError) << e.what();
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("[rank 0/2 " + comm.name() +
                              " all_reduce] nccl: the communicator "
                              "failed while this op was in flight (ncclCommGetAsyncError reported "
                              "ncclRemoteError",
                          0),
                0u)
          << msg;
    } else {  // nothing in flight
      fake.set_async_error(1, ncclUnhandledCudaError);
      const auto until = Clock::now() + 2s;
      while (fake.count("ncclCommAbort", 1) == 0 && Clock::now() < until)
        std::this_thread::sleep_for(1ms);
    }
    const auto until = Clock::now() + 2s;
    while (fake.count("ncclCommAbort", r) == 0 && Clock::now() < until)
      std::this_thread::sleep_for(1ms);
    EXPECT_EQ(fake.count("ncclCommAbort", r), 1) << "rank " << r;
    const Error e = thrown([&] { comm.all_reduce(a.view(), ReduceOp::sum()); });
    EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    EXPECT_NE(std::string(e.what()).find(
                  "the communicator was aborted after "
                  "ncclCommGetAsyncError reported " +
                  std::string(r == 0 ? "ncclRemoteError" : "ncclUnhandledCudaError")),
              std::string::npos)
        << e.what();
    both_checked.arrive_and_wait();
  }));
  EXPECT_EQ(fake.count("ncclCommDestroy"), 0);
  w.expect_clean();
}

// ---- abort ------------------------------------------------------------------------------------

TEST(NcclFake, AbortEndsOpsInFlight) {
  FakeWorld w;
  auto& fake = *w.fake;
  std::latch rank0_done(2);
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    if (r == 1) {
      rank0_done.arrive_and_wait();
      return;
    }
    Buf a(DType::kFloat32, 4, r);
    auto work = comm.all_reduce(a.view(), ReduceOp::sum(), async_with_timeout(60s));
    EXPECT_EQ(work->status(), WorkStatus::kInProgress);
    std::thread([&] { comm.abort(); }).join();  // from another thread
    EXPECT_EQ(work->status(), WorkStatus::kError);
    const Error e = thrown([&] { work->wait(); });
    EXPECT_EQ(e.code(), ErrorCode::kAborted) << e.what();
    EXPECT_NE(std::string(e.what()).find("all_reduce] nccl: the communicator was aborted"),
              std::string::npos)
        << e.what();
    comm.abort();  // again: nothing more
    comm.backend().abort();
    EXPECT_EQ(fake.count("ncclCommAbort", 0), 1);
    rank0_done.arrive_and_wait();
  }));
  EXPECT_EQ(fake.count("ncclCommDestroy", 0), 0);
  EXPECT_EQ(fake.count("ncclCommDestroy", 1), 1);
  w.expect_clean();
}

// ---- split ------------------------------------------------------------------------------------

// Every rank of the parent calls ncclCommSplit (non-members with NCCL_SPLIT_NOCOLOR); a group's
// members share a colour that no other group has, and the key orders them as the caller's list.
TEST(NcclFake, Split) {
  for (const int P : {4, 3}) {
    FakeWorld w;
    auto& fake = *w.fake;
    // P = 4: {3, 1} and {0, 2}; P = 3: {2, 0}, rank 1 in none.
    const auto group_of = [P](int r) -> std::vector<int> {
      if (P == 4) return r % 2 ? std::vector<int>{3, 1} : std::vector<int>{0, 2};
      return r == 1 ? std::vector<int>{} : std::vector<int>{2, 0};
    };
    expect_ok(run_ranks(w, P, [&](Communicator& comm, int r) {
      const std::vector<int> g = group_of(r);
      auto sub = comm.split(g, "");
      if (g.empty()) {
        EXPECT_EQ(sub, nullptr);
        return;
      }
      ASSERT_NE(sub, nullptr);
      const int new_rank = static_cast<int>(std::find(g.begin(), g.end(), r) - g.begin());
      EXPECT_EQ(sub->rank(), new_rank);
      Buf a(DType::kInt64, 1, r);
      a.t.set(0, r + 1);
      EXPECT_EQ(settle(sub->all_reduce(a.view(), ReduceOp::sum())), WorkStatus::kCompleted);
      EXPECT_EQ(a.t.get(0), g[0] + 1 + g[1] + 1) << "rank " << r << " in its group's sum";
      sub->finalize();
    }));
    const auto splits = fake.splits();
    ASSERT_EQ(splits.size(), static_cast<size_t>(P)) << "every rank of the parent splits";
    std::map<int, int> color_of;
    for (const auto& s : splits) {
      const std::vector<int> g = group_of(s.parent_rank);
      EXPECT_EQ(s.parent_size, P);
      if (g.empty()) {
        EXPECT_EQ(s.color, NCCL_SPLIT_NOCOLOR) << "rank " << s.parent_rank;
        EXPECT_EQ(s.new_rank, -1);
        continue;
      }
      const int pos = static_cast<int>(std::find(g.begin(), g.end(), s.parent_rank) - g.begin());
      EXPECT_GE(s.color, 0);
      EXPECT_EQ(s.key, pos) << "rank " << s.parent_rank;
      EXPECT_EQ(s.new_rank, pos) << "rank " << s.parent_rank;
      EXPECT_EQ(s.new_size, static_cast<int>(g.size()));
      color_of[s.parent_rank] = s.color;
    }
    for (const auto& [a, ca] : color_of)
      for (const auto& [b, cb] : color_of)
        EXPECT_EQ(ca == cb, group_of(a) == group_of(b)) << "ranks " << a << " and " << b;
    w.expect_clean();
  }
}

// ---- group calls --------------------------------------------------------------------------------

// A batch (and send, recv, all_to_all) is one group: each thread's sends and receives come
// between one ncclGroupStart and its ncclGroupEnd, in the batch's order, none outside.
TEST(NcclFake, BatchP2PIsOneGroup) {
  FakeWorld w;
  auto& fake = *w.fake;
  const int P = 3;
  expect_ok(run_ranks(w, P, [&](Communicator& comm, int r) {
    const int next = (r + 1) % P, prev = (r + P - 1) % P;
    Buf s(DType::kInt32, 5, r), d(DType::kInt32, 5, r);
    for (int i = 0; i < 5; ++i) s.t.set(i, 100 * r + i);
    const size_t mark = fake.calls().size();
    auto work = comm.batch_p2p(
        {{P2POp::Kind::kSend, s.view(), next}, {P2POp::Kind::kRecv, d.view(), prev}});
    std::vector<std::string> names;
    const auto all = fake.calls();
    for (size_t i = mark; i < all.size(); ++i)
      if (all[i].thread == std::this_thread::get_id() && all[i].name.rfind("nccl", 0) == 0)
        names.push_back(all[i].name);
    EXPECT_EQ(names,
              (std::vector<std::string>{"ncclGroupStart", "ncclSend", "ncclRecv", "ncclGroupEnd"}))
        << "rank " << r;
    EXPECT_EQ(settle(work), WorkStatus::kCompleted);
    for (int i = 0; i < 5; ++i) EXPECT_EQ(d.t.get(i), 100 * prev + i);

    // send / recv alone, and all_to_all.
    if (r == 0) {
      EXPECT_EQ(settle(comm.send(s.view(), 1)), WorkStatus::kCompleted);
    }
    if (r == 1) {
      EXPECT_EQ(settle(comm.recv(d.view(), 0)), WorkStatus::kCompleted);
      EXPECT_EQ(d.t.get(4), 4);
    }
    std::vector<Buf> ins, outs;
    for (int q = 0; q < P; ++q) {
      ins.emplace_back(DType::kInt32, 1, r);
      ins.back().t.set(0, 10 * r + q);
      outs.emplace_back(DType::kInt32, 1, r);
    }
    std::vector<TensorView> iv, ov;
    for (int q = 0; q < P; ++q) {
      iv.push_back(ins[q].view());
      ov.push_back(outs[q].view());
    }
    EXPECT_EQ(settle(comm.all_to_all(ov, iv)), WorkStatus::kCompleted);
    for (int q = 0; q < P; ++q) EXPECT_EQ(outs[q].t.get(0), 10 * q + r) << "from " << q;
  }));
  int p2p = 0;
  for (const auto& c : fake.calls())
    if (c.name == "ncclSend" || c.name == "ncclRecv") {
      ++p2p;
      EXPECT_TRUE(c.in_group) << c.name << " on device " << c.device << " outside a group";
    }
  EXPECT_EQ(p2p, 3 * 2 + 2 + 3 * 2 * P);
  w.expect_clean();
}

// ---- finalize -----------------------------------------------------------------------------------

// finalize() waits for the internal stream, drops the registrations left, and the communicator
// is destroyed once, after the watchdog stopped (no call on it after ncclCommDestroy), never
// aborted; nothing is left alive.
TEST(NcclFake, FinalizeOrder) {
  FakeWorld w;
  auto& fake = *w.fake;
  fake.hold(0);
  std::atomic<bool> released{false};
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    Buf reg(DType::kFloat32, 8, r), a(DType::kFloat32, 4, r);
    comm.tensor_register(reg.view());
    auto work = comm.all_reduce(a.view(), ReduceOp::sum(), async_with_timeout(10s));
    if (r == 0) {
      std::thread([&] {
        std::this_thread::sleep_for(300ms);
        released = true;
        fake.release(0);
      }).detach();
      const auto t0 = Clock::now();
      comm.finalize();  // the held launch must complete first
      EXPECT_TRUE(released.load()) << "finalize returned before the op in flight completed";
      EXPECT_GE(seconds_since(t0), 0.25);
      EXPECT_EQ(work->status(), WorkStatus::kCompleted);
    } else {
      EXPECT_EQ(settle(work), WorkStatus::kCompleted);
    }
  }));
  for (int dev = 0; dev < 2; ++dev) {
    std::vector<std::string> order;
    const void* comm = nullptr;
    for (const auto& c : fake.calls(dev)) {
      if (c.name == "ncclCommInitRankConfig") continue;
      if (c.name == "ncclCommRegister") comm = c.comm;
      if (c.name == "cudaStreamSynchronize" || c.name == "ncclCommDeregister" ||
          c.name == "ncclCommDestroy" || c.name == "ncclCommAbort")
        order.push_back(c.name);
    }
    ASSERT_NE(comm, nullptr);
    // The first synchronize is the set-up's (its own stream); then finalize's.
    EXPECT_EQ(order, (std::vector<std::string>{"cudaStreamSynchronize", "cudaStreamSynchronize",
                                               "ncclCommDeregister", "ncclCommDestroy"}))
        << "device " << dev;
  }
  w.expect_clean();
}

// ---- NOTE [wire fingerprint] ------------------------------------------------------------------

CallFingerprint call(OpKind op, DType dt, int64_t count, int root = -1,
                     const ReduceOp* r = nullptr) {
  CallFingerprint f;
  f.op = static_cast<int32_t>(op);
  f.dtype = static_cast<int32_t>(dt);
  f.count = count;
  f.root = root;
  if (r != nullptr) {
    f.reduce = static_cast<int32_t>(r->type);
    if (r->type == RedOpType::kPremulSum) std::memcpy(&f.factor_bits, &r->factor, 8);
  }
  return f;
}

TEST(WireFingerprint, InWordsAndCompared) {
  const ReduceOp sum = ReduceOp::sum(), premul = ReduceOp::premul_sum(0.5);
  const CallFingerprint ar = call(OpKind::kAllReduce, DType::kFloat32, 1024, -1, &sum);
  EXPECT_EQ(describe(encode_wire(ar, {}, {}, 3, 0, 2).wire),
            "all_reduce(SUM, 1024 x float32) as collective #3");
  EXPECT_EQ(
      describe(encode_wire(call(OpKind::kBroadcast, DType::kInt64, 8, 2), {}, {}, 1, 0, 4).wire),
      "broadcast(root 2, 8 x int64) as collective #1");
  EXPECT_EQ(describe(encode_wire(CallFingerprint{.op = static_cast<int32_t>(OpKind::kBarrier)}, {},
                                 {}, 9, 0, 2)
                         .wire),
            "barrier() as collective #9");
  const std::string p = describe(
      encode_wire(call(OpKind::kAllReduce, DType::kFloat64, 4, -1, &premul), {}, {}, 1, 0, 2).wire);
  EXPECT_EQ(p.rfind("all_reduce(PREMUL_SUM, float64, count, factor and call key digest ", 0), 0u)
      << p;
  // Bits that are no call still read as words.
  EXPECT_EQ(describe(WireFingerprint{~uint64_t{0}, 7}),
            "op 63(reduction 14, root 4194302, dtype 62, body kind 3 0000000000000007) as "
            "collective #16777215");

  // Three ranks: the same call agrees; one rank's other dtype names both calls, ranks grouped.
  std::vector<WireFingerprint> all;
  std::vector<WireCall> calls;
  for (int r = 0; r < 3; ++r) {
    calls.push_back(
        encode_wire(call(OpKind::kAllReduce, r == 1 ? DType::kInt32 : DType::kFloat32, 4, -1, &sum),
                    {}, {}, 1, r, 3));
    all.push_back(calls.back().wire);
  }
  for (int r = 0; r < 3; ++r)
    EXPECT_EQ(wire_mismatch(all.data(), 3, calls[r]),
              "ranks issued different collectives: ranks 0, 2 called all_reduce(SUM, 4 x float32) "
              "as collective #1; rank 1 called all_reduce(SUM, 4 x int32) as collective #1");
  all[1] = all[0];
  EXPECT_EQ(wire_mismatch(all.data(), 3, calls[0]), "");
  // Another sequence number: the ranks' collectives are out of step.
  all[2] = encode_wire(ar, {}, {}, 2, 2, 3).wire;
  all[0] = all[1] = encode_wire(ar, {}, {}, 1, 0, 3).wire;
  EXPECT_NE(wire_mismatch(all.data(), 3, calls[0])
                .find("rank 2 called all_reduce(SUM, 1024 x "
                      "float32) as collective #2"),
            std::string::npos);
  // Another PREMUL_SUM factor: the digests differ.
  const ReduceOp other = ReduceOp::premul_sum(0.25);
  all[0] = all[1] =
      encode_wire(call(OpKind::kAllReduce, DType::kFloat32, 4, -1, &premul), {}, {}, 1, 0, 3).wire;
  all[2] =
      encode_wire(call(OpKind::kAllReduce, DType::kFloat32, 4, -1, &other), {}, {}, 1, 2, 3).wire;
  EXPECT_NE(wire_mismatch(all.data(), 3, calls[0]), "");
}

// The sizes per peer of the _v forms: each rank's 16 bytes add up to what every rank expects
// exactly when every rank expects from each peer what that peer sends it.
TEST(WireFingerprint, SizesPerPeerPairUp) {
  const int P = 3;
  std::vector<std::vector<int64_t>> bytes = {{4, 8, 12}, {16, 0, 4}, {8, 8, 0}};  // [from][to]
  const auto encode = [&](int r, const std::vector<std::vector<int64_t>>& expect) {
    std::vector<int64_t> out(P), in(P);
    for (int q = 0; q < P; ++q) {
      out[q] = bytes[r][q];
      in[q] = expect[q][r];
    }
    return encode_wire(call(OpKind::kAllToAllVSingle, DType::kFloat32, -1), out, in, 5, r, P);
  };
  const auto compare = [&](const std::vector<std::vector<int64_t>>& expect) {
    std::vector<WireCall> calls;
    std::vector<WireFingerprint> all;
    for (int r = 0; r < P; ++r) {
      calls.push_back(encode(r, expect));
      all.push_back(calls.back().wire);
    }
    std::vector<std::string> found;
    for (int r = 0; r < P; ++r) found.push_back(wire_mismatch(all.data(), P, calls[r]));
    return found;
  };
  for (const auto& m : compare(bytes)) EXPECT_EQ(m, "");
  auto wrong = bytes;
  wrong[0][2] += 4;  // rank 2 expects 4 bytes more from rank 0 than rank 0 sends it
  for (const auto& m : compare(wrong))
    EXPECT_EQ(m.rfind("ranks disagree on the sizes per peer of all_to_all_v_single(float32, sizes "
                      "per peer, pairing term ",
                      0),
              0u)
        << m;
  wrong = bytes;
  std::swap(wrong[1][0], wrong[2][0]);  // rank 0 expects the same total, from the wrong peers
  for (const auto& m : compare(wrong)) EXPECT_NE(m, "");
}

// ---- NOTE [nccl call check] ------------------------------------------------------------------

Hints check_hints(const std::string& mode, const std::string& fuse = "0",
                  const std::string& memory = "device") {
  return Hints{
      {"check_calls", mode}, {"nccl.check_calls_fuse", fuse}, {"nccl.check_calls_memory", memory}};
}

// One class of mismatch: rank `last` issues `theirs`, every other rank `ours`.
struct Mismatch {
  const char* name;
  std::string ours, theirs;  // each call in words, as the message names it
  std::function<WorkPtr(Communicator&, int r, bool differs, Buf& a)> issue;
};

std::vector<Mismatch> mismatches() {
  return {
      {"dtype (same bytes)", "all_reduce(SUM, 4 x float32)", "all_reduce(SUM, 4 x int32)",
       [](Communicator& c, int r, bool differs, Buf& a) {
         Buf x(differs ? DType::kInt32 : DType::kFloat32, 4, r);
         a = std::move(x);
         return c.all_reduce(a.view(), ReduceOp::sum());
       }},
      {"reduce op", "all_reduce(SUM, 4 x float32)", "all_reduce(MAX, 4 x float32)",
       [](Communicator& c, int, bool differs, Buf& a) {
         return c.all_reduce(a.view(), differs ? ReduceOp::max() : ReduceOp::sum());
       }},
      {"root", "broadcast(root 0, 4 x float32)", "broadcast(root 1, 4 x float32)",
       [](Communicator& c, int, bool differs, Buf& a) { return c.broadcast(a.view(), differs); }},
      // NCCL hangs on these two (the fake too): the fingerprints still land, before the op.
      {"op kind", "all_reduce(SUM, 4 x float32)", "broadcast(root 0, 4 x float32)",
       [](Communicator& c, int, bool differs, Buf& a) {
         return differs ? c.broadcast(a.view(), 0) : c.all_reduce(a.view(), ReduceOp::sum());
       }},
      {"count", "all_reduce(SUM, 4 x float32)", "all_reduce(SUM, 5 x float32)",
       [](Communicator& c, int r, bool differs, Buf& a) {
         if (differs) a = Buf(DType::kFloat32, 5, r);
         return c.all_reduce(a.view(), ReduceOp::sum());
       }},
  };
}

// The default check: every rank raises ValueError at the mismatched collective, naming each
// rank's call and its own, well within the timeout (also where NCCL hangs), and every later
// call raises it; the communicator is aborted. Worlds 2 and 3, every placement.
TEST(NcclFake, CallCheckRaisesOnEveryRank) {
  const std::vector<std::array<const char*, 2>> placements = {
      {"0", "device"}, {"1", "device"}, {"0", "host"}, {"1", "host"}};
  for (const auto& [fuse, memory] : placements) {
    for (const int P : {2, 3}) {
      for (const Mismatch& m : mismatches()) {
        SCOPED_TRACE(detail::cat(m.name, ", world ", P, ", fuse ", fuse, ", memory ", memory));
        FakeWorld w;
        auto& fake = *w.fake;
        const bool hangs = std::string(m.name) == "op kind" || std::string(m.name) == "count";
        const bool timeout = hangs && std::string(fuse) == "1";
        expect_ok(run_ranks(
            w, P,
            [&](Communicator& comm, int r) {
              Buf a(DType::kFloat32, 4, r);
              for (int i = 0; i < 4; ++i) a.t.set(i, r + 1);
              const auto t0 = Clock::now();
              // A sync op: it raises where the fingerprints landed before its wait() (the
              // watchdog may compare them at once), else its work fails once they land.
              const Error e = thrown([&] {
                const WorkPtr work = m.issue(comm, r, r == P - 1, a);
                // Fused placements find a hung op's mismatch only at its timeout (1 s here).
                EXPECT_EQ(settle(work), timeout ? WorkStatus::kTimedOut : WorkStatus::kError);
                work->wait();
              });
              EXPECT_LT(seconds_since(t0), timeout ? 4.0 : 3.0);
              const std::string msg = e.what();
              if (timeout) {
                EXPECT_EQ(e.code(), ErrorCode::kTimeout) << msg;
                return;
              }
              EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << msg;
              const std::string ours = P == 2 ? "rank 0" : "ranks 0, 1";
              EXPECT_NE(msg.find("nccl: ranks issued different collectives: " + ours + " called " +
                                 m.ours + " as collective #1; rank " + std::to_string(P - 1) +
                                 " called " + m.theirs + " as collective #1 (this rank called " +
                                 (r == P - 1 ? m.theirs : m.ours) + ")"),
                        std::string::npos)
                  << msg;
              EXPECT_NE(msg.find("FASTCOMMS_CHECK_CALLS=strict"), std::string::npos) << msg;
              // Every later call raises it; the communicator was aborted (a hang ended).
              Buf b(DType::kFloat32, 4, r);
              const Error later = thrown([&] { comm.all_reduce(b.view(), ReduceOp::sum()); });
              EXPECT_EQ(later.code(), ErrorCode::kInvalidArgument) << later.what();
              EXPECT_NE(std::string(later.what())
                            .find("all_reduce] nccl: the communicator was aborted after a "
                                  "mismatched collective: ranks issued different collectives"),
                        std::string::npos)
                  << later.what();
              const auto until = Clock::now() + 2s;
              while (fake.count("ncclCommAbort", r) == 0 && Clock::now() < until)
                std::this_thread::sleep_for(1ms);
              EXPECT_EQ(fake.count("ncclCommAbort", r), 1);
            },
            timeout ? 1s : 10s, [&](int) { return check_hints("1", fuse, memory); }));
        EXPECT_EQ(fake.count("ncclCommDestroy"), 0) << "every communicator was aborted";
        w.expect_clean(/*mismatches=*/true);
      }
    }
  }
}

// The sizes per peer of all_to_all_v_single: the last rank sends rank 0 one row more than rank 0
// expects (and itself one less).
TEST(NcclFake, CallCheckComparesSizesPerPeer) {
  for (const int P : {2, 3}) {
    FakeWorld w;
    expect_ok(run_ranks(
        w, P,
        [&](Communicator& comm, int r) {
          Buf in(DType::kFloat32, P, r), out(DType::kFloat32, P, r);
          std::vector<int64_t> in_splits(P, 1), out_splits(P, 1);
          if (r == P - 1) {
            in_splits[0] = 2;
            in_splits[P - 1] = 0;
          }
          const Error e = thrown([&] {  // at the call, or once its fingerprints land
            const WorkPtr work =
                comm.all_to_all_v_single(out.view(), in.view(), out_splits, in_splits, {});
            EXPECT_EQ(settle(work), WorkStatus::kError);
            work->wait();
          });
          EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
          EXPECT_NE(std::string(e.what()).find("nccl: ranks disagree on the sizes per peer of "
                                               "all_to_all_v_single(float32, sizes per peer"),
                    std::string::npos)
              << e.what();
        },
        10s, [&](int) { return check_hints("1"); }));
    EXPECT_FALSE(w.fake->violations().empty()) << "NCCL saw the sizes that differ";
    w.expect_clean(/*mismatches=*/true);
  }
}

// The armed control: with FASTCOMMS_CHECK_CALLS=0 the same mismatches whose byte counts agree go
// through without an error on any rank, with wrong data; no fingerprint is exchanged.
TEST(NcclFake, CallCheckOffLetsMismatchesThroughWithWrongData) {
  for (const int P : {2, 3}) {
    SCOPED_TRACE(detail::cat("world ", P));
    FakeWorld w;
    expect_ok(run_ranks(
        w, P,
        [&](Communicator& comm, int r) {
          const bool last = r == P - 1;
          // SUM on every rank but the last, MAX there: the ranks end with different "sums".
          Buf a(DType::kFloat32, 4, r);
          for (int i = 0; i < 4; ++i) a.t.set(i, r + 1);
          EXPECT_EQ(settle(comm.all_reduce(a.view(), last ? ReduceOp::max() : ReduceOp::sum())),
                    WorkStatus::kCompleted);
          EXPECT_EQ(a.t.get(0), last ? P : P * (P + 1) / 2) << "rank " << r;
          // float32 1.0 everywhere but int32 1 on the last rank: the last rank adds float bits.
          Buf b(last ? DType::kInt32 : DType::kFloat32, 4, r);
          for (int i = 0; i < 4; ++i) b.t.set(i, 1);
          EXPECT_EQ(settle(comm.all_reduce(b.view(), ReduceOp::sum())), WorkStatus::kCompleted);
          if (last) {
            EXPECT_EQ(b.t.get(0), 1065353216.0 * (P - 1) + 1);
          } else {
            EXPECT_NE(b.t.get(0), P) << "rank " << r << " summed right";
          }
          // The last rank names itself the root: it keeps its own bytes, not rank 0's.
          Buf c(DType::kFloat32, 4, r);
          for (int i = 0; i < 4; ++i) c.t.set(i, 10 * r + i);
          EXPECT_EQ(settle(comm.broadcast(c.view(), last ? P - 1 : 0)), WorkStatus::kCompleted);
          EXPECT_EQ(c.t.get(1), last ? 10 * (P - 1) + 1 : 1) << "rank " << r;
        },
        10s, [&](int) { return check_hints("0"); }));
    EXPECT_EQ(w.fake->count("ncclAllGather"), 0) << "no fingerprint was exchanged";
    EXPECT_FALSE(w.fake->violations().empty()) << "NCCL saw the mismatched collectives";
    w.expect_clean(/*mismatches=*/true);
  }
}

// Matched calls of every collective go through with the check on, in every placement, with
// the right data; one all-gather more per collective, none per point-to-point op.
TEST(NcclFake, CallCheckPassesMatchedCalls) {
  const std::vector<Hints> settings = {
      check_hints("0"), check_hints("1"), check_hints("1", "1", "device"),
      check_hints("1", "0", "host"), check_hints("1", "1", "host")};
  const int P = 3;
  std::vector<int> gathers;
  for (const Hints& h : settings) {
    SCOPED_TRACE(detail::cat("fuse ", h.at("nccl.check_calls_fuse"), ", memory ",
                             h.at("nccl.check_calls_memory"), ", check ", h.at("check_calls")));
    FakeWorld w;
    expect_ok(run_ranks(
        w, P,
        [&](Communicator& comm, int r) {
          Buf a(DType::kFloat32, 4, r);
          for (int i = 0; i < 4; ++i) a.t.set(i, r + i);
          EXPECT_EQ(settle(comm.all_reduce(a.view(), ReduceOp::sum())), WorkStatus::kCompleted);
          EXPECT_EQ(a.t.get(1), 0 + 1 + 2 + 3);
          Buf p(DType::kFloat64, 1, r);
          p.t.set(0, r + 1);
          EXPECT_EQ(settle(comm.all_reduce(p.view(), ReduceOp::premul_sum(0.5))),
                    WorkStatus::kCompleted);
          EXPECT_EQ(p.t.get(0), 3.0);
          Buf b(DType::kInt64, 2, r);
          b.t.set(0, r == 2 ? 42 : 0);
          EXPECT_EQ(settle(comm.broadcast(b.view(), 2)), WorkStatus::kCompleted);
          EXPECT_EQ(b.t.get(0), 42);
          Buf red(DType::kInt32, 1, r);
          red.t.set(0, r + 1);
          EXPECT_EQ(settle(comm.reduce(red.view(), 1, ReduceOp::max())), WorkStatus::kCompleted);
          if (r == 1) {
            EXPECT_EQ(red.t.get(0), 3);
          }
          Buf gi(DType::kInt32, 1, r), go(DType::kInt32, P, r);
          gi.t.set(0, 7 * r);
          EXPECT_EQ(settle(comm.all_gather_single(go.view(), gi.view())), WorkStatus::kCompleted);
          EXPECT_EQ(go.t.get(2), 14);
          Buf ri(DType::kFloat32, P, r), ro(DType::kFloat32, 1, r);
          for (int q = 0; q < P; ++q) ri.t.set(q, q);
          EXPECT_EQ(settle(comm.reduce_scatter_single(ro.view(), ri.view(), ReduceOp::sum())),
                    WorkStatus::kCompleted);
          EXPECT_EQ(ro.t.get(0), 3.0 * r);
          // Uneven all_to_all_v_single: rank r sends q + 1 rows to rank q.
          std::vector<int64_t> in_s(P), out_s(P, r + 1);
          int64_t rows = 0;
          for (int q = 0; q < P; ++q) rows += in_s[q] = q + 1;
          Buf ai(DType::kInt32, rows, r), ao(DType::kInt32, P * (r + 1), r);
          for (int64_t i = 0; i < rows; ++i) ai.t.set(i, 100 * r + i);
          EXPECT_EQ(settle(comm.all_to_all_v_single(ao.view(), ai.view(), out_s, in_s, {})),
                    WorkStatus::kCompleted);
          EXPECT_EQ(ao.t.get(r + 1), 100 * 1 + (r * (r + 1)) / 2);  // rank 1's first row for r
          // all_gather_v: rank q contributes q + 1 elements.
          Buf vi(DType::kInt32, r + 1, r);
          for (int i = 0; i <= r; ++i) vi.t.set(i, r);
          std::vector<Buf> vo;
          std::vector<TensorView> vov;
          for (int q = 0; q < P; ++q) vo.emplace_back(DType::kInt32, q + 1, r);
          for (auto& o : vo) vov.push_back(o.view());
          EXPECT_EQ(settle(comm.all_gather_v(vov, vi.view())), WorkStatus::kCompleted);
          EXPECT_EQ(vo[2].t.get(2), 2);
          EXPECT_EQ(settle(comm.barrier()), WorkStatus::kCompleted);
          // Point-to-point ops are not collectives: no fingerprint.
          Buf s(DType::kInt32, 1, r), d(DType::kInt32, 1, r);
          s.t.set(0, r);
          EXPECT_EQ(settle(comm.batch_p2p({{P2POp::Kind::kSend, s.view(), (r + 1) % P},
                                           {P2POp::Kind::kRecv, d.view(), (r + P - 1) % P}})),
                    WorkStatus::kCompleted);
          EXPECT_EQ(d.t.get(0), (r + P - 1) % P);
        },
        10s, [&](int) { return h; }));
    gathers.push_back(w.fake->count("ncclAllGather", 0));
    w.expect_clean();
  }
  // 9 collectives, one of them an all-gather itself.
  EXPECT_EQ(gathers[0], 1);
  for (size_t i = 1; i < gathers.size(); ++i) EXPECT_EQ(gathers[i], 1 + 9) << "setting " << i;
}

// What the check costs in calls on the issuing thread, per all_reduce (event queries and the
// device and capture-mode switches around them aside): off, the default, and the hints'
// placements. Nothing blocks: no synchronize, no host copy.
TEST(NcclFake, CallCheckCostInCalls) {
  struct Setting {
    Hints hints;
    std::vector<std::string> calls;
  };
  const std::vector<std::string> head = {"cudaStreamIsCapturing", "cudaEventRecord",
                                         "cudaStreamWaitEvent"};
  const std::vector<std::string> tail = {"cudaEventCreateWithFlags", "cudaEventRecord",
                                         "cudaStreamWaitEvent"};
  const auto with = [&](std::vector<std::string> middle) {
    std::vector<std::string> v = head;
    v.insert(v.end(), middle.begin(), middle.end());
    v.insert(v.end(), tail.begin(), tail.end());
    return v;
  };
  const std::vector<Setting> settings = {
      {check_hints("0"), with({"ncclAllReduce"})},
      {check_hints("1"),
       with({"cudaMemcpyAsync", "ncclAllGather", "cudaEventRecord", "cudaStreamWaitEvent",
             "cudaMemcpyAsync", "cudaEventRecord", "ncclAllReduce", "cudaStreamWaitEvent"})},
      {check_hints("1", "1", "device"),
       with({"cudaMemcpyAsync", "ncclGroupStart", "ncclAllGather", "ncclAllReduce", "ncclGroupEnd",
             "cudaMemcpyAsync", "cudaEventRecord"})},
      {check_hints("1", "0", "host"), with({"ncclAllGather", "cudaEventRecord", "ncclAllReduce"})},
      {check_hints("1", "1", "host"), with({"ncclGroupStart", "ncclAllGather", "ncclAllReduce",
                                            "ncclGroupEnd", "cudaEventRecord"})},
  };
  for (const Setting& setting : settings) {
    SCOPED_TRACE(detail::cat("check ", setting.hints.at("check_calls"), ", fuse ",
                             setting.hints.at("nccl.check_calls_fuse"), ", memory ",
                             setting.hints.at("nccl.check_calls_memory")));
    FakeWorld w;
    auto& fake = *w.fake;
    const bool on = setting.hints.at("check_calls") == "1";
    expect_ok(run_ranks(
        w, 2,
        [&](Communicator& comm, int r) {
          Buf a(DType::kFloat32, 8, r);
          EXPECT_EQ(settle(comm.all_reduce(a.view(), ReduceOp::sum())), WorkStatus::kCompleted);
          const size_t mark = fake.calls().size();  // after the first call made the slots
          const WorkPtr work = comm.all_reduce(a.view(), ReduceOp::sum());
          std::vector<FakeNccl::Call> mine;
          const auto all = fake.calls();
          for (size_t i = mark; i < all.size(); ++i)
            if (all[i].thread == std::this_thread::get_id() && all[i].name != "cudaGetDevice" &&
                all[i].name != "cudaSetDevice" && all[i].name != "cudaEventQuery" &&
                all[i].name != "cudaThreadExchangeStreamCaptureMode")
              mine.push_back(all[i]);
          std::vector<std::string> names;
          for (const auto& c : mine) names.push_back(c.name);
          EXPECT_EQ(names, setting.calls) << "rank " << r;
          // The exchange goes out on the op's stream, just before it.
          const void* op_stream = nullptr;
          for (const auto& c : mine)
            if (c.name == "ncclAllReduce") op_stream = c.stream;
          for (const auto& c : mine)
            if (c.name == "ncclAllGather") {
              EXPECT_EQ(c.stream, op_stream);
            }
          EXPECT_EQ(settle(work), WorkStatus::kCompleted);
          // Eight more: one all-gather each with the check, none without; point-to-point and
          // calls whose hint turns the check off exchange nothing.
          const int before = fake.count("ncclAllGather", r);
          for (int i = 0; i < 8; ++i)
            EXPECT_EQ(settle(comm.all_reduce(a.view(), ReduceOp::sum())), WorkStatus::kCompleted);
          EXPECT_EQ(fake.count("ncclAllGather", r) - before, on ? 8 : 0);
          CallOptions off;
          off.options.hints["check_calls"] = "0";
          EXPECT_EQ(settle(comm.all_reduce(a.view(), ReduceOp::sum(), off)),
                    WorkStatus::kCompleted);
          Buf d(DType::kFloat32, 8, r);
          EXPECT_EQ(settle(comm.batch_p2p({{P2POp::Kind::kSend, a.view(), 1 - r},
                                           {P2POp::Kind::kRecv, d.view(), 1 - r}})),
                    WorkStatus::kCompleted);
          EXPECT_EQ(fake.count("ncclAllGather", r) - before, on ? 8 : 0);
        },
        10s, [&](int) { return setting.hints; }));
    EXPECT_EQ(fake.count("cudaStreamSynchronize"), 2 * 2) << "set-up's and finalize's only";
    w.expect_clean();
  }
}

// A mismatch nothing raised before (an async op whose work is dropped unwaited): finalize()
// raises it, on every rank.
TEST(NcclFake, CallCheckFinalizeRaisesAnUnseenMismatch) {
  FakeWorld w;
  // Each rank's buffer outlives its async op (the peer's thread may run the fake collective
  // after this rank's callback returned): freed after every communicator is finalized.
  std::vector<std::unique_ptr<Buf>> bufs(2);
  const auto errors = run_ranks(
      w, 2,
      [&](Communicator& comm, int r) {
        bufs[r] = std::make_unique<Buf>(DType::kFloat32, 4, r);
        CallOptions o;
        o.async_op = true;
        comm.all_reduce(bufs[r]->view(), r ? ReduceOp::max() : ReduceOp::sum(), o);
      },
      10s, [&](int) { return check_hints("1"); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r].rfind("[rank " + std::to_string(r) + "/2 ", 0), 0u) << errors[r];
    EXPECT_NE(errors[r].find(" finalize] nccl: a collective was mismatched across ranks and the "
                             "communicator was aborted: ranks issued different collectives: "
                             "rank 0 called all_reduce(SUM, 4 x float32) as collective #1; rank 1 "
                             "called all_reduce(MAX, 4 x float32) as collective #1"),
              std::string::npos)
        << errors[r];
  }
  w.expect_clean(/*mismatches=*/true);
}

// Ranks with different settings would meet one rank's exchange with another's op: refused at
// creation, on both ranks, naming both settings.
TEST(NcclFake, CallCheckSettingsMustAgree) {
  FakeWorld w;
  const auto errors = run_ranks(
      w, 2, [](Communicator&, int) {}, 10s,
      [](int r) { return r ? check_hints("1") : check_hints("0"); });
  EXPECT_NE(errors[0].find("rank 1 runs the call check as '1 fuse=0 memory=device' and this rank "
                           "as '0 fuse=0 memory=device'"),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[1].find("rank 0 runs the call check as '0 fuse=0 memory=device' and this rank "
                           "as '1 fuse=0 memory=device'"),
            std::string::npos)
      << errors[1];
  EXPECT_EQ(w.fake->count("ncclCommInitRankConfig"), 0) << "refused before NCCL is set up";
  w.expect_clean();
}

// ---- NOTE [nccl config hints] -------------------------------------------------------------------

// The configs ncclCommInitRankConfig got (one per rank).
std::vector<FakeNccl::ConfigSeen> init_configs(const FakeNccl& fake) {
  std::vector<FakeNccl::ConfigSeen> out;
  for (const auto& c : fake.configs())
    if (c.call == "ncclCommInitRankConfig") out.push_back(c);
  return out;
}

// Every key torchcomms reads, in both its spellings, reaches the config NCCL is given; commName
// is the communicator's name unless the hint names another.
TEST(NcclConfigHints, EveryKeyReachesNccl) {
  const std::vector<Hints> spellings = {
      {{"blocking", "1"},
       {"cgaClusterSize", "2"},
       {"minCTAs", "4"},
       {"maxCTAs", "16"},
       {"netName", "IB"},
       {"splitShare", "1"},
       {"trafficClass", "3"},
       {"commName", "mine"},
       {"collnetEnable", "0"},
       {"CTAPolicy", "1"},
       {"shrinkShare", "1"},
       {"nvlsCTAs", "0"},
       {"nChannelsPerNetPeer", "5"},
       {"nvlinkCentricSched", "1"}},
      {{"blocking", " 1 "},
       {"cga_cluster_size", "2"},
       {"min_ctas", "+4"},
       {"max_ctas", "16"},
       {"netName", "IB"},
       {"split_share", "1"},
       {"traffic_class", "3"},
       {"commName", "mine"},
       {"collnet_enable", "0"},
       {"cta_policy", "1"},
       {"shrinkShare", "1"},
       {"nvls_ctas", "0"},
       {"n_channels_per_net_peer", "5"},
       {"nvlink_centric_sched", "1"}},
  };
  for (const Hints& hints : spellings) {
    FakeWorld w;
    testing::internal::CaptureStderr();
    expect_ok(run_ranks(
        w, 2, [](Communicator&, int) {}, 10s, [&](int) { return hints; }));
    const std::string log = testing::internal::GetCapturedStderr();
    EXPECT_EQ(log.find("hint"), std::string::npos) << "no hint is ignored: " << log;
    const auto configs = init_configs(*w.fake);
    ASSERT_EQ(configs.size(), 2u);
    for (const auto& seen : configs) {
      ASSERT_TRUE(seen.given);
      const ncclConfig_t& c = seen.config;
      EXPECT_EQ(c.blocking, 1);
      EXPECT_EQ(c.cgaClusterSize, 2);
      EXPECT_EQ(c.minCTAs, 4);
      EXPECT_EQ(c.maxCTAs, 16);
      EXPECT_EQ(seen.net_name, "IB");
      EXPECT_EQ(c.splitShare, 1);
      EXPECT_EQ(c.trafficClass, 3);
      EXPECT_EQ(seen.comm_name, "mine");
      EXPECT_EQ(c.collnetEnable, 0);
      EXPECT_EQ(c.CTAPolicy, 1);
      EXPECT_EQ(c.shrinkShare, 1);
      EXPECT_EQ(c.nvlsCTAs, 0);
      EXPECT_EQ(c.nChannelsPerNetPeer, 5);
      EXPECT_EQ(c.nvlinkCentricSched, 1);
    }
    w.expect_clean();
  }
}

// Without hints the config is NCCL's defaults, named after the communicator (as torchcomms names
// it).
TEST(NcclConfigHints, DefaultsNameTheCommunicator) {
  FakeWorld w;
  std::string name;
  expect_ok(run_ranks(w, 1, [&](Communicator& comm, int) { name = comm.name(); }));
  const auto configs = init_configs(*w.fake);
  ASSERT_EQ(configs.size(), 1u);
  const ncclConfig_t& c = configs[0].config;
  EXPECT_TRUE(configs[0].given);
  EXPECT_EQ(configs[0].comm_name, name);
  EXPECT_FALSE(configs[0].has_net_name);
  for (int v : {c.blocking, c.cgaClusterSize, c.minCTAs, c.maxCTAs, c.splitShare, c.trafficClass,
                c.collnetEnable, c.CTAPolicy, c.shrinkShare, c.nvlsCTAs, c.nChannelsPerNetPeer,
                c.nvlinkCentricSched})
    EXPECT_EQ(v, NCCL_CONFIG_UNDEF_INT);
  w.expect_clean();
}

// A value of the wrong type raises ValueError naming the key and the value, before NCCL or CUDA
// is touched; blocking=0 is refused as unsupported.
TEST(NcclConfigHints, WrongTypesRaise) {
  const struct {
    Hints hints;
    ErrorCode code;
    std::string says;
  } cases[] = {
      {{{"minCTAs", "four"}},
       ErrorCode::kInvalidArgument,
       "hint minCTAs must be an integer, got 'four'"},
      {{{"max_ctas", "12abc"}},
       ErrorCode::kInvalidArgument,
       "hint max_ctas must be an integer, got '12abc'"},
      {{{"trafficClass", "99999999999"}},
       ErrorCode::kInvalidArgument,
       "hint trafficClass must be an integer, got '99999999999'"},
      {{{"is_high_priority_stream", "maybe"}},
       ErrorCode::kInvalidArgument,
       "hint is_high_priority_stream must be a bool (1/true/yes/y or 0/false/no/n), got 'maybe'"},
      {{{"max_event_pool_size", "-1"}},
       ErrorCode::kInvalidArgument,
       "hint max_event_pool_size must be an unsigned integer (an event count), got '-1'"},
      {{{"blocking", "0"}}, ErrorCode::kUnsupported, "hint blocking=0 (a non-blocking NCCL"},
  };
  for (const auto& k : cases) {
    FakeWorld w;
    const auto errors = run_ranks(
        w, 1, [](Communicator&, int) {}, 10s, [&](int) { return k.hints; });
    EXPECT_NE(errors[0].find(k.says), std::string::npos) << errors[0];
    EXPECT_EQ(errors[0].rfind("[rank 0/1 ", 0), 0u) << errors[0];
    EXPECT_EQ(w.fake->count("ncclCommInitRankConfig"), 0);
    EXPECT_EQ(w.fake->count("cudaStreamCreateWithPriority"), 0);
    w.expect_clean();
  }
  // The code, through the factory as Python sees it.
  auto store = std::make_shared<MemoryStore>();
  FakeWorld w;
  CommOptions o;
  o.store = store;
  o.hints = {{"blocking", "0"}};
  EXPECT_EQ(thrown([&] { Communicator::create(w.backend, 0, 1, cuda(0), o); }).code(),
            ErrorCode::kUnsupported);
  o.hints = {{"cgaClusterSize", "x"}};
  EXPECT_EQ(thrown([&] { Communicator::create(w.backend, 0, 1, cuda(0), o); }).code(),
            ErrorCode::kInvalidArgument);
  w.expect_clean();
}

// A key neither torchcomms nor fastcomms reads is logged and ignored, in torchcomms' words;
// fastcomms' own hints and other layers' namespaced ones are not; nvlsCTAs > 0 (NVLink SHARP,
// multicast) is not passed to NCCL and the log says why.
TEST(NcclConfigHints, UnknownKeysAndNvlsWarn) {
  FakeWorld w;
  std::string name;
  testing::internal::CaptureStderr();
  expect_ok(run_ranks(
      w, 1, [&](Communicator& comm, int) { name = comm.name(); }, 10s,
      [](int) {
        return Hints{{"fooBar", "1"},
                     {"nvlsCTAs", "4"},
                     {"check_calls", "0"},
                     {"nccl.high_priority", "1"},
                     {"gloo.interface", "lo"},
                     {"max_event_pool_size", "64"},
                     {"is_high_priority_stream", "no"}};
      }));
  const std::string log = testing::internal::GetCapturedStderr();
  EXPECT_NE(
      log.find("NCCL hint 'fooBar' is not supported in this NCCL version, ignoring for comm '" +
               name + "'"),
      std::string::npos)
      << log;
  EXPECT_NE(log.find("hint nvlsCTAs=4 asks NCCL for NVLink SHARP (NVLS, multicast objects), "
                     "which fastcomms keeps off (NCCL_NVLS_ENABLE=0): not passed to NCCL"),
            std::string::npos)
      << log;
  for (const char* quiet : {"check_calls", "nccl.high_priority", "gloo.interface",
                            "max_event_pool_size", "is_high_priority_stream"})
    EXPECT_EQ(log.find(std::string("'") + quiet + "'"), std::string::npos) << quiet << ": " << log;
  const auto configs = init_configs(*w.fake);
  ASSERT_EQ(configs.size(), 1u);
  EXPECT_EQ(configs[0].config.nvlsCTAs, NCCL_CONFIG_UNDEF_INT) << "multicast stays off";
  w.expect_clean();
}

// The stream hints: is_high_priority_stream as torchcomms parses a bool, or fastcomms'
// nccl.high_priority=1 (new_comm's is_high_priority_stream argument).
TEST(NcclConfigHints, StreamHints) {
  using nccl_backend::NcclConfig;
  const auto high = [](Hints h) { return NcclConfig(h, "c", "").high_priority_stream(); };
  EXPECT_FALSE(high({}));
  for (const char* yes : {"1", "true", "TRUE", " yes ", "y"})
    EXPECT_TRUE(high({{"is_high_priority_stream", yes}})) << yes;
  for (const char* no : {"0", "false", "No", "n"})
    EXPECT_FALSE(high({{"is_high_priority_stream", no}})) << no;
  EXPECT_TRUE(high({{"nccl.high_priority", "1"}}));
  EXPECT_EQ(NcclConfig({}, "c", "").max_event_pool_size(), 1000u);
  EXPECT_EQ(NcclConfig({{"max_event_pool_size", "64"}}, "c", "").max_event_pool_size(), 64u);
  // A copy points at its own strings.
  NcclConfig a({{"netName", "IB"}}, "first", "");
  NcclConfig b = a;
  b.set_comm_name("second");
  EXPECT_STREQ(a.get()->commName, "first");
  EXPECT_STREQ(b.get()->commName, "second");
  EXPECT_STREQ(b.get()->netName, "IB");
  EXPECT_NE(a.get()->netName, b.get()->netName);
}

// A split's members pass ncclCommSplit the config their split's hints ask for, named after the
// new communicator; a rank that joins none passes none.
TEST(NcclConfigHints, SplitPassesTheConfig) {
  FakeWorld w;
  expect_ok(run_ranks(w, 3, [](Communicator& comm, int r) {
    CommOptions o = comm.options();
    o.hints = {{"maxCTAs", "8"}, {"trafficClass", "2"}};
    auto sub = comm.split(r == 2 ? std::vector<int>{} : std::vector<int>{0, 1}, "sub", &o);
    if (sub) sub->finalize();
  }));
  int members = 0;
  for (const auto& seen : w.fake->configs()) {
    if (seen.call != "ncclCommSplit") continue;
    if (!seen.given) {
      EXPECT_EQ(seen.device, 2) << "only the rank in no group passes no config";
      continue;
    }
    ++members;
    EXPECT_EQ(seen.config.maxCTAs, 8);
    EXPECT_EQ(seen.config.trafficClass, 2);
    EXPECT_EQ(seen.comm_name, "sub");
  }
  EXPECT_EQ(members, 2);
  w.expect_clean();
}

// get_nccl_comm_ptr: the backend lends its ncclComm_t, none once aborted.
TEST(NcclFake, LendsItsCommunicator) {
  FakeWorld w;
  expect_ok(run_ranks(w, 1, [](Communicator& comm, int) {
    const auto lent = comm.lend(kLentNcclComm);
    ASSERT_NE(lent, nullptr);
    EXPECT_EQ(comm.lend("something else"), nullptr);
    comm.abort();
    EXPECT_EQ(comm.lend(kLentNcclComm), nullptr);
  }));
  bool seen = false;
  for (const auto& c : w.fake->calls())
    if (c.name == "ncclCommAbort") seen = c.comm != nullptr;
  EXPECT_TRUE(seen);
  w.expect_clean();
}

// ---- NOTE [nccl-lazy] ---------------------------------------------------------------------------

// Sends and receives run on a two-rank communicator per pair of ranks, made on the first of them
// (only by the two ranks); collectives on the one over every rank; bytes move on both.
TEST(NcclLazy, PairsOnFirstUse) {
  FakeWorld w(/*lazy=*/true);
  auto& fake = *w.fake;
  std::string name;
  expect_ok(run_ranks(w, 3, [&](Communicator& comm, int r) {
    EXPECT_EQ(comm.backend_name(), "nccl-lazy");
    if (r == 0) name = comm.name();
    EXPECT_EQ(comm.lend(kLentNcclComm), nullptr) << "torchcomms' lazy object has no comm ptr";
    Buf a(DType::kInt32, 1, r);
    a.t.set(0, r + 1);
    EXPECT_EQ(settle(comm.all_reduce(a.view(), ReduceOp::sum())), WorkStatus::kCompleted);
    EXPECT_EQ(a.t.get(0), 6);
    if (r == 2) return;  // rank 2 takes no part in any pair
    const int peer = 1 - r;
    for (int round = 0; round < 3; ++round) {
      Buf out(DType::kFloat32, 8, r), in(DType::kFloat32, 8, r);
      for (int i = 0; i < 8; ++i) {
        out.t.set(i, 100 * r + 10 * round + i);
        in.t.set(i, -1);  // poison
      }
      // The lower rank sends first, the higher receives first (as torchcomms' LazyP2PTest).
      WorkPtr s, v;
      if (r == 0) {
        s = comm.send(out.view(), peer, async_with_timeout(10s));
        v = comm.recv(in.view(), peer, async_with_timeout(10s));
      } else {
        v = comm.recv(in.view(), peer, async_with_timeout(10s));
        s = comm.send(out.view(), peer, async_with_timeout(10s));
      }
      EXPECT_EQ(settle(s), WorkStatus::kCompleted);
      EXPECT_EQ(settle(v), WorkStatus::kCompleted);
      for (int i = 0; i < 8; ++i) EXPECT_EQ(in.t.get(i), 100 * peer + 10 * round + i);
    }
  }));
  // Three primaries and one pair (made once, by ranks 0 and 1).
  const auto configs = init_configs(fake);
  int pairs = 0;
  for (const auto& c : configs)
    if (c.comm_name == name + "/p2p-0-1") ++pairs;
  EXPECT_EQ(configs.size(), 5u);
  EXPECT_EQ(pairs, 2);
  // The sends and receives on the pair's communicator, the collectives not.
  std::set<const void*> p2p_comms, coll_comms;
  for (const auto& c : fake.calls()) {
    if (c.name == "ncclSend" || c.name == "ncclRecv") p2p_comms.insert(c.comm);
    if (c.name == "ncclAllReduce") coll_comms.insert(c.comm);
  }
  EXPECT_EQ(p2p_comms.size(), 2u) << "one pair communicator per rank of the pair";
  for (const void* c : p2p_comms) EXPECT_EQ(coll_comms.count(c), 0u);
  w.expect_clean();
}

// The pairs get the communicator's NCCL config, under their own name; a batch stays on the
// primary (one group may name several peers); a split is a plain nccl communicator.
TEST(NcclLazy, ConfigBatchAndSplit) {
  FakeWorld w(/*lazy=*/true);
  std::string name;
  expect_ok(run_ranks(
      w, 2,
      [&](Communicator& comm, int r) {
        if (r == 0) name = comm.name();
        Buf out(DType::kInt64, 2, r), in(DType::kInt64, 2, r);
        out.t.set(0, r);
        out.t.set(1, r + 10);
        std::vector<P2POp> batch = {{P2POp::Kind::kSend, out.view(), 1 - r},
                                    {P2POp::Kind::kRecv, in.view(), 1 - r}};
        EXPECT_EQ(settle(comm.batch_p2p(batch)), WorkStatus::kCompleted);
        EXPECT_EQ(in.t.get(1), 1 - r + 10);
        EXPECT_EQ(w.fake->count("ncclCommInitRankConfig"), 2) << "no pair for a batch";
        Buf x(DType::kInt64, 1, r);
        x.t.set(0, 7 + r);
        const WorkPtr p2p = r == 0 ? comm.send(x.view(), 1, async_with_timeout(10s))
                                   : comm.recv(x.view(), 0, async_with_timeout(10s));
        EXPECT_EQ(settle(p2p), WorkStatus::kCompleted);
        EXPECT_EQ(x.t.get(0), 7);
        auto sub = comm.split({0, 1}, "half");
        ASSERT_NE(sub, nullptr);
        EXPECT_EQ(sub->backend_name(), "nccl");
        sub->finalize();
      },
      10s,
      [](int) {
        return Hints{{"minCTAs", "3"}};
      }));
  int pairs = 0;
  for (const auto& c : init_configs(*w.fake)) {
    EXPECT_EQ(c.config.minCTAs, 3) << c.comm_name;
    if (c.comm_name == name + "/p2p-0-1") ++pairs;
  }
  EXPECT_EQ(pairs, 2);
  w.expect_clean();
}

// abort() reaches the pairs; a send after it raises; what was made is freed.
TEST(NcclLazy, AbortReachesThePairs) {
  FakeWorld w(/*lazy=*/true);
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    Buf x(DType::kInt32, 4, r);
    const WorkPtr p2p = r == 0 ? comm.send(x.view(), 1, async_with_timeout(10s))
                               : comm.recv(x.view(), 0, async_with_timeout(10s));
    EXPECT_EQ(settle(p2p), WorkStatus::kCompleted);
    comm.abort();
    EXPECT_EQ(thrown([&] { comm.send(x.view(), 1 - r); }).code(), ErrorCode::kAborted);
  }));
  EXPECT_EQ(w.fake->count("ncclCommAbort"), 4) << "the primaries and the pairs";
  w.expect_clean();
}

// ---- PREMUL_SUM's factor, integer AVG, a batch's pair to self ---------------------------------

// NOTE [device factor]: every float type takes a number factor (in the type's bits: a bfloat16
// scalar read as a float's first two bytes would be wrong) and a device scalar, read when the
// collective runs (rank 0 changes its scalar after its call, before rank 1 calls).
TEST(NcclFake, PremulSumEveryFloatTypeAndDeviceFactor) {
  FakeWorld w;
  auto& fake = *w.fake;
  const int P = 2;
  std::atomic<int> stage{0};
  expect_ok(run_ranks(w, P, [&](Communicator& comm, int r) {
    for (DType dt : {DType::kFloat16, DType::kBFloat16, DType::kFloat32, DType::kFloat64}) {
      // a number: 1/3 rounded to the type, each product rounded to the type, then the sum
      Buf x(dt, 3, r);
      for (int i = 0; i < 3; ++i) x.t.set(i, r + 1 + i);
      EXPECT_EQ(settle(comm.all_reduce(x.view(), ReduceOp::premul_sum(1.0 / 3))),
                WorkStatus::kCompleted);
      // the arithmetic, rounded to the type with the core's codecs (round to nearest even)
      const auto rnd = [dt](double v) {
        if (dt == DType::kFloat16) return double{half_to_float(float_to_half(float(v)))};
        if (dt == DType::kBFloat16) return double{bf16_to_float(float_to_bf16(float(v)))};
        return dt == DType::kFloat32 ? double{float(v)} : v;
      };
      const double f = rnd(rnd(1.0 / 3));
      for (int i = 0; i < 3; ++i) {
        double acc = 0;
        for (int q = 0; q < P; ++q) acc = rnd(acc + rnd((q + 1 + i) * f));
        EXPECT_EQ(x.t.get(i), acc) << dtype_name(dt) << " element " << i;
      }
      // a device scalar of the type
      Buf scalar(dt, 1, r), y(dt, 2, r);
      scalar.t.set(0, 1.0);
      for (int i = 0; i < 2; ++i) y.t.set(i, r + 1);
      if (r == 1)
        while (stage.load() == 0) std::this_thread::sleep_for(1ms);
      auto work = comm.all_reduce(y.view(), ReduceOp::premul_sum(scalar.view()));
      if (r == 0) {
        scalar.t.set(0, 4.0);  // not run yet: rank 1 has not called
        stage.store(1);
      }
      EXPECT_EQ(settle(work), WorkStatus::kCompleted);
      if (r == 1) stage.store(0);
      for (int i = 0; i < 2; ++i) EXPECT_EQ(y.t.get(i), 4.0 * 1 + 1.0 * 2) << dtype_name(dt);
      // settle both ranks before the next type reuses the stage flag
      EXPECT_EQ(settle(comm.barrier()), WorkStatus::kCompleted);
    }
    // refused before NCCL sees it: a scalar of another dtype, on another device, of two elements
    Buf h(DType::kFloat16, 2, r), f32(DType::kFloat32, 1, r), two(DType::kFloat16, 2, r);
    EXPECT_EQ(thrown([&] { comm.all_reduce(h.view(), ReduceOp::premul_sum(f32.view())); }).code(),
              ErrorCode::kTypeError);
    EXPECT_EQ(thrown([&] { comm.all_reduce(h.view(), ReduceOp::premul_sum(two.view())); }).code(),
              ErrorCode::kInvalidArgument);
    HostTensor cpu_scalar(DType::kFloat16, 1);
    EXPECT_EQ(
        thrown([&] { comm.all_reduce(h.view(), ReduceOp::premul_sum(cpu_scalar.view())); }).code(),
        ErrorCode::kInvalidArgument);
  }));
  EXPECT_TRUE(fake.violations().empty()) << fake.violations().front();
}

// AVG on integers: NCCL's ncclAvg, the sum divided by the world size, truncated toward zero.
TEST(NcclFake, IntegerAvgTruncates) {
  FakeWorld w;
  const int P = 3;
  expect_ok(run_ranks(w, P, [](Communicator& comm, int r) {
    Buf x(DType::kInt32, 2, r);
    x.t.set(0, r == 0 ? 2 : 0);   // 2 / 3 -> 0
    x.t.set(1, r == 0 ? -5 : 0);  // -5 / 3 -> -1
    EXPECT_EQ(settle(comm.all_reduce(x.view(), ReduceOp::avg())), WorkStatus::kCompleted);
    EXPECT_EQ(x.t.get(0), 0);
    EXPECT_EQ(x.t.get(1), -1);
  }));
}

// NOTE [self pairs in a batch]: a send and a recv to self in one batch are NCCL's local copy.
TEST(NcclFake, BatchPairToSelfIsACopy) {
  FakeWorld w;
  auto& fake = *w.fake;
  const int P = 2;
  expect_ok(run_ranks(w, P, [&](Communicator& comm, int r) {
    Buf s(DType::kFloat32, 4, r), d(DType::kFloat32, 4, r);
    for (int i = 0; i < 4; ++i) {
      s.t.set(i, 10 * r + i);
      d.t.set(i, -1);
    }
    EXPECT_EQ(settle(comm.batch_p2p(
                  {{P2POp::Kind::kRecv, d.view(), r}, {P2POp::Kind::kSend, s.view(), r}})),
              WorkStatus::kCompleted);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(d.t.get(i), 10 * r + i);
    const Error lone = thrown([&] { comm.batch_p2p({{P2POp::Kind::kSend, s.view(), r}}); });
    EXPECT_NE(std::string(lone.what()).find("send to self without a matching recv"),
              std::string::npos)
        << lone.what();
    Buf small(DType::kFloat32, 3, r);
    const Error sizes = thrown([&] {
      comm.batch_p2p({{P2POp::Kind::kSend, s.view(), r}, {P2POp::Kind::kRecv, small.view(), r}});
    });
    EXPECT_NE(std::string(sizes.what()).find("float32[4]"), std::string::npos) << sizes.what();
    EXPECT_NE(std::string(sizes.what()).find("float32[3]"), std::string::npos) << sizes.what();
  }));
  EXPECT_TRUE(fake.violations().empty()) << fake.violations().front();
}

}  // namespace
}  // namespace fastcomms::test
