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
#include "fastcomms/core/log.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/error.hpp"
#include "reduce_kernels.hpp"

namespace fastcomms::gloo_backend {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint8_t kP2PSlotPrefix = 0x40;    // above Gloo's own collective prefixes (0x01..0x08)
constexpr uint8_t kP2PHeaderPrefix = 0x41;  // NOTE [point-to-point header]
constexpr uint8_t kProbePrefix = 0x42;      // NOTE [mismatch probe]

// NOTE [call check modes]: FASTCOMMS_CHECK_CALLS (or the hint gloo.check_calls, else
// check_calls) is "0" (off), "1" (the default) or "strict".
// - default: nothing is added to a call's path but a hash. A collective's Gloo tag is its
//   sequence number mixed with a hash of its fingerprint (NOTE [fingerprint tags]), so ranks
//   that issued different collectives (op, dtype, count, root, reduction) address different
//   slots and no byte moves between them; a collective that has not finished after
//   kProbeAfter compares the ranks' calls beside it (NOTE [mismatch probe]) and a mismatch
//   raises on every waiting rank, naming each rank's call. Point-to-point messages carry a
//   header the receiver checks before it writes (NOTE [point-to-point header]). The forms whose
//   sizes differ per peer (the _v forms and the list all_to_all) without a caller's call key
//   run the strict check, whose sizes a fingerprint cannot hold.
// - strict: every collective's records are gathered before its data moves (NOTE [call check]),
//   one round trip per call.
// Every rank of a communicator must use the same mode (the tags and headers must agree).
using CheckMode = CallCheckMode;

// NOTE [fingerprint tags]: FNV-1a over the fingerprint (40 bytes, no padding), its lowest bit
// cleared so that the tag keeps the sequence number's parity (odd: ops; even: the strict check's
// gathers).
uint32_t fingerprint_hash(const CallFingerprint& f) {
  uint8_t b[sizeof f];
  std::memcpy(b, &f, sizeof f);
  uint32_t h = 2166136261u;
  for (uint8_t c : b) h = (h ^ c) * 16777619u;
  return h & ~1u;
}

bool sizes_per_peer(int32_t op) {
  switch (static_cast<OpKind>(op)) {
    case OpKind::kAllGatherV:
    case OpKind::kReduceScatterV:
    case OpKind::kAllToAllVSingle:
    case OpKind::kAllToAll:
      return true;
    default:
      return false;
  }
}

// NOTE [point-to-point header]: with the check on, every send is preceded by this fixed-size
// header on its own slot; the receiver's message lands in a staging buffer of the size it
// expects, and is copied to the caller's buffer only when the header matches its own receive, so
// a mismatch (dtype, a smaller message, the order) is an error on the receiving rank that names
// both sides and writes no byte there, and the sender's side completes. A message larger than
// the receive is refused by Gloo itself (NOTE [gloo I/O thread errors]: an error, and the
// communicator is broken). The cost: one copy of every received message.
struct P2PHeader {
  int64_t magic = 0;
  int64_t rank = -1;  // the sender
  int64_t seq = -1;   // the sender's count of sends to this peer
  int64_t nbytes = -1;
  int64_t dtype = -1;
};
constexpr int64_t kP2PMagic = 0x46434850;  // "FCHP"

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
    uint32_t tag;  // the op's Gloo tag (NOTE [fingerprint tags])
    std::string prefix;
    CallFingerprint fingerprint;
    // NOTE [per-peer sizes check]: bytes this rank sends to / expects from each peer (the _v
    // forms); empty when every rank's sizes follow from the fingerprint. They travel with the
    // fingerprint in check_call's one exchange.
    std::vector<int64_t> peer_out, peer_in;
    bool check = false;  // the strict check runs first (NOTE [call check modes])
    uint32_t base = 0;   // the sequence number every rank gives this collective
    bool probe = false;  // NOTE [mismatch probe]
  };
  struct P2PItem {
    std::unique_ptr<::gloo::transport::UnboundBuffer> buf;  // data
    bool send = false;
    std::unique_ptr<P2PHeader> header;  // NOTE [point-to-point header]
    std::unique_ptr<::gloo::transport::UnboundBuffer> header_buf;
    std::vector<uint8_t> staging;  // a checked receive lands here first
    TensorView tensor;
    int peer = -1;
    uint32_t seq = 0;
  };
  struct P2PTask {
    std::vector<P2PItem> bufs;
    // NOTE [self pairs in a batch]: (send, recv) views copied on the p2p thread when it runs
    std::vector<std::pair<TensorView, TensorView>> self_copies;
    std::shared_ptr<AsyncWork> work;
    Clock::time_point deadline;
    std::string prefix;
  };
  // The mode of one op: the op's hint, else the communicator's (NOTE [call check modes]).
  CheckMode op_mode(const OpContext& ctx) const;
  // A header-checked receive: waits for the header and the message (in staging), then copies it
  // to the caller's buffer, or returns the mismatch (empty: received).
  std::string receive_checked(P2PItem& item, Clock::time_point deadline, const std::string& prefix);
  void track(::gloo::transport::UnboundBuffer* b) {
    std::lock_guard<std::mutex> lock(mu_);
    live_bufs_.push_back(b);
  }
  void untrack(::gloo::transport::UnboundBuffer* b) {
    live_bufs_.erase(std::remove(live_bufs_.begin(), live_bufs_.end(), b), live_bufs_.end());
  }

  WorkPtr enqueue(const OpContext& ctx, Body body);
  void check_call(const Task& task);
  void collective_loop();
  void p2p_loop();
  void monitor_loop();  // NOTE [mismatch probe]
  // Compares this rank's record of the collective `base` with the peers' beside it; returns the
  // mismatch (empty: none found before the op ended or every peer's record agreed).
  std::string probe(uint32_t base, const std::vector<int64_t>& mine);
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
  // An op's error: the mismatch the probe found, which closed the connections under the op
  // (NOTE [mismatch probe]), else what Gloo said.
  std::exception_ptr failure(const std::string& prefix, std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mu_);
    return mismatch_.empty() ? translate(prefix, e) : mismatch_error(prefix);
  }
  std::exception_ptr mismatch_error(const std::string& prefix) const {  // mu_ held
    return std::make_exception_ptr(Error(ErrorCode::kInvalidArgument, prefix + mismatch_));
  }
  // A mismatch the probe found is the caller's error (NOTE [mismatch probe]); mu_ held.
  std::exception_ptr broken_error(const std::string& prefix, const std::string& what) const {
    if (!mismatch_.empty()) return mismatch_error(prefix);
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
  std::string broken_;                    // NOTE [gloo I/O thread errors]
  CheckMode mode_ = CheckMode::kDefault;  // NOTE [call check modes]
  std::thread collective_thread_, p2p_thread_, monitor_thread_;
  // NOTE [mismatch probe]: the running collective as the monitor sees it (mu_ held)
  bool running_probe_ = false;
  uint32_t running_base_ = 0, probed_base_ = 0;
  Clock::time_point running_since_;
  std::vector<int64_t> running_record_;
  std::string mismatch_;  // set by the probe: the running collective's ranks disagree
  std::chrono::milliseconds probe_after_{200};
  std::condition_variable monitor_cv_;
  std::chrono::milliseconds running_timeout_{0};
  // A probe's posted buffers: a peer that never probes the same call leaves its sends posted, so
  // they are kept (the last 64 probes'); where every peer answered, freed at the next probe.
  struct Probe {
    std::vector<std::unique_ptr<std::vector<int64_t>>> data;
    std::vector<std::unique_ptr<::gloo::transport::UnboundBuffer>> bufs;
    bool answered = false;
  };
  std::deque<Probe> probes_;
  std::vector<::gloo::transport::UnboundBuffer*> probe_waits_;  // the running probe's receives
};

