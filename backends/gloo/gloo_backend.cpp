// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The gloo backend: every op of the communicator API on CPU tensors over Gloo's TCP transport.
//
// NOTE [gloo backend threading]: collectives run one at a time, in issue order, on a worker
// thread per communicator (every rank issues collectives in the same order, so the order of the
// queue is the order Gloo needs). Point-to-point ops are posted on the caller's thread (Gloo's
// unbound buffers are non-blocking) and completed by a second thread that waits on them in
// order, so a send and a receive posted together can never deadlock each other. Every wait is
// bounded by the op's timeout; abort() wakes every waiter.
#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/alltoallv.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/gather.h>
#include <gloo/reduce.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/scatter.h>
#include <gloo/transport/tcp/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/pair.h>
#include <gloo/types.h>

#include <netinet/in.h>

#include <csignal>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>

#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/forwarding_backend.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/error.hpp"
#include "reduce_kernels.hpp"

namespace fastcomms::gloo_backend {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint8_t kP2PSlotPrefix = 0x40;  // above Gloo's own collective prefixes (0x01..0x08)

// NOTE [gloo I/O thread errors]: Gloo's TCP transport reads on its own I/O thread, and an
// exception there (a peer sending more bytes than this rank's call posted, which mismatched
// calls do: "op.preamble.length <= op.nbytes") is not caught by Gloo: the process terminates.
// The pair below catches every exception of that thread and hands it to Gloo's own error path
// (the pair closes; the peer's later waits on it fail), then tells the backend, which fails the
// op in flight at once (Gloo's wait on the buffer being read would only end at its timeout) and
// every later op: the communicator is broken, as after a dead peer, and its connections are
// closed so the peers' waits end too. The context and device subclasses exist only to make
// these pairs. The pair touches none of its base's members and is allocated with slack:
// Debian's package lacks one header the pair's header includes, and the stand-in
// (backends/gloo/compat) could give the base another size than the library's (896 bytes in
// 0.0~git20220518, as ours); so its hook lives in a table keyed by the pair, not in the pair.
using IoErrorHook = std::function<void(const std::string& what)>;

// What the backend gives each of its pairs: the I/O error hook above and, for tests only, a delay
// before the listening side of a pair waits for its connection (NOTE [gloo connect barrier]).
struct PairOptions {
  IoErrorHook hook;
  std::chrono::milliseconds listener_delay{0};
};

class GuardedPair final : public ::gloo::transport::tcp::Pair {
 public:
  GuardedPair(::gloo::transport::tcp::Context* context, ::gloo::transport::tcp::Device* device,
              int rank, std::chrono::milliseconds timeout, PairOptions options)
      : ::gloo::transport::tcp::Pair(context, device, rank, timeout) {
    std::lock_guard<std::mutex> lock(table_mu());
    table()[this] = std::move(options);
  }
  ~GuardedPair() override {
    std::lock_guard<std::mutex> lock(table_mu());
    table().erase(this);
  }
  static void* operator new(size_t n) { return ::operator new(n + kSlack); }
  static void operator delete(void* p) { ::operator delete(p); }

  void connect(const std::vector<char>& bytes) override {
    const auto delay = options().listener_delay;
    if (delay.count() > 0 && listens(address(), ::gloo::transport::tcp::Address(bytes)))
      std::this_thread::sleep_for(delay);
    ::gloo::transport::tcp::Pair::connect(bytes);
  }

 protected:
  void handleReadWrite(int events) override {
    try {
      ::gloo::transport::tcp::Pair::handleReadWrite(events);
    } catch (const std::exception& e) {
      // Gloo's own error path (the pair's mutex is held here, as Gloo's reads hold it); it
      // refuses (throws) only when the pair has already failed.
      try {
        signalException(std::current_exception());
      } catch (const std::exception&) {
      }
      if (auto hook = options().hook) hook(e.what());
    }
  }

 private:
  static constexpr size_t kSlack = 4096;
  PairOptions options() const {
    std::lock_guard<std::mutex> lock(table_mu());
    auto it = table().find(this);
    return it != table().end() ? it->second : PairOptions{};
  }
  // Gloo's rule for which side of a pair listens: the one with the smaller address (IP, then
  // port as stored); the other connects.
  static bool listens(const ::gloo::transport::tcp::Address& self,
                      const ::gloo::transport::tcp::Address& peer) {
    const sockaddr_storage& a = self.getSockaddr();
    const sockaddr_storage& b = peer.getSockaddr();
    if (a.ss_family != b.ss_family) return false;
    int rv = 0;
    if (a.ss_family == AF_INET) {
      const auto* x = reinterpret_cast<const sockaddr_in*>(&a);
      const auto* y = reinterpret_cast<const sockaddr_in*>(&b);
      rv = std::memcmp(&x->sin_addr, &y->sin_addr, sizeof(in_addr));
      if (rv == 0) rv = x->sin_port - y->sin_port;
    } else if (a.ss_family == AF_INET6) {
      const auto* x = reinterpret_cast<const sockaddr_in6*>(&a);
      const auto* y = reinterpret_cast<const sockaddr_in6*>(&b);
      rv = std::memcmp(&x->sin6_addr, &y->sin6_addr, sizeof(in6_addr));
      if (rv == 0) rv = x->sin6_port - y->sin6_port;
    }
    return rv < 0;
  }
  static std::mutex& table_mu() {
    static std::mutex mu;
    return mu;
  }
  static std::unordered_map<const void*, PairOptions>& table() {
    static std::unordered_map<const void*, PairOptions> t;
    return t;
  }
};

class GuardedContext final : public ::gloo::transport::tcp::Context {
 public:
  GuardedContext(std::shared_ptr<::gloo::transport::tcp::Device> device, int rank, int size,
                 PairOptions options)
      : ::gloo::transport::tcp::Context(std::move(device), rank, size),
        options_(std::move(options)) {}
  std::unique_ptr<::gloo::transport::Pair>& createPair(int rank) override {
    pairs_[rank] = std::make_unique<GuardedPair>(this, device_.get(), rank, getTimeout(), options_);
    return pairs_[rank];
  }

