// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/communicator.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <map>
#include <optional>
#include <string_view>
#include <type_traits>

#include "fastcomms/core/auth_store.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/log.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

struct Communicator::Hooks {
  std::mutex mu;
  uint64_t next_id = 1;
  std::map<uint64_t, PreHook> pre;
  std::map<uint64_t, PostHook> post;
  std::map<uint64_t, AbortHook> abort;
  std::map<uint64_t, ErrorHook> error;
  /// The hooks an op runs: those registered when it starts (copies, so they run without the
  /// lock; one lock, and no allocation where none is registered).
  struct Now {
    std::vector<PreHook> pre;
    std::vector<PostHook> post;
    std::vector<ErrorHook> error;
  };
  Now now() {
    Now n;
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [id, fn] : pre) n.pre.push_back(fn);
    for (auto& [id, fn] : post) n.post.push_back(fn);
    for (auto& [id, fn] : error) n.error.push_back(fn);
    return n;
  }
  std::vector<AbortHook> abort_hooks() {
    std::lock_guard<std::mutex> lock(mu);
    std::vector<AbortHook> fns;
    for (auto& [id, fn] : abort) fns.push_back(fn);
    return fns;
  }
};

uint64_t next_op_id() {
  static std::atomic<uint64_t> next{1};  // NOTE [op ids]
  return next.fetch_add(1, std::memory_order_relaxed);
}

template <typename Body>
auto Communicator::hooked(OpInfo info, Body&& body) {
  const Hooks::Now hooks = hooks_->now();
  for (auto& fn : hooks.pre) fn(info);
  using Result = decltype(body());
  Result result{};
  if (hooks.error.empty()) {
    result = body();
  } else {
    try {
      result = body();
    } catch (...) {
      // The hooks see the op's Error, or another exception (a backend written in Python raises
      // its own) as a backend error, so what they opened for the op is closed; the caller gets
      // the exception as it was raised.
      const std::exception_ptr raised = std::current_exception();
      std::optional<Error> seen;
      try {
        std::rethrow_exception(raised);
      } catch (const Error& e) {
        seen.emplace(e);
      } catch (...) {
        seen.emplace(ErrorCode::kBackendError,
                     detail::cat(prefix(info.op), log::current_exception_text()));
      }
      for (auto& fn : hooks.error) {
        try {
          fn(info, *seen);
        } catch (...) {  // the op's own error is the one the caller gets
          FASTCOMMS_LOG(kError, prefix(info.op),
                        "an error hook raised: ", log::current_exception_text());
        }
      }
      std::rethrow_exception(raised);
    }
  }
  if (hooks.post.empty()) return result;
  if constexpr (std::is_same_v<Result, WorkPtr>) info.work = result;
  if constexpr (std::is_same_v<Result, std::shared_ptr<Communicator>>) info.new_comm = &result;
  for (auto& fn : hooks.post) fn(info);
  return result;
}

namespace {
// NOTE [hook op record]: what hooks are told of an op's tensors and arguments.
std::span<const TensorView> one(const TensorView& t) { return {&t, 1}; }
OpInfo record(std::span<const TensorView> in, std::span<const TensorView> out, int peer = -1,
              const ReduceOp* r = nullptr) {
  OpInfo i{};
  i.inputs = in;
  i.outputs = out;
  i.peer = peer;
  i.reduce = r;
  return i;
}
}  // namespace

namespace {
// NOTE [authenticated rendezvous]: every rank says whether it authenticates; each rank reads rank
// 0's word (rank 0 the last rank's), so a rank whose setting differs gets a clear error here
// instead of a garbled address later.
void check_same_authentication(Store& store, bool mine, int rank, int size,
                               std::chrono::milliseconds timeout, const std::string& where) {
  store.set_string(detail::cat("auth/", rank), mine ? "hmac-sha256" : "none");
  if (size == 1) return;
  const int peer = rank == 0 ? size - 1 : 0;
  const std::string key = detail::cat("auth/", peer);
  if (mine) {
    try {
      (void)store.get(key, timeout);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kInvalidArgument) throw;
      throw Error(
          ErrorCode::kInvalidArgument,
          detail::cat(where, "rank ", peer, " does not use this rank's FASTCOMMS_STORE_TOKEN",
                      " (it has none or another one): ", e.what()));
    }
    return;
  }
  const auto v = store.get(key, timeout);
  FASTCOMMS_CHECK(!looks_sealed(v), kInvalidArgument, where, "rank ", peer,
                  " authenticates the rendezvous with FASTCOMMS_STORE_TOKEN and this rank has no "
                  "token: set the same secret on every rank");
}

// NOTE [roll call]: the rank and size a process was given come from its launcher's environment
// (or the caller); two processes given the same rank, or ranks given different sizes, would
// otherwise meet in the rendezvous and wait there until the timeout (or pair up wrongly). Each
// rank claims its number (the second claim is refused at once) and says its size; each rank
// reads rank 0's word (rank 0 rank 1's), so both sides of a size mismatch name both sizes.
void roll_call(Store& store, int rank, int size, std::chrono::milliseconds timeout,
               const std::string& where) {
  const int64_t claims = store.add(detail::cat("world/", rank, "/claims"), 1);
  FASTCOMMS_CHECK(claims == 1, kInvalidArgument, where, "another process also took rank ", rank,
                  " of this communicator (", claims,
                  " claims): every process needs its own rank (RANK, TORCHCOMM_RANK, "
                  "SLURM_PROCID, OMPI_COMM_WORLD_RANK, or new_comm's caller)");
  store.set_string(detail::cat("world/", rank), std::to_string(size));
  if (size == 1) return;
  const int peer = rank == 0 ? 1 : 0;
  const auto v = store.get(detail::cat("world/", peer), timeout);
  const std::string theirs(v.begin(), v.end());
  FASTCOMMS_CHECK(theirs == std::to_string(size), kInvalidArgument, where, "rank ", peer,
                  " was started with a world of ", theirs, " ranks and this rank with ", size,
                  ": every rank needs the same size (WORLD_SIZE, TORCHCOMM_SIZE, SLURM_NTASKS, "
                  "OMPI_COMM_WORLD_SIZE, or new_comm's caller)");
}
}  // namespace