GlooImpl::GlooImpl(const BackendInit& init)
    : rank_(init.rank), size_(init.size), send_seq_(init.size, 0), recv_seq_(init.size, 0) {
  // NOTE [gloo and SIGPIPE]: Gloo's TCP pairs write with writev, so a write to a peer that died
  // raises SIGPIPE, whose default action kills this process (seen: Gloo.PeerThatDiesFailsFast
  // died of SIGPIPE now and then). A dead peer must be an error on the waiting call, never a
  // process exit: where SIGPIPE still has its default action, it is ignored (Python does the
  // same at start-up, so Python processes see no change); a handler the application installed
  // is left alone.
  // NOTE [call check modes]: the default unless the hint gloo.check_calls (else check_calls, else
  // FASTCOMMS_CHECK_CALLS) says otherwise; the strict check costs one extra round trip per
  // collective (docs/benchmarks.md).
  {
    const char* e = std::getenv("FASTCOMMS_CHECK_CALLS");
    std::string v = e ? e : "1";
    for (const char* hint : {"check_calls", "gloo.check_calls"})  // the specific one wins
      if (auto h = init.options.hints.find(hint); h != init.options.hints.end()) v = h->second;
    FASTCOMMS_CHECK(parse_call_check_mode(v, &mode_), kInvalidArgument, "[rank ", init.rank, "/",
                    init.size, " ", init.options.name,
                    " new_comm] gloo: check_calls (hint gloo.check_calls or check_calls, "
                    "or FASTCOMMS_CHECK_CALLS) must be 0, 1 or strict, got '",
                    v, "'");
    if (auto h = init.options.hints.find("gloo.probe_after_ms"); h != init.options.hints.end())
      probe_after_ = std::chrono::milliseconds(std::stoll(h->second));
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
  if (mode_ != CheckMode::kOff && size_ > 1)
    monitor_thread_ = std::thread([self] { self->monitor_loop(); });
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
    for (auto* b : probe_waits_) b->abortWaitRecv();  // NOTE [mismatch probe]
  }
  cv_.notify_all();
  monitor_cv_.notify_all();
  for (std::thread* t : {&collective_thread_, &p2p_thread_, &monitor_thread_}) {
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

CheckMode GlooImpl::op_mode(const OpContext& ctx) const {
  return op_call_check_mode(ctx, mode_, {"gloo.check_calls", "check_calls"});
}

bool GlooImpl::checks(const OpContext& ctx) const {
  const CheckMode m = op_mode(ctx);
  if (m != CheckMode::kDefault) return m == CheckMode::kStrict;
  // NOTE [call check modes]: sizes per peer are not in the fingerprint; a caller's call key
  // (the Ulysses layer's geometry, which fixes them) is
  if (ctx.fingerprint.op < 0 || !sizes_per_peer(ctx.fingerprint.op) || ctx.fingerprint.key != 0)
    return false;
  if (ctx.hints != nullptr)  // the Ulysses layer's chunk headers carry its sizes
    if (auto h = ctx.hints->find("gloo.caller_checks_sizes"); h != ctx.hints->end())
      return h->second != "1";
  return true;
}

WorkPtr GlooImpl::enqueue(const OpContext& ctx, Body body) {
  auto work = new_work(ctx);
  const CheckMode mode = op_mode(ctx);
  const bool check = checks(ctx);
  {
    std::lock_guard<std::mutex> lock(mu_);
    FASTCOMMS_CHECK(!aborted_, kAborted, ctx.prefix, "the communicator was aborted");
    check_not_broken(ctx.prefix);
    // Two tags per collective: the op itself (odd) and the strict check's exchange (even).
    const uint32_t base = next_tag_;
    const bool hashed = mode != CheckMode::kOff && ctx.fingerprint.op >= 0;
    const uint32_t tag = hashed ? base ^ fingerprint_hash(ctx.fingerprint) : base;
    Task t{std::move(body), work,         ctx.timeout, tag,  ctx.prefix,
           ctx.fingerprint, ctx.peer_out, ctx.peer_in, check};
    t.base = base;
    t.probe = hashed && size_ > 1;
    tasks_.push_back(std::move(t));
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
  o.setTag(task.base + 1);
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
      running_probe_ = task.probe;
      running_base_ = task.base;
      running_since_ = Clock::now();
      running_timeout_ = task.timeout;
      if (task.probe)
        running_record_ = call_record(task.fingerprint, task.peer_out, task.peer_in, size_);
    }
    if (task.probe) monitor_cv_.notify_all();
    task.work->start();
    try {
      if (task.check) check_call(task);
      task.body(task.timeout, task.tag);
      task.work->complete();
    } catch (...) {
      task.work->fail(failure(task.prefix, std::current_exception()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (auto* b : probe_waits_) b->abortWaitRecv();  // NOTE [mismatch probe]: the op ended
    running_.reset();
    running_probe_ = false;
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
    std::string mismatch;
    try {
      const auto wait_left = [&](::gloo::transport::UnboundBuffer& b, bool send) {
        const auto left =
            std::chrono::duration_cast<std::chrono::milliseconds>(task.deadline - Clock::now());
        const auto t = std::max(left, std::chrono::milliseconds(1));
        const bool ok = send ? b.waitSend(t) : b.waitRecv(t);
        FASTCOMMS_CHECK(ok && !aborted_, kAborted, task.prefix, "the communicator was aborted");
      };
      for (const auto& [from, to] : task.self_copies)  // memmove: the two may overlap
        if (from.data != to.data) std::memmove(to.data, from.data, nbytes(to));
      for (auto& item : task.bufs) {
        if (item.send) {
          if (item.header_buf) wait_left(*item.header_buf, true);
          wait_left(*item.buf, true);
        } else if (item.header_buf) {
          // later items still run, so that every message of the batch is consumed in order
          if (auto m = receive_checked(item, task.deadline, task.prefix); mismatch.empty())
            mismatch = m;
        } else {
          wait_left(*item.buf, false);
        }
      }
      FASTCOMMS_CHECK(mismatch.empty(), kInvalidArgument, task.prefix, mismatch);
      task.work->complete();
    } catch (...) {
      task.work->fail(failure(task.prefix, std::current_exception()));
    }
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& item : task.bufs)
      for (auto* b : {item.buf.get(), item.header_buf.get()})
        if (b != nullptr) untrack(b);
  }
}

std::string GlooImpl::receive_checked(P2PItem& item, Clock::time_point deadline,
                                      const std::string& prefix) {
  const auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                    std::chrono::milliseconds(1));
  };
  FASTCOMMS_CHECK(item.header_buf->waitRecv(left()) && !aborted_, kAborted, prefix,
                  "the communicator was aborted");
  FASTCOMMS_CHECK(item.buf->waitRecv(left()) && !aborted_, kAborted, prefix,
                  "the communicator was aborted");
  const P2PHeader& h = *item.header;
  const int64_t want_bytes = static_cast<int64_t>(nbytes(item.tensor));
  const auto want_dtype = static_cast<int64_t>(item.tensor.dtype);
  const bool valid = h.magic == kP2PMagic && h.rank == item.peer && h.nbytes >= 0;
  FASTCOMMS_CHECK(valid, kBackendError, prefix, "rank ", item.peer,
                  " sent a malformed point-to-point header (a rank with FASTCOMMS_CHECK_CALLS=0 "
                  "among ranks with it on?)");
  if (h.nbytes == want_bytes && h.dtype == want_dtype && h.seq == static_cast<int64_t>(item.seq)) {
    if (want_bytes > 0) std::memcpy(item.tensor.data, item.staging.data(), item.staging.size());
    return {};
  }
  const auto what = [](int64_t bytes, int64_t dt) {
    const auto d = static_cast<DType>(dt);
    const int64_t es = static_cast<int64_t>(dtype_size(d));
    return detail::cat(bytes, " bytes of ", dtype_name(d), " (", es > 0 ? bytes / es : bytes,
                       " elements)");
  };
  return detail::cat("point-to-point mismatch: rank ", item.peer, "'s send #", h.seq,
                     " to this rank carries ", what(h.nbytes, h.dtype), "; this rank's recv #",
                     item.seq, " from rank ", item.peer, " expects ", what(want_bytes, want_dtype),
                     ". Nothing was written to the receive buffer. FASTCOMMS_CHECK_CALLS=0 turns "
                     "this check off");
}

// NOTE [mismatch probe]: with fingerprint tags (NOTE [fingerprint tags]) ranks that issued
// different collectives move no data: each waits for messages on a slot the others never use. A
// collective still running probe_after_ (200 ms; the hint gloo.probe_after_ms) after it started
// is probed: its rank posts its call record to every peer and receives theirs on a slot of its
// own (kProbePrefix, the collective's sequence number), beside the op. A record that differs
// from this rank's (the fingerprint, or the sizes a pair exchanges) is a mismatch: the probe
// records it (from then on every error of this communicator is the mismatch, closed connections
// included), waits up to two seconds for its own record to reach the peers still waiting (they
// probe once their call has run probe_after_), then fails the waiting op and every later one
// and closes the connections, as after an I/O error; the peers' probes find the same mismatch
// and raise it there. A rank whose call completed (a rooted op's rank that agreed with the root)
// never probes; its next call meets the closed connections. A slow op whose ranks agree is only
// slow: once every peer's record has come, the probe ends and the op goes on. Fast ops never
// probe: the default's cost is a hash per call.
void GlooImpl::monitor_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    monitor_cv_.wait(lock, [&] {
      return stop_ || aborted_ || (running_ && running_probe_ && probed_base_ != running_base_);
    });
    if (stop_ || aborted_) return;
    const uint32_t base = running_base_;
    const auto due = running_since_ + probe_after_;
    if (monitor_cv_.wait_until(
            lock, due, [&] { return stop_ || aborted_ || !running_ || running_base_ != base; }))
      continue;  // ended (or the next op runs) before it was due
    probed_base_ = base;
    const std::vector<int64_t> mine = running_record_;
    lock.unlock();
    std::string mismatch;
    try {
      mismatch = probe(base, mine);
    } catch (...) {  // the connections closed under the probe: the op reports why
      FASTCOMMS_LOG(kDebug, "[rank ", rank_, "/", size_,
                    "] gloo: the mismatch probe ended: ", log::current_exception_text());
    }
    lock.lock();
    if (!mismatch.empty() && running_ && running_base_ == base && !aborted_) {
      lock.unlock();
      // As after an I/O error (NOTE [gloo I/O thread errors]): the waiting op and every later
      // one fail now with the mismatch (Gloo's own wait ends only at its timeout, on the worker
      // thread), and the connections close so the peers' waits end too.
      on_io_error(mismatch);
      lock.lock();
    }
  }
}