 private:
  PairOptions options_;
};

class GuardedDevice final : public ::gloo::transport::tcp::Device {
 public:
  GuardedDevice(const ::gloo::transport::tcp::attr& attr, PairOptions options)
      : ::gloo::transport::tcp::Device(attr), options_(std::move(options)) {}
  std::shared_ptr<::gloo::transport::Context> createContext(int rank, int size) override {
    return std::make_shared<GuardedContext>(shared_from_this(), rank, size, options_);
  }

 private:
  PairOptions options_;
};

// Gloo's store interface over ours.
class StoreAdapter : public ::gloo::rendezvous::Store {
 public:
  StoreAdapter(std::shared_ptr<fastcomms::Store> store, std::chrono::milliseconds timeout)
      : store_(std::move(store)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_->set(key, std::vector<uint8_t>(data.begin(), data.end()));
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_->get(key, timeout_);
    return std::vector<char>(v.begin(), v.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& t) override {
    store_->wait(keys, t);
  }

 private:
  std::shared_ptr<fastcomms::Store> store_;
  std::chrono::milliseconds timeout_;
};

// NOTE [gloo connect barrier]: Gloo's rendezvous returns on a rank as soon as its own side of
// every pair is connected. The connecting side of a pair is done when its TCP connect completes,
// which the kernel finishes from the listen backlog before the listening rank has taken the
// connection. A rank that returned and finalized at once (after a call that failed its own
// checks, say) closed the connection before the listening rank looked at it, and that rank's
// new_comm then failed with "Connection closed by peer" (seen under load: tools/probe_inputs.py,
// 1 run of 8 beside a parallel ctest). So no rank leaves new_comm before every rank has its
// whole mesh: each marks itself connected in the communicator's key space (released at
// finalize like every key there) and waits for every mark, within what is left of the timeout.
// Test-only hints reproduce the race: gloo.debug_listener_delay_ms delays the listening side of
// every pair before it waits for its connection; gloo.debug_no_connect_barrier=1 leaves the
// barrier out (the armed control of the test).
struct DebugConnect {
  std::chrono::milliseconds listener_delay{0};
  bool no_connect_barrier = false;
};

DebugConnect debug_connect(const Hints& hints, const std::string& where) {
  DebugConnect d;
  if (auto it = hints.find("gloo.debug_listener_delay_ms"); it != hints.end()) {
    const std::string& v = it->second;
    const bool digits = !v.empty() && v.size() <= 7 && std::all_of(v.begin(), v.end(), [](char c) {
      return c >= '0' && c <= '9';
    });
    FASTCOMMS_CHECK(digits, kInvalidArgument, where,
                    "hint gloo.debug_listener_delay_ms must be a count of milliseconds "
                    "(0 to 9999999), got '",
                    v, "'");
    d.listener_delay = std::chrono::milliseconds(std::stoll(v));
  }
  if (auto it = hints.find("gloo.debug_no_connect_barrier"); it != hints.end()) {
    FASTCOMMS_CHECK(it->second == "0" || it->second == "1", kInvalidArgument, where,
                    "hint gloo.debug_no_connect_barrier must be 0 or 1, got '", it->second, "'");
    d.no_connect_barrier = it->second == "1";
  }
  return d;
}

void connect_barrier(Store& store, int rank, int size, Clock::time_point start,
                     std::chrono::milliseconds timeout, const std::string& where) {
  const auto key = [](int r) { return detail::cat("gloo/connected/", r); };
  store.set(key(rank), {1});
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key(r));
  const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start);
  try {
    store.wait(keys, std::max(std::chrono::milliseconds(1), timeout - spent));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kTimeout) throw;
    std::string missing;
    for (int r = 0; r < size; ++r) {
      bool there = false;
      try {
        there = store.check({key(r)});
      } catch (const Error&) {
      }
      if (!there) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    throw Error(ErrorCode::kTimeout,
                detail::cat(where, "rendezvous: rank(s) ", missing,
                            " did not finish connecting to their peers within the timeout (",
                            timeout.count(), " ms): a rank died or is stuck"));
  }
}

// A byte view of a tensor.
uint8_t* bytes(const TensorView& t) { return static_cast<uint8_t*>(t.data); }
size_t nbytes(const TensorView& t) { return static_cast<size_t>(t.nbytes()); }

class GlooImpl : public std::enable_shared_from_this<GlooImpl> {
 public:
  // Whether this op runs the call check (NOTE [call check]): the communicator's setting, or
  // the op's hint.
  bool checks(const OpContext& ctx) const;
  explicit GlooImpl(const BackendInit& init);
  ~GlooImpl();
  /// Starts the worker threads (they keep the impl alive while they run).
  void start();
  /// Stops the workers: joins them, or, after abort(), lets them finish on their own.
  void shutdown();