std::shared_ptr<Store> Communicator::join_key_space(CommOptions& options, int rank, int size,
                                                    const std::string& where) {
  FASTCOMMS_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, where,
                  "rank must be in [0, size) with size >= 1, got rank ", rank, " and size ", size);
  // NOTE [authenticated rendezvous]: with a shared secret every value this communicator (and its
  // splits) reads from the store is authenticated.
  bool authenticated = std::dynamic_pointer_cast<AuthStore>(options.store) != nullptr;
  if (const auto secret = store_token_from_env(); secret && !authenticated) {
    options.store = std::make_shared<AuthStore>(options.store, *secret);
    authenticated = true;
  }
  // NOTE [store incarnations]: every communicator gets its own key space in the store, and so
  // does every incarnation of a name: a name reused on the same store after finalize() must not
  // read the keys its predecessor left (a rendezvous against a dead rank's address, a call
  // check's old verdict). Each rank takes a ticket; the tickets of one incarnation are size
  // consecutive numbers, all taken before any rank leaves this function (the count of ranks
  // that joined, below: a rank needs it before it can start the next incarnation), so
  // (ticket - 1) / size numbers the incarnation alike on every rank. The roll call alone would
  // not do: it reads rank 0's word (rank 0 rank 1's), so with 4 ranks rank 1 could finalize and
  // take a ticket of the next incarnation before rank 2 took one of this. A built-in backend's
  // rendezvous waits for every rank anyway; a backend written in Python may have none.
  const std::string base = "fastcomms/" + options.name;
  const int64_t ticket = options.store->add(base + "/incarnations", 1);
  // NOTE [store keys released at finalize]: the incarnation's key space remembers what it wrote.
  std::shared_ptr<Store> keys = std::make_shared<KeyTrackingStore>(
      std::make_shared<PrefixStore>(detail::cat(base, "/", (ticket - 1) / size), options.store));
  check_same_authentication(*keys, authenticated, rank, size, options.timeout, where);
  roll_call(*keys, rank, size, options.timeout, where);
  if (size > 1) {  // every rank took its ticket: the last to join says so
    if (keys->add("joined", 1) == size) keys->set_string("joined/all", "1");
    try {
      (void)keys->get("joined/all", options.timeout);
    } catch (const Error& e) {
      throw Error(e.code(),
                  detail::cat(where, "not every rank of ", size, " joined the rendezvous within ",
                              options.timeout.count(), " ms: ", e.what()));
    }
  }
  return keys;
}

std::shared_ptr<Communicator> Communicator::create(const std::string& backend_name, int rank,
                                                   int size, Device device, CommOptions options) {
  const std::string where =
      detail::cat("[rank ", rank, "/", size, " ", options.name, "] new_comm: ");
  FASTCOMMS_CHECK(size >= 1, kInvalidArgument, where, "size must be >= 1, got ", size);
  FASTCOMMS_CHECK(rank >= 0 && rank < size, kInvalidArgument, where, "rank must be in [0, ", size,
                  "), got ", rank);
  FASTCOMMS_CHECK(options.store != nullptr, kInvalidArgument, where, "a store is required");
  FASTCOMMS_CHECK(options.timeout.count() > 0, kInvalidArgument, where,
                  "timeout must be positive, got ", options.timeout.count(), " ms");
  if (options.name.empty()) options.name = "comm";
  BackendInit init{rank, size, device, options};
  // An unknown backend fails with the factory's message before the store is touched.
  try {
    require_backend_known(backend_name);
  } catch (const Error& e) {
    throw Error(e.code(), where + e.what());
  }
  init.options.store = join_key_space(options, rank, size, where);
  auto backend = create_backend(backend_name, init);
  return std::make_shared<Communicator>(std::move(backend), rank, size, device, std::move(options),
                                        init.options.store, init.process_abort);
}

Communicator::Communicator(std::unique_ptr<Backend> backend, int rank, int size, Device device,
                           CommOptions options, std::shared_ptr<Store> key_space,
                           std::shared_ptr<ProcessAbort> process_abort)
    : backend_(std::move(backend)),
      rank_(rank),
      size_(size),
      device_(device),
      options_(std::move(options)),
      hooks_(std::make_shared<Hooks>()),
      process_abort_(process_abort ? std::move(process_abort) : std::make_shared<ProcessAbort>()) {
  if (options_.name.empty()) options_.name = "comm";
  key_space_ = key_space ? std::move(key_space) : options_.store;
  // NOTE [call check]: the check through the store runs with "strict" (the hint check_calls,
  // else FASTCOMMS_CHECK_CALLS); "1" (the default) and "0" leave it to the backend (gloo's
  // default checks: NOTE [call check modes] in backends/gloo/gloo_backend.cpp; nccl's and
  // nvlink's: NOTE [nccl call check] in backends/nccl/call_checker.hpp).
  {
    const char* e = std::getenv("FASTCOMMS_CHECK_CALLS");
    std::string v = e ? e : "1";
    if (auto h = options_.hints.find("check_calls"); h != options_.hints.end()) v = h->second;
    CallCheckMode mode = CallCheckMode::kDefault;
    FASTCOMMS_CHECK(parse_call_check_mode(v, &mode), kInvalidArgument, "[rank ", rank_, "/", size_,
                    " ", options_.name,
                    " new_comm] check_calls (hint check_calls or FASTCOMMS_CHECK_CALLS) must be "
                    "0, 1 or strict, got '",
                    v, "'");
    check_calls_ = mode == CallCheckMode::kStrict;
  }
  // NOTE [process abort]: the hooks a process abort runs, also one the backend starts.
  process_abort_->set_hooks([hooks = hooks_] {
    for (auto& fn : hooks->abort_hooks()) {
      try {
        fn();
      } catch (...) {  // a failing hook must not stop the others or the abort
        FASTCOMMS_LOG(kError, "an abort hook raised: ", log::current_exception_text());
      }
    }
  });
}

Communicator::~Communicator() = default;

std::string Communicator::prefix(OpKind op) const {
  return detail::cat("[rank ", rank_, "/", size_, " ", options_.name, " ", op_name(op), "] ");
}

void Communicator::set_timeout(std::chrono::milliseconds t) {
  FASTCOMMS_CHECK(t.count() > 0, kInvalidArgument, "[rank ", rank_, "/", size_, " ", options_.name,
                  "] set_timeout: timeout must be positive, got ", t.count(), " ms");
  options_.timeout = t;
}

void Communicator::set_hints(const Hints& hints) {
  for (const auto& [k, v] : hints) options_.hints[k] = v;
}

void Communicator::abort() {
  if (aborted_.exchange(true)) return;
  for (auto& fn : hooks_->abort_hooks()) fn();
  backend_->abort();
}

