// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The nccl backend's host logic over a fake NCCL (NOTE [nccl seam]), on a machine with no GPU:
// ranks as threads through the communicator, each on its own fake device. What is checked is
// the backend's: the error each NCCL result raises and what its message names, the watchdog's
// timeout and abort, the asynchronous error, abort(), split, batches in one group, the order of
// finalize, and NOTE [nccl backend streams]. Every test also requires that the backend broke
// none of NCCL's rules the fake checks and released every stream, event and buffer.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <latch>
#include <thread>

#include "backends/nccl/nccl_backend.hpp"
#include "fake_nccl.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/reduce_op.hpp"
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
  FakeWorld() {
    register_backend(backend, [f = fake](const BackendInit& init) {
      return nccl_backend::make_nccl_backend(init, f);
    });
  }
  // Every communicator is gone: nothing left alive, no rule broken.
  void expect_clean() const {
    const auto v = fake->violations();
    for (const auto& what : v) ADD_FAILURE() << "fake NCCL: " << what;
    const FakeNccl::Live l = fake->live();
    EXPECT_EQ(l.comms, 0) << "communicators neither destroyed nor aborted";
    EXPECT_EQ(l.streams, 0) << "streams not destroyed";
    EXPECT_EQ(l.events, 0) << "events not destroyed";
    EXPECT_EQ(l.buffers, 0) << "device buffers not freed";
  }
};

Device cuda(int r) { return Device{DeviceType::kCUDA, r}; }

// Runs fn(comm, rank) on P ranks as threads (rank r on fake device r), then finalizes and drops
// each communicator. Returns each rank's error ("" where it succeeded).
std::vector<std::string> run_ranks(FakeWorld& w, int P,
                                   const std::function<void(Communicator&, int)>& fn,
                                   std::chrono::milliseconds timeout = 10s) {
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
// wait on it; the host never blocks.
TEST(NcclFake, StreamsNote) {
  FakeWorld w;
  auto& fake = *w.fake;
  expect_ok(run_ranks(w, 2, [&](Communicator& comm, int r) {
    cudaStream_t caller = nullptr;
    ASSERT_EQ(fake.cuda_stream_create_with_priority(&caller, cudaStreamNonBlocking, 0),
              cudaSuccess);
    const size_t mark = fake.calls().size();
    Buf a(DType::kFloat32, 8, r);
    CallOptions o;
    o.stream = caller;
    auto work = comm.all_reduce(a.view(), ReduceOp::sum(), o);
    std::vector<FakeNccl::Call> mine;  // this thread's calls during the op, device switches aside
    const auto all = fake.calls();
    for (size_t i = mark; i < all.size(); ++i)
      if (all[i].thread == std::this_thread::get_id() && all[i].name != "cudaGetDevice" &&
          all[i].name != "cudaSetDevice")
        mine.push_back(all[i]);
    std::vector<std::string> names;
    for (const auto& c : mine) names.push_back(c.name);
    const std::vector<std::string> want = {"cudaEventRecord",    "cudaStreamWaitEvent",
                                           "ncclAllReduce",      "cudaEventCreateWithFlags",
                                           "cudaEventRecord",    "cudaStreamIsCapturing",
                                           "cudaStreamWaitEvent"};
    ASSERT_EQ(names, want) << "rank " << r;
    const void* internal = mine[2].stream;
    EXPECT_NE(internal, static_cast<const void*>(caller));
    EXPECT_EQ(mine[0].stream, caller) << "ready is recorded on the caller's stream";
    EXPECT_EQ(mine[1].stream, internal) << "the internal stream waits for ready";
    EXPECT_EQ(mine[1].event, mine[0].event);
    EXPECT_EQ(mine[4].stream, internal) << "done is recorded on the internal stream";
    EXPECT_NE(mine[4].event, mine[0].event) << "done is an event of its own";
    EXPECT_EQ(mine[6].stream, caller) << "the caller's stream waits for done (the sync op)";
    EXPECT_EQ(mine[6].event, mine[4].event);
    EXPECT_EQ(settle(work), WorkStatus::kCompleted);
    ASSERT_EQ(fake.cuda_stream_destroy(caller), cudaSuccess);
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
  w.fake->fail("ncclCommInitRank", ncclSystemError, 0);
  const auto errors = run_ranks(w, 1, [](Communicator&, int) {});
  EXPECT_NE(errors[0].find("new_comm] nccl: ncclCommInitRank failed: ncclSystemError"),
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
      if (c.name == "ncclCommInitRank") continue;
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

}  // namespace
}  // namespace fastcomms::test