  WorkPtr send(const TensorView& t, int dst, const OpContext& ctx) {
    return batch_p2p({P2POp{P2POp::Kind::kSend, t, dst}}, ctx);
  }
  WorkPtr recv(const TensorView& t, int src, const OpContext& ctx) {
    return batch_p2p({P2POp{P2POp::Kind::kRecv, t, src}}, ctx);
  }
  WorkPtr batch_p2p(const std::vector<P2POp>& ops, const OpContext& ctx);
  WorkPtr broadcast(const TensorView& t, int root, const OpContext& ctx);
  WorkPtr all_reduce(const TensorView& t, const ReduceOp& op, const OpContext& ctx);
  WorkPtr reduce(const TensorView& t, int root, const ReduceOp& op, const OpContext& ctx);
  WorkPtr all_gather(const std::vector<TensorView>& outputs, const TensorView& input,
                     const OpContext& ctx);
  WorkPtr all_gather_single(const TensorView& output, const TensorView& input,
                            const OpContext& ctx);
  WorkPtr reduce_scatter(const TensorView& output, const std::vector<TensorView>& inputs,
                         const ReduceOp& op, const OpContext& ctx);
  WorkPtr reduce_scatter_single(const TensorView& output, const TensorView& input,
                                const ReduceOp& op, const OpContext& ctx);
  WorkPtr all_to_all_v_single(const TensorView& output, const TensorView& input,
                              const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits, const OpContext& ctx);
  WorkPtr all_to_all(const std::vector<TensorView>& outputs, const std::vector<TensorView>& inputs,
                     const OpContext& ctx);
  WorkPtr barrier(const OpContext& ctx);
  WorkPtr scatter(const TensorView& output, const std::vector<TensorView>& inputs, int root,
                  const OpContext& ctx);
  WorkPtr gather(const std::vector<TensorView>& outputs, const TensorView& input, int root,
                 const OpContext& ctx);
  void abort();
  void finalize();

 private:
  // A collective body: runs on the worker with the op's timeout and a unique tag.
  using Body = std::function<void(std::chrono::milliseconds timeout, uint32_t tag)>;
  struct Task {
    Body body;
    std::shared_ptr<AsyncWork> work;
    std::chrono::milliseconds timeout;
    uint32_t tag;
    std::string prefix;
    CallFingerprint fingerprint;
    // NOTE [per-peer sizes check]: bytes this rank sends to / expects from each peer (the _v
    // forms); empty when every rank's sizes follow from the fingerprint. They travel with the
    // fingerprint in check_call's one exchange.
    std::vector<int64_t> peer_out, peer_in;
    bool check = false;  // this op is checked (the communicator's setting or the op's hint)
  };
  struct P2PTask {
    std::vector<std::pair<std::unique_ptr<::gloo::transport::UnboundBuffer>, bool /*send*/>> bufs;
    std::shared_ptr<AsyncWork> work;
    Clock::time_point deadline;
    std::string prefix;
  };

  WorkPtr enqueue(const OpContext& ctx, Body body);
  void check_call(const Task& task);
  void collective_loop();
  void p2p_loop();
  std::shared_ptr<AsyncWork> new_work(const OpContext& ctx) const {
    return std::make_shared<AsyncWork>(ctx.prefix,
                                       Clock::now() + ctx.timeout + std::chrono::seconds(1));
  }
  std::exception_ptr translate(const std::string& prefix, std::exception_ptr e) const;
  void all_reduce_now(void* data, int64_t count, DType dt, const ReduceOp& op,
                      std::chrono::milliseconds timeout, uint32_t tag);
  // NOTE [gloo I/O thread errors]: fails the op in flight and every later op.
  void on_io_error(const std::string& what);
  // Throws the error that broke this communicator, if one did; mu_ held.
  void check_not_broken(const std::string& prefix) const;
  // That error for an op's message prefix.
  std::exception_ptr broken_error(const std::string& prefix, const std::string& what) const {
    return translate(prefix, std::make_exception_ptr(std::runtime_error(what)));
  }

  // Filled by start(): the I/O thread's hook reaches the impl through it, and never keeps it
  // alive.
  struct SelfSlot {
    std::mutex mu;
    std::weak_ptr<GlooImpl> self;
  };
  std::shared_ptr<SelfSlot> self_slot_ = std::make_shared<SelfSlot>();

  int rank_, size_;
  std::shared_ptr<::gloo::transport::Device> device_;
  std::shared_ptr<::gloo::rendezvous::Context> context_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Task> tasks_;
  std::deque<P2PTask> p2p_tasks_;
  bool stop_ = false;
  std::atomic<bool> aborted_{false};
  uint32_t next_tag_ = 1;
  std::vector<uint32_t> send_seq_, recv_seq_;
  // Raw pointers of posted unbound buffers, so abort() can wake their waiters.
  std::vector<::gloo::transport::UnboundBuffer*> live_bufs_;
  std::shared_ptr<AsyncWork> running_;  // the collective the worker is in, if any
  std::string running_prefix_;
  std::string broken_;        // NOTE [gloo I/O thread errors]
  bool check_calls_ = false;  // NOTE [call fingerprint]
  std::thread collective_thread_, p2p_thread_;
};