void Communicator::finalize(const void* frontend) {
  OpInfo rec{OpKind::kFinalize, 0, false, nullptr};
  rec.frontend = frontend;
  hooked(std::move(rec), [&] {
    if (finalized_.exchange(true) || aborted_) return false;
    backend_->finalize();
    // NOTE [store keys released at finalize]
    if (auto* keys = dynamic_cast<KeyTrackingStore*>(key_space_.get()))
      keys->release(rank_, size_, std::min(options_.timeout, std::chrono::milliseconds(10'000)));
    return true;
  });
}

void Communicator::tensor_register(const TensorView& t) {
  const std::string where =
      detail::cat("[rank ", rank_, "/", size_, " ", name(), " tensor_register] ");
  FASTCOMMS_CHECK(!aborted_, kAborted, where, "the communicator was aborted");
  FASTCOMMS_CHECK(!finalized_, kInvalidArgument, where, "the communicator was finalized");
  FASTCOMMS_CHECK(t.device == device_, kInvalidArgument, where, "the tensor must be on ",
                  device_.str(), " (the communicator's device), got ", t.device.str());
  FASTCOMMS_CHECK(t.data != nullptr && t.nbytes() > 0, kInvalidArgument, where,
                  "needs a non-empty tensor");
  backend_->register_memory(t.data, t.nbytes(), where);
}

void Communicator::tensor_deregister(const TensorView& t) {
  const std::string where =
      detail::cat("[rank ", rank_, "/", size_, " ", name(), " tensor_deregister] ");
  FASTCOMMS_CHECK(!aborted_, kAborted, where, "the communicator was aborted");
  FASTCOMMS_CHECK(!finalized_, kInvalidArgument, where, "the communicator was finalized");
  backend_->deregister_memory(t.data, where);
}

std::shared_ptr<Window> Communicator::new_window(const void* frontend) {
  const std::string where = detail::cat("[rank ", rank_, "/", size_, " ", name(), " new_window] ");
  FASTCOMMS_CHECK(!aborted_, kAborted, where, "the communicator was aborted");
  FASTCOMMS_CHECK(!finalized_, kInvalidArgument, where, "the communicator was finalized");
  FASTCOMMS_CHECK(backend_->supports_window(), kUnsupported, where, "backend '", backend_->name(),
                  "' has no windows (the nvlink and nccl backends have them)");
  OpContext ctx;
  ctx.op = OpKind::kNewWindow;
  ctx.op_id = next_op_id();
  ctx.timeout = options_.timeout;
  ctx.prefix = where;
  OpInfo rec{ctx.op, ctx.op_id, false, nullptr};
  rec.frontend = frontend;
  return hooked(std::move(rec), [&] { return backend_->new_window(ctx); });
}

// NOTE [persistent all-gather]
std::shared_ptr<AllGatherP> Communicator::all_gather_p_init(const TensorView& output,
                                                            const CallOptions& o) {
  const std::string where =
      detail::cat("[rank ", rank_, "/", size_, " ", name(), " all_gather_p_init] ");
  const OpKind op = OpKind::kAllGatherSingle;
  FASTCOMMS_CHECK(!aborted_, kAborted, where, "the communicator was aborted");
  FASTCOMMS_CHECK(!finalized_, kInvalidArgument, where, "the communicator was finalized");
  FASTCOMMS_CHECK(o.options.timeout.count() >= 0, kInvalidArgument, where,
                  "timeout must be positive, got ", o.options.timeout.count(), " ms");
  FASTCOMMS_CHECK(output.data != nullptr || output.numel() == 0, kInvalidArgument, where,
                  "output has no data");
  FASTCOMMS_CHECK(output.is_contiguous(), kInvalidArgument, where,
                  "output must be contiguous, got ", output.describe(), " with non-dense strides");
  FASTCOMMS_CHECK(output.device == device_, kInvalidArgument, where, "output must be on ",
                  device_.str(), " (the communicator's device), got ", output.device.str());
  FASTCOMMS_CHECK(output.numel() % size_ == 0, kInvalidArgument, where, "output has ",
                  output.numel(), " elements, expected a multiple of the size ", size_,
                  " (size * the input's elements)");
  check_usable(op);
  check_tensor(op, "output", output);
  auto h = std::make_shared<AllGatherP>();
  h->output_ = output;
  h->owner_ = this;
  if (output.nbytes() > 0) {
    // Registered once here, so exec registers nothing; a backend without registration (gloo)
    // gathers into the buffer as it is, and memory the caller registered stays the caller's.
    try {
      backend_->register_memory(output.data, output.nbytes(), where);
      h->registered_ = true;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kUnsupported && e.code() != ErrorCode::kInvalidArgument) throw;
      if (e.code() == ErrorCode::kInvalidArgument &&
          std::string_view(e.what()).find("registered already") == std::string_view::npos)
        throw;
    }
  }
  return h;
}

WorkPtr Communicator::all_gather_p_exec(AllGatherP& h, const TensorView& input,
                                        const CallOptions& o) {
  const std::string where =
      detail::cat("[rank ", rank_, "/", size_, " ", name(), " all_gather_p_exec] ");
  FASTCOMMS_CHECK(h.owner_ == this, kInvalidArgument, where,
                  "the handle was made by another communicator's all_gather_p_init");
  FASTCOMMS_CHECK(!h.freed(), kInvalidArgument, where,
                  "the handle was freed by all_gather_p_free; call all_gather_p_init again");
  const TensorView& output = h.output_;
  FASTCOMMS_CHECK(input.device == device_, kInvalidArgument, where, "input must be on ",
                  device_.str(), " (the communicator's device), got ", input.device.str());
  FASTCOMMS_CHECK(input.dtype == output.dtype, kTypeError, where, "input has dtype ",
                  dtype_name(input.dtype), ", expected the handle's output dtype ",
                  dtype_name(output.dtype));
  FASTCOMMS_CHECK(output.numel() == input.numel() * size_, kInvalidArgument, where, "input has ",
                  input.numel(), " elements, expected the handle's output ", output.numel(),
                  " / size ", size_, " = ", output.numel() / size_);
  return all_gather_single_as(OpKind::kAllGatherPExec, output, input, o);
}

void Communicator::all_gather_p_free(AllGatherP& h) {
  const std::string where =
      detail::cat("[rank ", rank_, "/", size_, " ", name(), " all_gather_p_free] ");
  FASTCOMMS_CHECK(h.owner_ == this, kInvalidArgument, where,
                  "the handle was made by another communicator's all_gather_p_init");
  if (h.freed_.exchange(true)) return;
  if (h.registered_ && !aborted_ && !finalized_) backend_->deregister_memory(h.output_.data, where);
  h.registered_ = false;
}

std::shared_ptr<void> Communicator::lend(const std::string& what) {
  if (aborted_ || finalized_) return nullptr;
  return backend_->lend(what);
}

void Communicator::check_usable(OpKind op) const {
  FASTCOMMS_CHECK(!aborted_, kAborted, prefix(op), "the communicator was aborted");
  FASTCOMMS_CHECK(!finalized_, kInvalidArgument, prefix(op), "the communicator was finalized");
  FASTCOMMS_CHECK(backend_->capabilities().supports(op), kUnsupported, prefix(op), "backend '",
                  backend_->name(), "' does not support ", op_name(op));
}

void Communicator::check_peer(OpKind op, const char* arg, int peer, bool allow_self) const {
  FASTCOMMS_CHECK(peer >= 0 && peer < size_, kInvalidArgument, prefix(op), arg, " must be in [0, ",
                  size_, "), got ", peer);
  FASTCOMMS_CHECK(allow_self || peer != rank_, kInvalidArgument, prefix(op), arg,
                  " must not be this rank (", rank_, ")");
}

void Communicator::check_tensor(OpKind op, const char* arg, const TensorView& t) const {
  FASTCOMMS_CHECK(t.data != nullptr || t.numel() == 0, kInvalidArgument, prefix(op), arg,
                  " has no data");
  FASTCOMMS_CHECK(t.is_contiguous(), kInvalidArgument, prefix(op), arg, " must be contiguous, got ",
                  t.describe(), " with non-dense strides");
  const Capabilities caps = backend_->capabilities();
  const bool ok = t.device.type == DeviceType::kCPU ? caps.cpu_tensors : caps.cuda_tensors;
  FASTCOMMS_CHECK(ok, kInvalidArgument, prefix(op), arg, " is on ", t.device.str(),
                  ", which backend '", backend_->name(), "' does not serve");
}

void Communicator::check_same_dtype(OpKind op, const char* arg, const TensorView& t,
                                    DType want) const {
  FASTCOMMS_CHECK(t.dtype == want, kTypeError, prefix(op), arg, " has dtype ", dtype_name(t.dtype),
                  ", expected ", dtype_name(want));
}

void Communicator::check_reduce(OpKind op, const ReduceOp& r, const TensorView& t) const {
  const DType dt = t.dtype;
  const bool bitwise =
      r.type == RedOpType::kBand || r.type == RedOpType::kBor || r.type == RedOpType::kBxor;
  FASTCOMMS_CHECK(!bitwise || dtype_is_integral(dt), kTypeError, prefix(op), red_op_name(r.type),
                  " needs an integer or bool tensor, got ", dtype_name(dt));
  FASTCOMMS_CHECK(dt != DType::kFloat8E4M3FN && dt != DType::kFloat8E5M2, kUnsupported, prefix(op),
                  "reductions on ", dtype_name(dt), " are not supported");
  FASTCOMMS_CHECK(r.type != RedOpType::kPremulSum || !dtype_is_integral(dt), kTypeError, prefix(op),
                  "PREMUL_SUM needs a floating-point tensor, got ", dtype_name(dt));
  // AVG on integers is the sum divided by the world size, truncated toward zero, as torchcomms
  // does (NCCL's ncclAvg on an integer type; its gloo backend's div_(size, "trunc")).
  FASTCOMMS_CHECK(
      dt != DType::kBool || bitwise || r.type == RedOpType::kMin || r.type == RedOpType::kMax,
      kTypeError, prefix(op), red_op_name(r.type), " is not defined on bool tensors");
  if (!r.has_factor_tensor()) return;
  // NOTE [device factor]: one element where the op runs, in the tensor's dtype. Refused rather
  // than read wrongly: NCCL reads the scalar in the reduction's type at the address given, so
  // another dtype would be reinterpreted bits, and a host address on a CUDA op a fault.
  const TensorView& f = r.factor_tensor;
  FASTCOMMS_CHECK(f.numel() == 1, kInvalidArgument, prefix(op),
                  "PREMUL_SUM's factor tensor must hold one element, got ", f.describe());
  FASTCOMMS_CHECK(f.device == t.device, kInvalidArgument, prefix(op),
                  "PREMUL_SUM's factor tensor is on ", f.device.str(), ", expected ",
                  t.device.str(), " (the reduced tensor's device)");
  FASTCOMMS_CHECK(f.dtype == dt, kTypeError, prefix(op), "PREMUL_SUM's factor tensor has dtype ",
                  dtype_name(f.dtype), ", expected ", dtype_name(dt),
                  " (the reduced tensor's; the Python binding casts a floating-point factor)");
}

namespace {
// A collective's fingerprint (NOTE [call fingerprint]); op is filled in by run().
CallFingerprint fingerprint(DType dt, int64_t count, int root = -1, const ReduceOp* r = nullptr) {
  CallFingerprint f;
  f.dtype = static_cast<int32_t>(dt);
  f.count = count;
  f.root = root;
  if (r != nullptr) {
    f.reduce = static_cast<int32_t>(r->type);
    // NOTE [device factor]: a factor in memory is "factor unknown" here (0 bits, as 0.0): the
    // check would have to read it on the host, a sync. Ranks that mix a host factor other than
    // 0.0 with a factor in memory are reported as a mismatch.
    if (r->type == RedOpType::kPremulSum && !r->has_factor_tensor())
      std::memcpy(&f.factor_bits, &r->factor, 8);
  }
  return f;
}
}  // namespace

bool Communicator::wants_check(const CallOptions& o) const {
  if (auto h = o.options.hints.find("check_calls"); h != o.options.hints.end())
    return h->second == "strict";
  return check_calls_;
}

// NOTE [call check] through the store: for the n-th checked collective every rank but 0 writes
// its record under calls/<n>/<rank> in this communicator's key space; rank 0 reads them (waiting
// up to the op's timeout), compares them as the in-band check does, deletes them and publishes
// the verdict under calls/<n>/verdict, which the others read: every rank raises the same error
// (or none) before data moves, and the store serves a write, a read and a delete per rank per
// call, not a read per pair of ranks. A rank deletes its record once it has the verdict (rank 0
// read it before publishing); a rank that wrote record n + 1 has read verdict n, so rank 0,
// holding every record of n + 1, deletes verdict n: the store holds at most one record per rank
// and two verdicts, whatever the number of calls. A rank that does not come within the timeout
// (it issued a point-to-point op, another number of collectives, or nothing) ends the check:
// rank 0 names it in the verdict, and since the sequences no longer line up every later
// checked call raises instead of comparing the wrong calls. The cost is a store round trip or
// two per call on every rank and one per peer on rank 0 (docs/benchmarks.md): a debugging aid,
// off by default.
void Communicator::check_through_store(const OpContext& ctx) {
  FASTCOMMS_CHECK(check_broken_.empty(), kBackendError, ctx.prefix,
                  "the call check cannot go on: ", check_broken_);
  const uint64_t n = ++check_seq_;
  const auto record_key = [](uint64_t seq, int r) { return detail::cat("calls/", seq, "/", r); };
  const auto verdict_key = [](uint64_t seq) { return detail::cat("calls/", seq, "/verdict"); };
  const std::vector<int64_t> mine = call_record(ctx.fingerprint, ctx.peer_out, ctx.peer_in, size_);
  const size_t bytes = mine.size() * sizeof(int64_t);
  // A verdict: 'o' (the calls agree), 'm' + the mismatch, or 't' + which rank did not come.
  const auto publish = [&](char kind, const std::string& text) {
    std::vector<uint8_t> v(1 + text.size());
    v[0] = static_cast<uint8_t>(kind);
    std::memcpy(v.data() + 1, text.data(), text.size());
    key_space_->set(verdict_key(n), v);
  };
  if (rank_ != 0) {
    std::vector<uint8_t> v(bytes);
    std::memcpy(v.data(), mine.data(), bytes);
    key_space_->set(record_key(n, rank_), v);
    std::vector<uint8_t> verdict;
    try {
      verdict = key_space_->get(verdict_key(n), ctx.timeout);
    } catch (const Error& e) {
      check_broken_ = detail::cat("rank 0 did not publish the check of collective #", n);
      throw Error(e.code(),
                  detail::cat(ctx.prefix,
                              "call check: rank 0 did not publish the check "
                              "of this rank's checked collective #",
                              n, " (", describe(ctx.fingerprint), ") within ", ctx.timeout.count(),
                              " ms: some rank did not issue it, or rank 0 runs without "
                              "the call check (",
                              e.what(), ")"));
    }
    // Rank 0 read the record before it published the verdict. Each rank deletes its own keys,
    // so its key space forgets them too (NOTE [store keys released at finalize]).
    key_space_->delete_key(record_key(n, rank_));
    FASTCOMMS_CHECK(!verdict.empty(), kInternal, ctx.prefix, "call check: an empty verdict");
    const std::string text(verdict.begin() + 1, verdict.end());
    if (verdict[0] == 'm') throw call_mismatch_error(ctx.prefix, text, ctx.fingerprint);
    if (verdict[0] == 't') {
      check_broken_ = text;
      throw Error(ErrorCode::kTimeout, detail::cat(ctx.prefix, "call check: ", text));
    }
    return;
  }
  std::vector<int64_t> all(mine.size() * size_);
  std::memcpy(all.data(), mine.data(), bytes);
  for (int q = 1; q < size_; ++q) {
    std::vector<uint8_t> got;
    try {
      got = key_space_->get(record_key(n, q), ctx.timeout);
    } catch (const Error& e) {
      check_broken_ = detail::cat("rank ", q, " did not come to checked collective #", n);
      try {
        publish('t', detail::cat(check_broken_, " within ", ctx.timeout.count(), " ms"));
      } catch (const Error&) {  // the store is gone too: the others time out on their own
      }
      throw Error(e.code(),
                  detail::cat(ctx.prefix, "call check: rank ", q,
                              " did not issue this rank's checked collective #", n, " (",
                              describe(ctx.fingerprint), ") within ", ctx.timeout.count(),
                              " ms: it issued fewer collectives, a point-to-point op instead, or "
                              "runs without the call check (",
                              e.what(), ")"));
    }
    FASTCOMMS_CHECK(got.size() == bytes, kInvalidArgument, ctx.prefix, "call check: rank ", q,
                    "'s record of checked collective #", n, " has ", got.size(),
                    " bytes, expected ", bytes);
    std::memcpy(all.data() + mine.size() * q, got.data(), bytes);
  }
  if (n > 1) key_space_->delete_key(verdict_key(n - 1));
  const std::string mismatch = call_records_mismatch(all, size_);
  publish(mismatch.empty() ? 'o' : 'm', mismatch);
  if (!mismatch.empty()) throw call_mismatch_error(ctx.prefix, mismatch, ctx.fingerprint);
}

template <typename Fn, typename PeerFn>
WorkPtr Communicator::run(OpKind op, const CallOptions& o, Fn&& issue, CallFingerprint fp,
                          PeerFn peers, OpInfo rec) {
  check_usable(op);
  OpContext ctx;
  ctx.op = op;
  ctx.op_id = next_op_id();
  ctx.async_op = o.async_op;
  // 0 means the communicator's timeout; a negative one is a mistake, never silently the default.
  FASTCOMMS_CHECK(o.options.timeout.count() >= 0, kInvalidArgument, prefix(op),
                  "timeout must be positive, got ", o.options.timeout.count(), " ms");
  ctx.timeout = o.options.timeout.count() > 0 ? o.options.timeout : options_.timeout;
  ctx.hints = &o.options.hints;
  ctx.prefix = prefix(op);
  ctx.stream = o.stream;
  ctx.frontend = o.frontend;
  fp.op = static_cast<int32_t>(op);
  fp.key = o.call_key;
  ctx.fingerprint = fp;
  // NOTE [call check]: collectives only (a point-to-point op is issued by its two ranks alone).
  // A backend that compares calls itself (gloo in band, nccl beside the op) gets the sizes per
  // peer too, and the store is left alone.
  const bool collective = op != OpKind::kSend && op != OpKind::kRecv && op != OpKind::kBatchP2P;
  const bool in_band = collective && backend_->checks_calls(ctx);
  const bool store_check = collective && size_ > 1 && !in_band && wants_check(o);
  if constexpr (!std::is_same_v<PeerFn, std::nullptr_t>) {
    if (in_band || store_check) peers(ctx);
  }
  // (all_gather_p_exec runs as the all_gather_single it is, and hooks see it by its own name)
  if (rec.op != OpKind::kAllGatherPExec) rec.op = op;
  rec.op_id = ctx.op_id;
  rec.async_op = ctx.async_op;
  rec.frontend = o.frontend;
  return hooked(std::move(rec), [&] {
    WorkPtr work;
    try {
      {
        // Checked calls are compared and issued in one order (threads issuing at once included).
        std::unique_lock<std::mutex> order;
        if (store_check) {
          order = std::unique_lock<std::mutex>(check_mu_);
          check_through_store(ctx);
        }
        work = issue(ctx);
      }
      if (!o.async_op) work->wait();
    } catch (const Error& e) {
      if (options_.abort_process_on_timeout_or_error && ProcessAbort::applies(e.code()))
        process_abort_->abort_process(e.what());  // NOTE [process abort]: the hooks run first
      throw;
    }
    return work;
  });
}

WorkPtr Communicator::send(const TensorView& t, int dst, const CallOptions& o) {
  const OpKind op = OpKind::kSend;
  check_peer(op, "dst", dst, backend_->capabilities().self_p2p);
  check_tensor(op, "tensor", t);
  return run(
      op, o, [&](const OpContext& c) { return backend_->send(t, dst, c); }, {}, nullptr,
      record(one(t), {}, dst));
}

WorkPtr Communicator::recv(const TensorView& t, int src, const CallOptions& o) {
  const OpKind op = OpKind::kRecv;
  check_peer(op, "src", src, backend_->capabilities().self_p2p);
  check_tensor(op, "tensor", t);
  return run(
      op, o, [&](const OpContext& c) { return backend_->recv(t, src, c); }, {}, nullptr,
      record({}, one(t), src));
}

// NOTE [self pairs in a batch]: a batch may send to and receive from this rank itself, as in
// NCCL's group (which torchcomms' nccl batch relies on): the k-th send to self pairs with the
// k-th receive from self and the backend copies the one into the other, ordered with the batch.
// A send or receive to self without its partner is refused, as NCCL refuses it ("Trying to send
// to self without a matching recv"); a lone send or recv call to self stays refused (check_peer).
void Communicator::check_self_pairs(OpKind op, const std::vector<P2POp>& ops) const {
  std::vector<size_t> sends, recvs;
  for (size_t i = 0; i < ops.size(); ++i)
    if (ops[i].peer == rank_) (ops[i].kind == P2POp::Kind::kSend ? sends : recvs).push_back(i);
  FASTCOMMS_CHECK(sends.size() == recvs.size(), kInvalidArgument, prefix(op), "the batch holds ",
                  sends.size(), " send(s) to self (rank ", rank_, ") and ", recvs.size(),
                  " recv(s) from self: each send to self needs a matching recv from self in the "
                  "same batch (as NCCL: trying to ",
                  sends.size() > recvs.size() ? "send to self without a matching recv"
                                              : "recv from self without a matching send",
                  ")");
  for (size_t k = 0; k < sends.size(); ++k) {
    const TensorView& s = ops[sends[k]].tensor;
    const TensorView& r = ops[recvs[k]].tensor;
    FASTCOMMS_CHECK(s.dtype == r.dtype && s.numel() == r.numel(), kInvalidArgument, prefix(op),
                    "send to self #", k, " (op ", sends[k], ") is ", s.describe(),
                    " but the matching recv from self (op ", recvs[k], ") is ", r.describe(),
                    ": a self pair copies one into the other, so dtype and element count must "
                    "match");
  }
}

WorkPtr Communicator::batch_p2p(const std::vector<P2POp>& ops, const CallOptions& o) {
  const OpKind op = OpKind::kBatchP2P;
  FASTCOMMS_CHECK(!ops.empty(), kInvalidArgument, prefix(op), "the batch is empty");
  for (const P2POp& p : ops) {
    check_peer(op, p.kind == P2POp::Kind::kSend ? "send dst" : "recv src", p.peer, true);
    check_tensor(op, "tensor", p.tensor);
  }
  if (!backend_->capabilities().self_p2p) check_self_pairs(op, ops);
  OpInfo rec{};
  rec.num_ops = ops.size();
  return run(
      op, o, [&](const OpContext& c) { return backend_->batch_p2p(ops, c); }, {}, nullptr, rec);
}

WorkPtr Communicator::broadcast(const TensorView& t, int root, const CallOptions& o) {
  const OpKind op = OpKind::kBroadcast;
  check_peer(op, "root", root, true);
  check_tensor(op, "tensor", t);
  return run(
      op, o, [&](const OpContext& c) { return backend_->broadcast(t, root, c); },
      fingerprint(t.dtype, t.numel(), root), nullptr, record(one(t), one(t), root));
}

WorkPtr Communicator::all_reduce(const TensorView& t, const ReduceOp& r, const CallOptions& o) {
  const OpKind op = OpKind::kAllReduce;
  check_tensor(op, "tensor", t);
  check_reduce(op, r, t);
  return run(
      op, o, [&](const OpContext& c) { return backend_->all_reduce(t, r, c); },
      fingerprint(t.dtype, t.numel(), -1, &r), nullptr, record(one(t), one(t), -1, &r));
}

WorkPtr Communicator::reduce(const TensorView& t, int root, const ReduceOp& r,
                             const CallOptions& o) {
  const OpKind op = OpKind::kReduce;
  check_peer(op, "root", root, true);
  check_tensor(op, "tensor", t);
  check_reduce(op, r, t);
  return run(
      op, o, [&](const OpContext& c) { return backend_->reduce(t, root, r, c); },
      fingerprint(t.dtype, t.numel(), root, &r), nullptr, record(one(t), one(t), root, &r));
}

namespace {
template <typename Check>
void check_list(const std::string& prefix, const char* arg, const std::vector<TensorView>& list,
                int size, Check&& each) {
  FASTCOMMS_CHECK(static_cast<int>(list.size()) == size, kInvalidArgument, prefix, arg,
                  " must hold ", size, " tensors (one per rank), got ", list.size());
  for (int i = 0; i < size; ++i) each(i, list[i]);
}
}  // namespace

WorkPtr Communicator::all_gather(const std::vector<TensorView>& outputs, const TensorView& input,
                                 const CallOptions& o) {
  const OpKind op = OpKind::kAllGather;
  check_tensor(op, "input", input);
  check_list(prefix(op), "tensor_list", outputs, size_, [&](int i, const TensorView& t) {
    check_tensor(op, "tensor_list[i]", t);
    check_same_dtype(op, "tensor_list[i]", t, input.dtype);
    FASTCOMMS_CHECK(t.numel() == input.numel(), kInvalidArgument, prefix(op), "tensor_list[", i,
                    "] has ", t.numel(), " elements, input has ", input.numel(),
                    " (use all_gather_v for different sizes)");
  });
  return run(
      op, o, [&](const OpContext& c) { return backend_->all_gather(outputs, input, c); },
      fingerprint(input.dtype, input.numel()), nullptr, record(one(input), outputs));
}

WorkPtr Communicator::all_gather_v(const std::vector<TensorView>& outputs, const TensorView& input,
                                   const CallOptions& o) {
  const OpKind op = OpKind::kAllGatherV;
  check_tensor(op, "input", input);
  check_list(prefix(op), "tensor_list", outputs, size_, [&](int i, const TensorView& t) {
    check_tensor(op, "tensor_list[i]", t);
    check_same_dtype(op, "tensor_list[i]", t, input.dtype);
    FASTCOMMS_CHECK(i != rank_ || t.numel() == input.numel(), kInvalidArgument, prefix(op),
                    "tensor_list[", i, "] (this rank's slot) has ", t.numel(),
                    " elements, input has ", input.numel());
  });
  return run(
      op, o, [&](const OpContext& c) { return backend_->all_gather(outputs, input, c); },
      fingerprint(input.dtype, -1),
      [&](OpContext& c) {
        c.peer_out.assign(size_, input.nbytes());
        for (const TensorView& t : outputs) c.peer_in.push_back(t.nbytes());
      },
      record(one(input), outputs));
}

WorkPtr Communicator::all_gather_single(const TensorView& output, const TensorView& input,
                                        const CallOptions& o) {
  return all_gather_single_as(OpKind::kAllGatherSingle, output, input, o);
}

WorkPtr Communicator::all_gather_single_as(OpKind hook_op, const TensorView& output,
                                           const TensorView& input, const CallOptions& o) {
  const OpKind op = OpKind::kAllGatherSingle;
  OpInfo rec = record(one(input), one(output));
  rec.op = hook_op;
  check_tensor(op, "input", input);
  check_tensor(op, "output", output);
  check_same_dtype(op, "output", output, input.dtype);
  FASTCOMMS_CHECK(output.numel() == input.numel() * size_, kInvalidArgument, prefix(op),
                  "output has ", output.numel(),
                  " elements, expected input.numel() * size = ", input.numel(), " * ", size_);
  return run(
      op, o, [&](const OpContext& c) { return backend_->all_gather_single(output, input, c); },
      fingerprint(input.dtype, input.numel()), nullptr, rec);
}

WorkPtr Communicator::reduce_scatter(const TensorView& output,
                                     const std::vector<TensorView>& inputs, const ReduceOp& r,
                                     const CallOptions& o) {
  const OpKind op = OpKind::kReduceScatter;
  check_tensor(op, "output", output);
  check_reduce(op, r, output);
  check_list(prefix(op), "input_list", inputs, size_, [&](int i, const TensorView& t) {
    check_tensor(op, "input_list[i]", t);
    check_same_dtype(op, "input_list[i]", t, output.dtype);
    FASTCOMMS_CHECK(t.numel() == output.numel(), kInvalidArgument, prefix(op), "input_list[", i,
                    "] has ", t.numel(), " elements, output has ", output.numel(),
                    " (use reduce_scatter_v for different sizes)");
  });
  return run(
      op, o, [&](const OpContext& c) { return backend_->reduce_scatter(output, inputs, r, c); },
      fingerprint(output.dtype, output.numel(), -1, &r), nullptr,
      record(inputs, one(output), -1, &r));
}

WorkPtr Communicator::reduce_scatter_v(const TensorView& output,
                                       const std::vector<TensorView>& inputs, const ReduceOp& r,
                                       const CallOptions& o) {
  const OpKind op = OpKind::kReduceScatterV;
  check_tensor(op, "output", output);
  check_reduce(op, r, output);
  check_list(prefix(op), "input_list", inputs, size_, [&](int i, const TensorView& t) {
    check_tensor(op, "input_list[i]", t);
    check_same_dtype(op, "input_list[i]", t, output.dtype);
    FASTCOMMS_CHECK(i != rank_ || t.numel() == output.numel(), kInvalidArgument, prefix(op),
                    "input_list[", i, "] (this rank's slot) has ", t.numel(),
                    " elements, output has ", output.numel());
  });
  return run(
      op, o, [&](const OpContext& c) { return backend_->reduce_scatter(output, inputs, r, c); },
      fingerprint(output.dtype, -1, -1, &r),
      [&](OpContext& c) {
        for (const TensorView& t : inputs) c.peer_out.push_back(t.nbytes());
        c.peer_in.assign(size_, output.nbytes());
      },
      record(inputs, one(output), -1, &r));
}

WorkPtr Communicator::reduce_scatter_single(const TensorView& output, const TensorView& input,
                                            const ReduceOp& r, const CallOptions& o) {
  const OpKind op = OpKind::kReduceScatterSingle;
  check_tensor(op, "input", input);
  check_tensor(op, "output", output);
  check_same_dtype(op, "output", output, input.dtype);
  check_reduce(op, r, input);
  FASTCOMMS_CHECK(input.numel() == output.numel() * size_, kInvalidArgument, prefix(op),
                  "input has ", input.numel(),
                  " elements, expected output.numel() * size = ", output.numel(), " * ", size_);
  return run(
      op, o,
      [&](const OpContext& c) { return backend_->reduce_scatter_single(output, input, r, c); },
      fingerprint(output.dtype, output.numel(), -1, &r), nullptr,
      record(one(input), one(output), -1, &r));
}

WorkPtr Communicator::all_to_all_single(const TensorView& output, const TensorView& input,
                                        const CallOptions& o) {
  const OpKind op = OpKind::kAllToAllSingle;
  check_tensor(op, "input", input);
  check_tensor(op, "output", output);
  check_same_dtype(op, "output", output, input.dtype);
  FASTCOMMS_CHECK(input.numel() == output.numel(), kInvalidArgument, prefix(op), "input has ",
                  input.numel(), " elements, output has ", output.numel());
  FASTCOMMS_CHECK(input.rows() % size_ == 0, kInvalidArgument, prefix(op),
                  "input.size(0)=", input.rows(), " is not divisible by size=", size_);
  FASTCOMMS_CHECK(output.rows() % size_ == 0, kInvalidArgument, prefix(op),
                  "output.size(0)=", output.rows(), " is not divisible by size=", size_);
  std::vector<int64_t> in_splits(size_, input.rows() / size_);
  std::vector<int64_t> out_splits(size_, output.rows() / size_);
  return run(
      op, o,
      [&](const OpContext& c) {
        return backend_->all_to_all_v_single(output, input, out_splits, in_splits, c);
      },
      fingerprint(input.dtype, input.numel()), nullptr, record(one(input), one(output)));
}

WorkPtr Communicator::all_to_all_v_single(const TensorView& output, const TensorView& input,
                                          const std::vector<int64_t>& output_splits,
                                          const std::vector<int64_t>& input_splits,
                                          const CallOptions& o) {
  const OpKind op = OpKind::kAllToAllVSingle;
  check_tensor(op, "input", input);
  check_tensor(op, "output", output);
  check_same_dtype(op, "output", output, input.dtype);
  const auto resolve = [&](const std::vector<int64_t>& splits, const TensorView& t, const char* arg,
                           const char* tensor) {
    if (splits.empty()) {
      FASTCOMMS_CHECK(t.rows() % size_ == 0, kInvalidArgument, prefix(op), tensor,
                      ".size(0)=", t.rows(), " is not divisible by size=", size_, " and ", arg,
                      " is empty");
      return std::vector<int64_t>(size_, t.rows() / size_);
    }
    FASTCOMMS_CHECK(static_cast<int>(splits.size()) == size_, kInvalidArgument, prefix(op), arg,
                    " must have ", size_, " entries, got ", splits.size());
    int64_t sum = 0;
    for (int i = 0; i < size_; ++i) {
      FASTCOMMS_CHECK(splits[i] >= 0, kInvalidArgument, prefix(op), arg, "[", i,
                      "] must be >= 0, got ", splits[i]);
      // A sum that wraps could come out equal to size(0) and pass the check below.
      FASTCOMMS_CHECK(!__builtin_add_overflow(sum, splits[i], &sum), kInvalidArgument, prefix(op),
                      arg, " sums past 2^63 - 1 (entries up to [", i, "]); ", tensor,
                      ".size(0) is ", t.rows());
    }
    FASTCOMMS_CHECK(sum == t.rows(), kInvalidArgument, prefix(op), arg, " sums to ", sum, ", ",
                    tensor, ".size(0) is ", t.rows());
    return splits;
  };
  const auto out_s = resolve(output_splits, output, "output_split_sizes", "output");
  const auto in_s = resolve(input_splits, input, "input_split_sizes", "input");
  OpInfo rec = record(one(input), one(output));
  rec.input_splits = in_s;
  rec.output_splits = out_s;
  return run(
      op, o,
      [&](const OpContext& c) {
        return backend_->all_to_all_v_single(output, input, out_s, in_s, c);
      },
      fingerprint(input.dtype, -1),
      [&](OpContext& c) {
        for (int q = 0; q < size_; ++q) {
          c.peer_out.push_back(in_s[q] * input.row_bytes());
          c.peer_in.push_back(out_s[q] * output.row_bytes());
        }
      },
      rec);
}

WorkPtr Communicator::all_to_all(const std::vector<TensorView>& outputs,
                                 const std::vector<TensorView>& inputs, const CallOptions& o) {
  const OpKind op = OpKind::kAllToAll;
  FASTCOMMS_CHECK(!inputs.empty(), kInvalidArgument, prefix(op), "input_tensor_list is empty");
  const DType dt = inputs[0].dtype;
  check_list(prefix(op), "input_tensor_list", inputs, size_, [&](int, const TensorView& t) {
    check_tensor(op, "input_tensor_list[i]", t);
    check_same_dtype(op, "input_tensor_list[i]", t, dt);
  });
  check_list(prefix(op), "output_tensor_list", outputs, size_, [&](int, const TensorView& t) {
    check_tensor(op, "output_tensor_list[i]", t);
    check_same_dtype(op, "output_tensor_list[i]", t, dt);
  });
  return run(
      op, o, [&](const OpContext& c) { return backend_->all_to_all(outputs, inputs, c); },
      fingerprint(dt, -1),
      [&](OpContext& c) {
        for (int q = 0; q < size_; ++q) {
          c.peer_out.push_back(inputs[q].nbytes());
          c.peer_in.push_back(outputs[q].nbytes());
        }
      },
      record(inputs, outputs));
}

WorkPtr Communicator::barrier(const CallOptions& o) {
  return run(OpKind::kBarrier, o, [&](const OpContext& c) { return backend_->barrier(c); });
}

WorkPtr Communicator::scatter(const TensorView& output, const std::vector<TensorView>& inputs,
                              int root, const CallOptions& o) {
  const OpKind op = OpKind::kScatter;
  check_peer(op, "root", root, true);
  check_tensor(op, "output_tensor", output);
  if (rank_ == root) {
    check_list(prefix(op), "input_tensor_list", inputs, size_, [&](int i, const TensorView& t) {
      check_tensor(op, "input_tensor_list[i]", t);
      check_same_dtype(op, "input_tensor_list[i]", t, output.dtype);
      FASTCOMMS_CHECK(t.numel() == output.numel(), kInvalidArgument, prefix(op),
                      "input_tensor_list[", i, "] has ", t.numel(), " elements, output_tensor has ",
                      output.numel());
    });
  }
  return run(
      op, o, [&](const OpContext& c) { return backend_->scatter(output, inputs, root, c); },
      fingerprint(output.dtype, output.numel(), root), nullptr, record(inputs, one(output), root));
}

WorkPtr Communicator::gather(const std::vector<TensorView>& outputs, const TensorView& input,
                             int root, const CallOptions& o) {
  const OpKind op = OpKind::kGather;
  check_peer(op, "root", root, true);
  check_tensor(op, "input_tensor", input);
  if (rank_ == root) {
    check_list(prefix(op), "output_tensor_list", outputs, size_, [&](int i, const TensorView& t) {
      check_tensor(op, "output_tensor_list[i]", t);
      check_same_dtype(op, "output_tensor_list[i]", t, input.dtype);
      FASTCOMMS_CHECK(t.numel() == input.numel(), kInvalidArgument, prefix(op),
                      "output_tensor_list[", i, "] has ", t.numel(), " elements, input_tensor has ",
                      input.numel());
    });
  }
  return run(
      op, o, [&](const OpContext& c) { return backend_->gather(outputs, input, root, c); },
      fingerprint(input.dtype, input.numel(), root), nullptr, record(one(input), outputs, root));
}

WorkPtr Communicator::gather_single(const TensorView& output, const TensorView& input, int root,
                                    const CallOptions& o) {
  const OpKind op = OpKind::kGatherSingle;
  check_peer(op, "root", root, true);
  check_tensor(op, "input", input);
  std::vector<TensorView> outs;
  if (rank_ == root) {
    check_tensor(op, "output", output);
    check_same_dtype(op, "output", output, input.dtype);
    FASTCOMMS_CHECK(output.numel() == input.numel() * size_, kInvalidArgument, prefix(op),
                    "output has ", output.numel(),
                    " elements, expected input.numel() * size = ", input.numel(), " * ", size_);
    auto* base = static_cast<unsigned char*>(output.data);
    for (int i = 0; i < size_; ++i)
      outs.push_back(TensorView::contiguous(base + i * input.nbytes(), input.dtype, {input.numel()},
                                            output.device));
  }
  return run(
      OpKind::kGatherSingle, o,
      [&](const OpContext& c) { return backend_->gather(outs, input, root, c); },
      fingerprint(input.dtype, input.numel(), root), nullptr,
      record(one(input), one(output), root));
}

std::shared_ptr<Communicator> Communicator::split(const std::vector<int>& ranks,
                                                  const std::string& name,
                                                  const CommOptions* options,
                                                  const void* frontend) {
  const OpKind op = OpKind::kSplit;
  check_usable(op);
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    FASTCOMMS_CHECK(sorted[i] >= 0 && sorted[i] < size_, kInvalidArgument, prefix(op),
                    "ranks must be in [0, ", size_, "), got ", sorted[i]);
    FASTCOMMS_CHECK(i == 0 || sorted[i] != sorted[i - 1], kInvalidArgument, prefix(op), "rank ",
                    sorted[i], " appears twice in ranks");
  }
  OpInfo rec{op, next_op_id(), false, nullptr};
  rec.frontend = frontend;
  rec.ranks = ranks;
  rec.name = &name;
  return hooked(std::move(rec), [&]() -> std::shared_ptr<Communicator> {
    const uint64_t split_id = split_counter_.fetch_add(1) + 1;
    const std::string split_name =
        name.empty() ? detail::cat(options_.name, ".split", split_id) : name;
    const auto it = std::find(ranks.begin(), ranks.end(), rank_);
    if (it == ranks.end()) {
      backend_->split(ranks, split_name, nullptr);  // collective over the parent for some backends
      return nullptr;
    }
    CommOptions opts = options ? *options : options_;
    // Keys of a split live in the parent's key space (NOTE [store incarnations]).
    if (!opts.store) opts.store = options_.store;
    opts.name = split_name;
    BackendInit init{static_cast<int>(it - ranks.begin()), static_cast<int>(ranks.size()), device_,
                     opts};
    std::string key = detail::cat("split", split_id, "/", opts.name, "/");
    for (int r : ranks) key += detail::cat(r, ".");
    init.options.store = std::make_shared<PrefixStore>(key, key_space_);
    auto backend = backend_->split(ranks, split_name, &init);
    FASTCOMMS_CHECK(backend != nullptr, kInternal, prefix(op), "backend '", backend_->name(),
                    "' returned no communicator for a member of the split");
    return std::make_shared<Communicator>(std::move(backend), init.rank, init.size, device_,
                                          std::move(opts), init.options.store, init.process_abort);
  });
}

namespace {
template <typename Map, typename Fn>
RemovableHandle add_hook(const std::shared_ptr<void>& owner, std::mutex& mu, uint64_t& next,
                         Map& map, Fn fn) {
  std::lock_guard<std::mutex> lock(mu);
  const uint64_t id = next++;
  map.emplace(id, std::move(fn));
  std::weak_ptr<void> weak = owner;
  return RemovableHandle([weak, &mu, &map, id] {
    if (auto alive = weak.lock()) {
      std::lock_guard<std::mutex> lock(mu);
      map.erase(id);
    }
  });
}
}  // namespace

RemovableHandle Communicator::register_pre_hook(PreHook fn) {
  return add_hook(hooks_, hooks_->mu, hooks_->next_id, hooks_->pre, std::move(fn));
}
RemovableHandle Communicator::register_post_hook(PostHook fn) {
  return add_hook(hooks_, hooks_->mu, hooks_->next_id, hooks_->post, std::move(fn));
}
RemovableHandle Communicator::register_abort_hook(AbortHook fn) {
  return add_hook(hooks_, hooks_->mu, hooks_->next_id, hooks_->abort, std::move(fn));
}
RemovableHandle Communicator::register_error_hook(ErrorHook fn) {
  return add_hook(hooks_, hooks_->mu, hooks_->next_id, hooks_->error, std::move(fn));
}

}  // namespace fastcomms