std::string GlooImpl::probe(uint32_t base, const std::vector<int64_t>& mine) {
  // Gloo closes every connection when a wait times out, so the probe never waits with a short
  // timeout: it blocks until a record comes, and the worker aborts its waits when the op ends.
  const uint64_t slot = ::gloo::Slot::build(kProbePrefix, base);
  const size_t words = mine.size();
  std::vector<int> peers;
  for (int q = 0; q < size_; ++q)
    if (q != rank_) peers.push_back(q);
  Probe p;
  Clock::time_point deadline;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!running_ || running_base_ != base || aborted_) return {};
    deadline = running_since_ + running_timeout_;
    // the previous probe's buffers, where every peer answered it: its sends went out long ago
    if (!probes_.empty() && probes_.back().answered) probes_.pop_back();
    for (int q : peers) {
      p.data.push_back(std::make_unique<std::vector<int64_t>>(mine));
      p.bufs.push_back(
          context_->createUnboundBuffer(p.data.back()->data(), words * sizeof(int64_t)));
      p.bufs.back()->send(q, slot);
    }
    for (size_t i = 0; i < peers.size(); ++i) {  // each takes the next record from any peer
      p.data.push_back(std::make_unique<std::vector<int64_t>>(words, -1));
      p.bufs.push_back(
          context_->createUnboundBuffer(p.data.back()->data(), words * sizeof(int64_t)));
      p.bufs.back()->recv(peers, slot);
      live_bufs_.push_back(p.bufs.back().get());
      probe_waits_.push_back(p.bufs.back().get());
    }
  }
  const size_t fp_words = sizeof(CallFingerprint) / sizeof(int64_t);
  const auto fingerprint_of = [&](const int64_t* r) {
    CallFingerprint f;
    std::memcpy(static_cast<void*>(&f), r, sizeof f);
    return f;
  };
  std::string mismatch;
  size_t got = 0;
  for (size_t i = 0; i < peers.size() && mismatch.empty(); ++i) {
    auto& buf = *p.bufs[peers.size() + i];
    const std::vector<int64_t>& r = *p.data[peers.size() + i];
    int q = -1;
    try {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - Clock::now() + std::chrono::seconds(1));
      if (!buf.waitRecv(&q, std::max(left, std::chrono::milliseconds(1)))) break;  // op ended
    } catch (const ::gloo::IoException&) {  // the op timed out (or the connections closed)
      break;
    }
    ++got;
    if (!std::equal(r.begin(), r.begin() + fp_words, mine.begin())) {
      mismatch = detail::cat("ranks issued different collectives: this rank called ",
                             describe(fingerprint_of(mine.data())), ", rank ", q, " called ",
                             describe(fingerprint_of(r.data())),
                             " (nothing was moved: the default call check found it, NOTE "
                             "[mismatch probe]; this communicator cannot be used further)");
      break;
    }
    const int64_t sent = r[fp_words + rank_], expected = mine[fp_words + size_ + q];
    if (sent >= 0 && expected >= 0 && sent != expected)
      mismatch = detail::cat("ranks disagree on the per-peer sizes: rank ", q, " sends ", sent,
                             " bytes to this rank, which expects ", expected);
  }
  if (!mismatch.empty()) {
    {
      // from now on every error of this communicator is the mismatch, the connections that
      // close under the waits below included (broken_error)
      std::lock_guard<std::mutex> lock(mu_);
      if (running_ && running_base_ == base && !aborted_) mismatch_ = mismatch;
    }
    // Before the connections close, every peer still waiting in this call gets this rank's
    // record: it probes once its own call has run probe_after_ (its start may be later than
    // this rank's), and its receive completes this rank's send. A peer whose call completed
    // never receives it, so the wait is bounded (two seconds; a wait that times out closes the
    // connections, which comes next anyway). Then a moment for the peers to read it.
    const auto until = Clock::now() + std::chrono::seconds(2);
    for (size_t i = 0; i < peers.size(); ++i) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now());
      try {
        if (left.count() <= 0 || !p.bufs[i]->waitSend(left)) break;
      } catch (const ::gloo::IoException&) {
        break;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto* b : probe_waits_) untrack(b);
  probe_waits_.clear();
  p.answered = got == peers.size();
  probes_.push_back(std::move(p));  // a peer may still send into or receive from them
  // Bounded: a probe's buffers are dropped 64 probes later (probes run only for calls slower
  // than probe_after_, so the calls they belong to ended long before on every rank; Gloo holds
  // posted buffers through weak pointers, so a dropped one is never touched).
  while (probes_.size() > 64) probes_.pop_front();
  return mismatch;
}