GlooImpl::GlooImpl(const BackendInit& init)
    : rank_(init.rank), size_(init.size), send_seq_(init.size, 0), recv_seq_(init.size, 0) {
  // NOTE [gloo and SIGPIPE]: Gloo's TCP pairs write with writev, so a write to a peer that died
  // raises SIGPIPE, whose default action kills this process (seen: Gloo.PeerThatDiesFailsFast
  // died of SIGPIPE now and then). A dead peer must be an error on the waiting call, never a
  // process exit: where SIGPIPE still has its default action, it is ignored (Python does the
  // same at start-up, so Python processes see no change); a handler the application installed
  // is left alone.
  // NOTE [call fingerprint]: off unless asked (the hint gloo.check_calls=1, else the variable
  // FASTCOMMS_CHECK_CALLS=1): the check costs one extra round trip per collective, measured at
  // 1-12 points of a 1 MiB op on loopback, above the 5% the default may cost
  // (docs/benchmarks.md).
  {
    const char* e = std::getenv("FASTCOMMS_CHECK_CALLS");
    std::string v = e ? e : "0";
    for (const char* hint : {"check_calls", "gloo.check_calls"})  // the specific one wins
      if (auto h = init.options.hints.find(hint); h != init.options.hints.end()) v = h->second;
    FASTCOMMS_CHECK(v == "0" || v == "1", kInvalidArgument, "[rank ", init.rank, "/", init.size,
                    " ", init.options.name,
                    " new_comm] gloo: check_calls (hint gloo.check_calls or check_calls, "
                    "or FASTCOMMS_CHECK_CALLS) must be 0 or 1, got '",
                    v, "'");
    check_calls_ = v == "1";
  }
  static const bool sigpipe_ignored = [] {
    struct sigaction old {};
    if (sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL &&
        !(old.sa_flags & SA_SIGINFO))
      std::signal(SIGPIPE, SIG_IGN);
    return true;
  }();
  (void)sigpipe_ignored;
  const auto start = Clock::now();
  const std::string where =
      detail::cat("[rank ", rank_, "/", size_, " ", init.options.name, " new_comm] gloo: ");
  const DebugConnect debug = debug_connect(init.options.hints, where);
  FASTCOMMS_CHECK(init.device.type == DeviceType::kCPU, kInvalidArgument, where,
                  "the gloo backend serves CPU tensors, got device ", init.device.str());
  ::gloo::transport::tcp::attr attr;
  const auto& hints = init.options.hints;
  if (auto it = hints.find("gloo.interface"); it != hints.end()) {
    attr.iface = it->second;
  } else if (auto h = hints.find("gloo.hostname"); h != hints.end()) {
    attr.hostname = h->second;
  } else {
    attr.hostname = "127.0.0.1";  // loopback by default
  }
  try {
    // NOTE [gloo I/O thread errors]
    // The hook runs on Gloo's I/O thread with a pair's mutex held, so the impl's own lock is
    // taken on a thread of its own (callers hold that lock while posting on pairs).
    IoErrorHook hook = [slot = self_slot_](const std::string& what) {
      std::shared_ptr<GlooImpl> impl;
      {
        std::lock_guard<std::mutex> lock(slot->mu);
        impl = slot->self.lock();
      }
      if (impl) std::thread([impl, what] { impl->on_io_error(what); }).detach();
    };
    PairOptions pair_options{std::move(hook), debug.listener_delay};
    device_ = std::make_shared<GuardedDevice>(::gloo::transport::tcp::CreateDeviceAttr(attr),
                                              std::move(pair_options));
    context_ = std::make_shared<::gloo::rendezvous::Context>(rank_, size_);
    // NOTE [gloo connect wait]: Gloo waits five times the context's timeout for a pair to
    // connect (a peer that published its address and then died is retried that long), so the
    // mesh is built with a fifth of ours: a rendezvous then ends within one timeout of the
    // store's wait, not five. Ops set their own timeout on every call.
    context_->setTimeout(std::max(std::chrono::milliseconds(1), init.options.timeout / 5));
    StoreAdapter store(init.options.store, init.options.timeout);
    context_->connectFullMesh(store, device_);
    context_->setTimeout(init.options.timeout);
    if (!debug.no_connect_barrier)
      connect_barrier(*init.options.store, rank_, size_, start, init.options.timeout, where);
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    const bool timeout = std::string(e.what()).find("imed out") != std::string::npos;
    throw Error(timeout ? ErrorCode::kTimeout : ErrorCode::kBackendError,
                where + "rendezvous failed: " + e.what());
  }
}

void GlooImpl::start() {
  auto self = shared_from_this();
  {
    std::lock_guard<std::mutex> lock(self_slot_->mu);
    self_slot_->self = self;
  }
  collective_thread_ = std::thread([self] { self->collective_loop(); });
  p2p_thread_ = std::thread([self] { self->p2p_loop(); });
}

// NOTE [gloo abort and thread lifetime]: Gloo cannot interrupt a collective that is already
// waiting on the network; it returns only at its own timeout. abort() therefore fails every
// pending Work at once (waiters are released), and shutdown() detaches the worker threads
// instead of joining them. Each thread owns a reference to the impl, so the impl (context,
// buffers) outlives the stuck call and is freed by the last thread to exit.
void GlooImpl::shutdown() {
  bool broken = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    broken = !broken_.empty();  // NOTE [gloo I/O thread errors]: like an abort
  }
  cv_.notify_all();
  for (std::thread* t : {&collective_thread_, &p2p_thread_}) {
    if (!t->joinable()) continue;
    if (aborted_ || broken)
      t->detach();
    else
      t->join();
  }
}

GlooImpl::~GlooImpl() = default;

std::exception_ptr GlooImpl::translate(const std::string& prefix, std::exception_ptr e) const {
  try {
    std::rethrow_exception(e);
  } catch (const Error& err) {
    return std::make_exception_ptr(Error(err.code(), std::string(err.what()).rfind(prefix, 0) == 0
                                                         ? err.what()
                                                         : prefix + err.what()));
  } catch (const std::exception& err) {
    if (aborted_) {
      return std::make_exception_ptr(
          Error(ErrorCode::kAborted, prefix + "the communicator was aborted"));
    }
    const std::string what = err.what();
    // Gloo says "Timed out ..." for the op that timed out and "Application timeout caused pair
    // closure" for later ops on the closed connection.
    const bool timeout =
        what.find("imed out") != std::string::npos || what.find("timeout") != std::string::npos;
    // NOTE [gloo I/O thread errors]: a peer's message longer than this call's buffer.
    if (what.find("preamble.length") != std::string::npos) {
      return std::make_exception_ptr(Error(
          ErrorCode::kBackendError,
          prefix + "a peer sent more bytes than this call expects (did the ranks call this op " +
              "with different sizes?); the connection to it is closed and this communicator " +
              "cannot be used further. FASTCOMMS_CHECK_CALLS=1 compares every call across " +
              "ranks before data moves and raises a clear mismatch error instead. Gloo: " + what));
    }
    return std::make_exception_ptr(
        Error(timeout ? ErrorCode::kTimeout : ErrorCode::kBackendError,
              prefix + (timeout ? "timed out: " : "gloo failed: ") + what));
  }
}

bool GlooImpl::checks(const OpContext& ctx) const {
  if (ctx.hints != nullptr) {  // a per-op hint decides for that op
    if (auto h = ctx.hints->find("gloo.check_calls"); h != ctx.hints->end())
      return h->second == "1";
    if (auto h = ctx.hints->find("check_calls"); h != ctx.hints->end()) return h->second == "1";
  }
  return check_calls_;
}

WorkPtr GlooImpl::enqueue(const OpContext& ctx, Body body) {
  auto work = new_work(ctx);
  const bool check = checks(ctx);
  {
    std::lock_guard<std::mutex> lock(mu_);
    FASTCOMMS_CHECK(!aborted_, kAborted, ctx.prefix, "the communicator was aborted");
    check_not_broken(ctx.prefix);
    // Two tags per collective: the call check's exchanges and the op itself.
    tasks_.push_back(Task{std::move(body), work, ctx.timeout, next_tag_, ctx.prefix,
                          ctx.fingerprint, ctx.peer_out, ctx.peer_in, check});
    next_tag_ += 2;
  }
  cv_.notify_all();
  return work;
}

// NOTE [call check] in band on gloo: before a collective moves data, every rank's call record is
// gathered (a fixed size, so this exchange itself can never disagree on sizes; it runs at the
// same position of every rank's collective sequence). Ranks that issued different
// calls then all raise the same error, instead of Gloo's I/O thread aborting the process on a
// size it did not expect or the data mixing silently (a shorter broadcast, float32 read as
// int32, SUM against MAX).
void GlooImpl::check_call(const Task& task) {
  // Local markers (finalize's drain) carry no fingerprint and move nothing.
  if (size_ == 1 || task.fingerprint.op < 0) return;
  const std::vector<int64_t> mine =
      call_record(task.fingerprint, task.peer_out, task.peer_in, size_);
  std::vector<int64_t> all(mine.size() * size_);
  ::gloo::AllgatherOptions o(context_);
  o.setInput(const_cast<int64_t*>(mine.data()), mine.size());
  o.setOutput(all.data(), all.size());
  o.setTag(task.tag + 1);
  o.setTimeout(task.timeout);
  ::gloo::allgather(o);
  check_call_records(task.prefix, task.fingerprint, all, size_);
}

void GlooImpl::collective_loop() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      task = std::move(tasks_.front());
      tasks_.pop_front();
    }
    if (aborted_) {
      task.work->fail(std::make_exception_ptr(
          Error(ErrorCode::kAborted, task.prefix + "the communicator was aborted")));
      continue;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!broken_.empty() && task.fingerprint.op >= 0) {  // finalize's marker still drains
        task.work->fail(broken_error(task.prefix, broken_));
        continue;
      }
      running_ = task.work;
      running_prefix_ = task.prefix;
    }
    task.work->start();
    try {
      if (task.check) check_call(task);
      task.body(task.timeout, task.tag);
      task.work->complete();
    } catch (...) {
      task.work->fail(translate(task.prefix, std::current_exception()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    running_.reset();
  }
}

void GlooImpl::p2p_loop() {
  for (;;) {
    P2PTask task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !p2p_tasks_.empty(); });
      if (p2p_tasks_.empty()) return;
      task = std::move(p2p_tasks_.front());
      p2p_tasks_.pop_front();
    }
    try {
      for (auto& [buf, is_send] : task.bufs) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(task.deadline - Clock::now());
        const auto t = std::max(left, std::chrono::milliseconds(1));
        const bool ok = is_send ? buf->waitSend(t) : buf->waitRecv(t);
        FASTCOMMS_CHECK(ok && !aborted_, kAborted, task.prefix, "the communicator was aborted");
      }
      task.work->complete();
    } catch (...) {
      task.work->fail(translate(task.prefix, std::current_exception()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [buf, is_send] : task.bufs)
      live_bufs_.erase(std::remove(live_bufs_.begin(), live_bufs_.end(), buf.get()),
                       live_bufs_.end());
  }
}

WorkPtr GlooImpl::batch_p2p(const std::vector<P2POp>& ops, const OpContext& ctx) {
  auto work = new_work(ctx);
  P2PTask task;
  task.work = work;
  task.deadline = Clock::now() + ctx.timeout;
  task.prefix = ctx.prefix;
  std::lock_guard<std::mutex> lock(mu_);
  FASTCOMMS_CHECK(!aborted_, kAborted, ctx.prefix, "the communicator was aborted");
  check_not_broken(ctx.prefix);
  try {
    for (const P2POp& op : ops) {
      auto buf = context_->createUnboundBuffer(op.tensor.data, nbytes(op.tensor));
      const bool is_send = op.kind == P2POp::Kind::kSend;
      const uint32_t seq = is_send ? send_seq_[op.peer]++ : recv_seq_[op.peer]++;
      const uint64_t slot = ::gloo::Slot::build(kP2PSlotPrefix, seq);
      if (is_send)
        buf->send(op.peer, slot);
      else
        buf->recv(op.peer, slot);
      live_bufs_.push_back(buf.get());
      task.bufs.emplace_back(std::move(buf), is_send);
    }
  } catch (...) {
    std::rethrow_exception(translate(ctx.prefix, std::current_exception()));
  }
  work->start();
  p2p_tasks_.push_back(std::move(task));
  cv_.notify_all();
  return work;
}