WorkPtr GlooImpl::batch_p2p(const std::vector<P2POp>& ops, const OpContext& ctx) {
  auto work = new_work(ctx);
  P2PTask task;
  task.work = work;
  task.deadline = Clock::now() + ctx.timeout;
  task.prefix = ctx.prefix;
  // NOTE [point-to-point header]: the communicator's mode alone decides (both sides must agree)
  const bool header = mode_ != CheckMode::kOff && size_ > 1;
  std::lock_guard<std::mutex> lock(mu_);
  FASTCOMMS_CHECK(!aborted_, kAborted, ctx.prefix, "the communicator was aborted");
  check_not_broken(ctx.prefix);
  try {
    // NOTE [self pairs in a batch]: the k-th send to self goes into the k-th recv from self (the
    // communicator checked that they pair up); nothing crosses Gloo for them.
    std::vector<const P2POp*> self_sends, self_recvs;
    for (const P2POp& op : ops)
      if (op.peer == rank_)
        (op.kind == P2POp::Kind::kSend ? self_sends : self_recvs).push_back(&op);
    for (size_t k = 0; k < self_sends.size() && k < self_recvs.size(); ++k)
      task.self_copies.emplace_back(self_sends[k]->tensor, self_recvs[k]->tensor);
    for (const P2POp& op : ops) {
      if (op.peer == rank_) continue;
      P2PItem item;
      item.send = op.kind == P2POp::Kind::kSend;
      item.peer = op.peer;
      item.tensor = op.tensor;
      item.seq = item.send ? send_seq_[op.peer]++ : recv_seq_[op.peer]++;
      const uint64_t slot = ::gloo::Slot::build(kP2PSlotPrefix, item.seq);
      const uint64_t header_slot = ::gloo::Slot::build(kP2PHeaderPrefix, item.seq);
      if (header) {
        item.header = std::make_unique<P2PHeader>();
        if (item.send)
          *item.header = P2PHeader{kP2PMagic, rank_, static_cast<int64_t>(item.seq),
                                   static_cast<int64_t>(nbytes(op.tensor)),
                                   static_cast<int64_t>(op.tensor.dtype)};
        item.header_buf = context_->createUnboundBuffer(item.header.get(), sizeof(P2PHeader));
        if (item.send)
          item.header_buf->send(op.peer, header_slot);
        else
          item.header_buf->recv(op.peer, header_slot);
        live_bufs_.push_back(item.header_buf.get());
      }
      // NOTE [point-to-point header]: every buffer is posted now, as without the check (a
      // receive posted only once its header came could wait on a send that waits on it); a
      // checked receive lands in a staging buffer, copied to the caller's once the header matched
      void* dst = op.tensor.data;
      if (header && !item.send) {
        item.staging.resize(nbytes(op.tensor));
        dst = item.staging.data();
      }
      {
        item.buf = context_->createUnboundBuffer(dst, nbytes(op.tensor));
        if (item.send)
          item.buf->send(op.peer, slot);
        else
          item.buf->recv(op.peer, slot);
        live_bufs_.push_back(item.buf.get());
      }
      task.bufs.push_back(std::move(item));
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
  // NOTE [device factor]: a factor in memory is read here, when the op runs.
  if (op.type == RedOpType::kPremulSum)
    scale_in_place(data, count, dt,
                   op.has_factor_tensor() ? read_factor(op.factor_tensor) : op.factor);
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
    if (op.type == RedOpType::kPremulSum)
      scale_in_place(t.data, n, t.dtype,
                     op.has_factor_tensor() ? read_factor(op.factor_tensor) : op.factor);
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
  } catch (...) {  // the abort goes on: the works already failed
    FASTCOMMS_LOG(kDebug, "[rank ", rank_, "/", size_,
                  "] gloo abort: closing the connections failed: ", log::current_exception_text());
  }
  cv_.notify_all();
}

void GlooImpl::check_not_broken(const std::string& prefix) const {
  if (!broken_.empty()) std::rethrow_exception(broken_error(prefix, broken_));
}

void GlooImpl::on_io_error(const std::string& what) {
  // (the errors are made under the lock, where broken_error reads a mismatch the probe found)
  std::vector<std::pair<std::shared_ptr<AsyncWork>, std::exception_ptr>> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!broken_.empty() || aborted_) return;
    broken_ = what;
    if (running_) failed.emplace_back(running_, broken_error(running_prefix_, what));
    for (auto& t : tasks_)  // not finalize's marker (no fingerprint): finalize still returns
      if (t.fingerprint.op >= 0) failed.emplace_back(t.work, broken_error(t.prefix, what));
    for (auto& t : p2p_tasks_)
      if (!t.bufs.empty()) failed.emplace_back(t.work, broken_error(t.prefix, what));
    for (auto* buf : live_bufs_) {  // their waits end now (the works already failed)
      buf->abortWaitSend();
      buf->abortWaitRecv();
    }
  }
  for (auto& [work, error] : failed) work->fail(error);
  // As abort() does: the collective in flight waits on a buffer no peer will fill, and would
  // hold the worker (and finalize) until its timeout; closed connections end it, and tell the
  // peers at once.
  try {
    context_->closeConnections();
  } catch (...) {  // the works already failed with the reason
    FASTCOMMS_LOG(kDebug, "[rank ", rank_, "/", size_,
                  "] gloo: closing the connections after an I/O error failed: ",
                  log::current_exception_text());
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
  std::unique_ptr<Backend> split(const std::vector<int>&, const std::string&,
                                 const BackendInit* init) override {
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