WorkPtr GlooImpl::broadcast(const TensorView& t, int root, const OpContext& ctx) {
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    if (size_ == 1 || t.nbytes() == 0) return;
    ::gloo::BroadcastOptions o(context_);
    if (rank_ == root) o.setInput(bytes(t), nbytes(t));
    o.setOutput(bytes(t), nbytes(t));
    o.setRoot(root);
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::broadcast(o);
  });
}

void GlooImpl::all_reduce_now(void* data, int64_t count, DType dt, const ReduceOp& op,
                              std::chrono::milliseconds timeout, uint32_t tag) {
  if (op.type == RedOpType::kPremulSum) scale_in_place(data, count, dt, op.factor);
  if (size_ > 1 && count > 0) {
    const ReduceFn fn = reduce_fn(op.type, dt);
    ::gloo::AllreduceOptions o(context_);
    const size_t es = dtype_size(dt);
    // Gloo sizes buffers by sizeof(T): pick a T of the element's width.
    switch (es) {
      case 1:
        o.setInput(static_cast<uint8_t*>(data), count);
        o.setOutput(static_cast<uint8_t*>(data), count);
        break;
      case 2:
        o.setInput(static_cast<uint16_t*>(data), count);
        o.setOutput(static_cast<uint16_t*>(data), count);
        break;
      case 4:
        o.setInput(static_cast<uint32_t*>(data), count);
        o.setOutput(static_cast<uint32_t*>(data), count);
        break;
      default:
        o.setInput(static_cast<uint64_t*>(data), count);
        o.setOutput(static_cast<uint64_t*>(data), count);
        break;
    }
    o.setReduceFunction(fn);
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::allreduce(o);
  }
  if (op.type == RedOpType::kAvg) divide_in_place(data, count, dt, size_);
}

WorkPtr GlooImpl::all_reduce(const TensorView& t, const ReduceOp& op, const OpContext& ctx) {
  (void)reduce_fn(op.type, t.dtype);  // reject unsupported combinations on the caller's thread
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    all_reduce_now(t.data, t.numel(), t.dtype, op, timeout, tag);
  });
}

WorkPtr GlooImpl::reduce(const TensorView& t, int root, const ReduceOp& op, const OpContext& ctx) {
  (void)reduce_fn(op.type, t.dtype);
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    const int64_t n = t.numel();
    if (op.type == RedOpType::kPremulSum) scale_in_place(t.data, n, t.dtype, op.factor);
    if (size_ > 1 && n > 0) {
      ::gloo::ReduceOptions o(context_);
      const size_t es = t.element_size();
      switch (es) {
        case 1:
          o.setInput(static_cast<uint8_t*>(t.data), n);
          o.setOutput(static_cast<uint8_t*>(t.data), n);
          break;
        case 2:
          o.setInput(static_cast<uint16_t*>(t.data), n);
          o.setOutput(static_cast<uint16_t*>(t.data), n);
          break;
        case 4:
          o.setInput(static_cast<uint32_t*>(t.data), n);
          o.setOutput(static_cast<uint32_t*>(t.data), n);
          break;
        default:
          o.setInput(static_cast<uint64_t*>(t.data), n);
          o.setOutput(static_cast<uint64_t*>(t.data), n);
          break;
      }
      o.setRoot(root);
      o.setReduceFunction(reduce_fn(op.type, t.dtype));
      o.setTag(tag);
      o.setTimeout(timeout);
      ::gloo::reduce(o);
    }
    if (op.type == RedOpType::kAvg && rank_ == root) divide_in_place(t.data, n, t.dtype, size_);
  });
}

WorkPtr GlooImpl::all_gather(const std::vector<TensorView>& outputs, const TensorView& input,
                             const OpContext& ctx) {
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    std::vector<size_t> counts(size_);
    size_t total = 0;
    for (int i = 0; i < size_; ++i) total += counts[i] = nbytes(outputs[i]);
    std::vector<uint8_t> gathered(total);
    if (size_ == 1) {
      std::memcpy(gathered.data(), bytes(input), counts[0]);
    } else if (total > 0) {
      ::gloo::AllgathervOptions o(context_);
      o.setInput(bytes(input), nbytes(input));
      o.setOutput(gathered.data(), counts);
      o.setTag(tag);
      o.setTimeout(timeout);
      ::gloo::allgatherv(o);
    }
    size_t off = 0;
    for (int i = 0; i < size_; ++i) {
      if (counts[i]) std::memcpy(bytes(outputs[i]), gathered.data() + off, counts[i]);
      off += counts[i];
    }
  });
}

WorkPtr GlooImpl::all_gather_single(const TensorView& output, const TensorView& input,
                                    const OpContext& ctx) {
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    if (size_ == 1 || input.nbytes() == 0) {
      if (input.nbytes()) std::memcpy(bytes(output), bytes(input), nbytes(input));
      return;
    }
    ::gloo::AllgathervOptions o(context_);
    o.setInput(bytes(input), nbytes(input));
    o.setOutput(bytes(output), std::vector<size_t>(size_, nbytes(input)));
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::allgatherv(o);
  });
}

WorkPtr GlooImpl::reduce_scatter(const TensorView& output, const std::vector<TensorView>& inputs,
                                 const ReduceOp& op, const OpContext& ctx) {
  (void)reduce_fn(op.type, output.dtype);
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    // Reduce the concatenation of every rank's inputs, keep this rank's slice.
    std::vector<size_t> offsets(size_ + 1, 0);
    for (int i = 0; i < size_; ++i) offsets[i + 1] = offsets[i] + nbytes(inputs[i]);
    std::vector<uint8_t> buf(offsets[size_]);
    for (int i = 0; i < size_; ++i)
      if (offsets[i + 1] > offsets[i])
        std::memcpy(buf.data() + offsets[i], bytes(inputs[i]), offsets[i + 1] - offsets[i]);
    const int64_t count = static_cast<int64_t>(buf.size() / output.element_size());
    all_reduce_now(buf.data(), count, output.dtype, op, timeout, tag);
    if (output.nbytes()) std::memcpy(bytes(output), buf.data() + offsets[rank_], nbytes(output));
  });
}

WorkPtr GlooImpl::reduce_scatter_single(const TensorView& output, const TensorView& input,
                                        const ReduceOp& op, const OpContext& ctx) {
  (void)reduce_fn(op.type, output.dtype);
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    std::vector<uint8_t> buf(bytes(input), bytes(input) + nbytes(input));
    all_reduce_now(buf.data(), input.numel(), input.dtype, op, timeout, tag);
    if (output.nbytes())
      std::memcpy(bytes(output), buf.data() + rank_ * nbytes(output), nbytes(output));
  });
}

WorkPtr GlooImpl::all_to_all_v_single(const TensorView& output, const TensorView& input,
                                      const std::vector<int64_t>& output_splits,
                                      const std::vector<int64_t>& input_splits,
                                      const OpContext& ctx) {
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    const int64_t in_row = input.row_bytes(), out_row = output.row_bytes();
    std::vector<int64_t> in_b(size_), out_b(size_);
    int64_t total = 0;
    for (int i = 0; i < size_; ++i) {
      in_b[i] = input_splits[i] * in_row;
      out_b[i] = output_splits[i] * out_row;
      total += in_b[i] + out_b[i];
    }
    if (size_ == 1) {
      if (in_b[0]) std::memcpy(bytes(output), bytes(input), static_cast<size_t>(in_b[0]));
      return;
    }
    // No early return when this rank moves nothing: Gloo's alltoallv exchanges (empty)
    // messages with every peer, and the peers wait for them.
    (void)total;
    const bool even =
        std::all_of(in_b.begin(), in_b.end(), [&](int64_t v) { return v == in_b[0]; }) &&
        std::all_of(out_b.begin(), out_b.end(), [&](int64_t v) { return v == in_b[0]; });
    if (even && in_b[0] > 0) {  // Gloo's plain alltoall skips the per-peer bookkeeping
      ::gloo::AlltoallOptions o(context_);
      o.setInput(bytes(input), static_cast<size_t>(in_b[0] * size_));
      o.setOutput(bytes(output), static_cast<size_t>(out_b[0] * size_));
      o.setTag(tag);
      o.setTimeout(timeout);
      ::gloo::alltoall(o);
      return;
    }
    ::gloo::AlltoallvOptions o(context_);
    o.setInput(bytes(input), in_b);
    o.setOutput(bytes(output), out_b);
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::alltoallv(o);
  });
}

WorkPtr GlooImpl::all_to_all(const std::vector<TensorView>& outputs,
                             const std::vector<TensorView>& inputs, const OpContext& ctx) {
  auto body = [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    std::vector<int64_t> in_b(size_), out_b(size_);
    int64_t in_total = 0, out_total = 0;
    for (int i = 0; i < size_; ++i) {
      in_total += in_b[i] = inputs[i].nbytes();
      out_total += out_b[i] = outputs[i].nbytes();
    }
    std::vector<uint8_t> send(static_cast<size_t>(in_total)), recv(static_cast<size_t>(out_total));
    int64_t off = 0;
    for (int i = 0; i < size_; ++i) {
      if (in_b[i]) std::memcpy(send.data() + off, bytes(inputs[i]), static_cast<size_t>(in_b[i]));
      off += in_b[i];
    }
    if (size_ == 1) {
      recv = send;
    } else {  // every rank takes part, even one that moves nothing (see all_to_all_v_single)
      ::gloo::AlltoallvOptions o(context_);
      o.setInput(send.data(), in_b);
      o.setOutput(recv.data(), out_b);
      o.setTag(tag);
      o.setTimeout(timeout);
      ::gloo::alltoallv(o);
    }
    off = 0;
    for (int i = 0; i < size_; ++i) {
      if (out_b[i])
        std::memcpy(bytes(outputs[i]), recv.data() + off, static_cast<size_t>(out_b[i]));
      off += out_b[i];
    }
  };
  return enqueue(ctx, std::move(body));
}

WorkPtr GlooImpl::barrier(const OpContext& ctx) {
  return enqueue(ctx, [this](std::chrono::milliseconds timeout, uint32_t tag) {
    if (size_ == 1) return;
    ::gloo::BarrierOptions o(context_);
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::barrier(o);
  });
}

WorkPtr GlooImpl::scatter(const TensorView& output, const std::vector<TensorView>& inputs, int root,
                          const OpContext& ctx) {
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    const size_t n = nbytes(output);
    if (size_ == 1 || n == 0) {
      if (n) std::memcpy(bytes(output), bytes(inputs[0]), n);
      return;
    }
    ::gloo::ScatterOptions o(context_);
    std::vector<uint8_t*> ptrs;
    if (rank_ == root) {
      for (const auto& t : inputs) ptrs.push_back(bytes(t));
      o.setInputs(ptrs, n);
    }
    o.setOutput(bytes(output), n);
    o.setRoot(root);
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::scatter(o);
  });
}

WorkPtr GlooImpl::gather(const std::vector<TensorView>& outputs, const TensorView& input, int root,
                         const OpContext& ctx) {
  return enqueue(ctx, [=, this](std::chrono::milliseconds timeout, uint32_t tag) {
    const size_t n = nbytes(input);
    if (size_ == 1 || n == 0) {
      if (n) std::memcpy(bytes(outputs[0]), bytes(input), n);
      return;
    }
    std::vector<uint8_t> all(rank_ == root ? n * size_ : 0);
    ::gloo::GatherOptions o(context_);
    o.setInput(bytes(input), n);
    if (rank_ == root) o.setOutput(all.data(), n * size_);
    o.setRoot(root);
    o.setTag(tag);
    o.setTimeout(timeout);
    ::gloo::gather(o);
    if (rank_ == root)
      for (int i = 0; i < size_; ++i) std::memcpy(bytes(outputs[i]), all.data() + i * n, n);
  });
}

void GlooImpl::abort() {
  std::deque<Task> dropped;
  std::shared_ptr<AsyncWork> running;
  std::vector<std::shared_ptr<AsyncWork>> p2p_works;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_.exchange(true)) return;
    dropped.swap(tasks_);
    running = running_;
    for (auto& t : p2p_tasks_) p2p_works.push_back(t.work);
    for (auto* buf : live_bufs_) {
      buf->abortWaitSend();
      buf->abortWaitRecv();
    }
  }
  const auto aborted = [](const std::string& prefix) {
    return std::make_exception_ptr(
        Error(ErrorCode::kAborted, prefix + "the communicator was aborted"));
  };
  for (auto& t : dropped) t.work->fail(aborted(t.prefix));
  if (running) running->fail(aborted(running_prefix_));
  for (auto& w : p2p_works) w->fail(aborted(""));
  // Break the running collective, if any: its waits fail once the connections are gone.
  try {
    context_->closeConnections();
  } catch (...) {
  }
  cv_.notify_all();
}

void GlooImpl::check_not_broken(const std::string& prefix) const {
  if (!broken_.empty()) std::rethrow_exception(broken_error(prefix, broken_));
}

void GlooImpl::on_io_error(const std::string& what) {
  std::vector<std::pair<std::shared_ptr<AsyncWork>, std::string>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty() || aborted_) return;
    broken_ = what;
    if (running_) failed.emplace_back(running_, running_prefix_);
    for (auto& t : tasks_)  // not finalize's marker (no fingerprint): finalize still returns
      if (t.fingerprint.op >= 0) failed.emplace_back(t.work, t.prefix);
    for (auto& t : p2p_tasks_)
      if (!t.bufs.empty()) failed.emplace_back(t.work, t.prefix);
    for (auto* buf : live_bufs_) {  // their waits end now (the works already failed)
      buf->abortWaitSend();
      buf->abortWaitRecv();
    }
  }
  for (auto& [work, prefix] : failed) work->fail(broken_error(prefix, what));
  // As abort() does: the collective in flight waits on a buffer no peer will fill, and would
  // hold the worker (and finalize) until its timeout; closed connections end it, and tell the
  // peers at once.
  try {
    context_->closeConnections();
  } catch (...) {
  }
  cv_.notify_all();
}

void GlooImpl::finalize() {
  // Drain both queues: a marker task on each completes after everything issued before it.
  auto coll = std::make_shared<AsyncWork>("finalize", Clock::time_point::max());
  auto p2p = std::make_shared<AsyncWork>("finalize", Clock::time_point::max());
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Nothing more can complete on a broken communicator (every op fails), and the collective
    // that broke it may hold the worker until its timeout: no drain.
    if (aborted_ || !broken_.empty()) return;
    tasks_.push_back(Task{[](std::chrono::milliseconds, uint32_t) {}, coll,
                          std::chrono::milliseconds(1), 0, "finalize"});
    P2PTask marker;
    marker.work = p2p;
    marker.deadline = Clock::now();
    p2p_tasks_.push_back(std::move(marker));
  }
  cv_.notify_all();
  coll->wait();
  p2p->wait();
}

// The Backend the factory hands out: a thin owner of the shared impl.
class GlooBackend : public ForwardingBackend<GlooImpl> {
 public:
  explicit GlooBackend(const BackendInit& init) : impl_(std::make_shared<GlooImpl>(init)) {
    impl_->start();
  }
  ~GlooBackend() override { impl_->shutdown(); }

  std::string name() const override { return "gloo"; }
  std::string version() const override { return "gloo 0.0~git20220518 (tcp)"; }
  Capabilities capabilities() const override {
    Capabilities c;
    for (int i = 0; i < static_cast<int>(OpKind::kCount); ++i) c.ops |= uint64_t{1} << i;
    c.cpu_tensors = true;
    return c;
  }
  bool checks_calls(const OpContext& ctx) const override { return impl_->checks(ctx); }
  std::unique_ptr<Backend> split(const std::vector<int>&, const BackendInit* init) override {
    // Members rendezvous afresh through the split's prefixed store; others do nothing.
    return init ? std::make_unique<GlooBackend>(*init) : nullptr;
  }

 protected:
  GlooImpl& target() const override { return *impl_; }

 private:
  std::shared_ptr<GlooImpl> impl_;
};

const StaticBackendRegistration kRegistration("gloo", [](const BackendInit& init) {
  return std::make_unique<GlooBackend>(init);
});

}  // namespace
}  // namespace fastcomms::gloo_backend
