// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/backend.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <thread>

#include "fastcomms/core/log.hpp"
#include "fastcomms/core/store_window.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

bool parse_call_check_mode(const std::string& v, CallCheckMode* m) {
  if (v == "0")
    *m = CallCheckMode::kOff;
  else if (v == "1")
    *m = CallCheckMode::kDefault;
  else if (v == "strict")
    *m = CallCheckMode::kStrict;
  else
    return false;
  return true;
}

CallCheckMode op_call_check_mode(const OpContext& ctx, CallCheckMode communicator,
                                 std::initializer_list<const char*> hint_names) {
  if (ctx.hints == nullptr) return communicator;
  for (const char* hint : hint_names) {  // a per-op hint decides for that op (alike on every rank)
    if (auto h = ctx.hints->find(hint); h != ctx.hints->end()) {
      CallCheckMode m;
      FASTCOMMS_CHECK(parse_call_check_mode(h->second, &m), kInvalidArgument, ctx.prefix, "hint ",
                      hint, " must be 0, 1 or strict, got '", h->second, "'");
      return m;
    }
  }
  return communicator;
}

void ProcessAbort::set_hooks(std::function<void()> run_hooks) {
  std::lock_guard<std::mutex> lock(mu_);
  run_hooks_ = std::move(run_hooks);
}

// NOTE [process abort]
void ProcessAbort::abort_process(const std::string& why) const {
  // written whatever FASTCOMMS_LOG_LEVEL says: the process ends next
  log::write(log::Level::kError,
             "aborting the process (abort_process_on_timeout_or_error): " + why);
  std::function<void()> hooks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hooks = run_hooks_;
  }
  if (hooks) {
    auto done = std::make_shared<std::promise<void>>();
    std::future<void> finished = done->get_future();
    std::thread([hooks = std::move(hooks), done] {
      try {
        hooks();
      } catch (...) {  // a failing hook must not stop the abort
        log::write(log::Level::kError, "an abort hook raised: " + log::current_exception_text());
      }
      done->set_value();
    }).detach();
    if (finished.wait_for(kHookGrace) != std::future_status::ready)
      log::write(log::Level::kError,
                 detail::cat("the abort hooks did not finish within ", kHookGrace.count(), " s"));
  }
  std::abort();
}

std::string describe(const CallFingerprint& f) {
  std::string s = f.op >= 0 && f.op < static_cast<int>(OpKind::kCount)
                      ? op_name(static_cast<OpKind>(f.op))
                      : "op " + std::to_string(f.op);
  std::string args;
  const auto add = [&](const std::string& a) { args += (args.empty() ? "" : ", ") + a; };
  if (f.reduce >= 0) add(std::string(red_op_name(static_cast<RedOpType>(f.reduce))));
  if (f.root >= 0) add("root " + std::to_string(f.root));
  if (f.dtype >= 0) {
    const std::string dt(dtype_name(static_cast<DType>(f.dtype)));
    add(f.count >= 0 ? std::to_string(f.count) + " x " + dt : dt);
  }
  if (f.key != 0) {
    char hex[24];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(f.key));
    add(std::string("call key ") + hex);
  }
  return s + "(" + args + ")";
}

namespace {
constexpr size_t kFingerprintWords = sizeof(CallFingerprint) / sizeof(int64_t);
static_assert(sizeof(CallFingerprint) % sizeof(int64_t) == 0);
}  // namespace

size_t call_record_words(int size) { return kFingerprintWords + 2 * static_cast<size_t>(size); }

std::vector<int64_t> call_record(const CallFingerprint& f, const std::vector<int64_t>& peer_out,
                                 const std::vector<int64_t>& peer_in, int size) {
  std::vector<int64_t> r(call_record_words(size), -1);
  std::memcpy(r.data(), &f, sizeof f);
  for (size_t q = 0; q < peer_out.size() && q < static_cast<size_t>(size); ++q)
    r[kFingerprintWords + q] = peer_out[q];
  for (size_t q = 0; q < peer_in.size() && q < static_cast<size_t>(size); ++q)
    r[kFingerprintWords + size + q] = peer_in[q];
  return r;
}

std::string call_records_mismatch(const std::vector<int64_t>& all, int size) {
  const size_t n = call_record_words(size);
  FASTCOMMS_CHECK(all.size() == n * static_cast<size_t>(size), kInvalidArgument,
                  "call check: expected ", size, " records of ", n, " words, got ", all.size(),
                  " words");
  const auto fp = [&](int r) {
    CallFingerprint f;
    std::memcpy(static_cast<void*>(&f), all.data() + n * r, sizeof f);  // trivially copyable
    return f;
  };
  for (int q = 1; q < size; ++q) {  // the lowest rank that differs from rank 0
    if (fp(q) == fp(0)) continue;
    return detail::cat("ranks issued different collectives: rank 0 called ", describe(fp(0)),
                       ", rank ", q, " called ", describe(fp(q)));
  }
  // NOTE [per-peer sizes check]: the _v forms' sizes are per peer, so the fingerprint cannot
  // hold them; every rank has every rank's sizes, finds the first pair (in rank order) where
  // what r sends q is not what q expects from r, and raises the same error before any data
  // moves (a size the receiver does not expect makes Gloo's I/O thread fail the connection,
  // and NCCL read past a buffer or hang).
  for (int r = 0; r < size; ++r) {
    for (int q = 0; q < size; ++q) {
      const int64_t sent = all[n * r + kFingerprintWords + q];
      const int64_t expected = all[n * q + kFingerprintWords + size + r];
      if (sent == expected) continue;
      return detail::cat("ranks disagree on the per-peer sizes: rank ", r, " sends ", sent,
                         " bytes to rank ", q, ", which expects ", expected,
                         " (nothing was moved)");
    }
  }
  return {};
}

Error call_mismatch_error(const std::string& prefix, const std::string& mismatch,
                          const CallFingerprint& mine) {
  return Error(ErrorCode::kInvalidArgument,
               detail::cat(prefix, mismatch, " (this rank called ", describe(mine), ")"));
}

void check_call_records(const std::string& prefix, const CallFingerprint& mine,
                        const std::vector<int64_t>& all, int size) {
  std::string m;
  try {
    m = call_records_mismatch(all, size);
  } catch (const Error& e) {
    throw Error(e.code(), prefix + e.what());
  }
  if (!m.empty()) throw call_mismatch_error(prefix, m, mine);
}

const char* op_name(OpKind op) noexcept {
  switch (op) {
    case OpKind::kSend:
      return "send";
    case OpKind::kRecv:
      return "recv";
    case OpKind::kBatchP2P:
      return "batch_op_issue";
    case OpKind::kBroadcast:
      return "broadcast";
    case OpKind::kAllReduce:
      return "all_reduce";
    case OpKind::kReduce:
      return "reduce";
    case OpKind::kAllGather:
      return "all_gather";
    case OpKind::kAllGatherV:
      return "all_gather_v";
    case OpKind::kAllGatherSingle:
      return "all_gather_single";
    case OpKind::kReduceScatter:
      return "reduce_scatter";
    case OpKind::kReduceScatterV:
      return "reduce_scatter_v";
    case OpKind::kReduceScatterSingle:
      return "reduce_scatter_single";
    case OpKind::kAllToAllSingle:
      return "all_to_all_single";
    case OpKind::kAllToAllVSingle:
      return "all_to_all_v_single";
    case OpKind::kAllToAll:
      return "all_to_all";
    case OpKind::kBarrier:
      return "barrier";
    case OpKind::kScatter:
      return "scatter";
    case OpKind::kGather:
      return "gather";
    case OpKind::kGatherSingle:
      return "gather_single";
    case OpKind::kSplit:
      return "split";
    case OpKind::kNewWindow:
      return "new_window";
    case OpKind::kFinalize:
      return "finalize";
    case OpKind::kAllGatherPExec:
      return "all_gather_p_exec";
    case OpKind::kCount:
      break;
  }
  return "unknown";
}

namespace {
[[noreturn]] void unsupported(const Backend& b, const OpContext& ctx) {
  throw Error(ErrorCode::kUnsupported, detail::cat(ctx.prefix, "backend '", b.name(),
                                                   "' does not implement ", op_name(ctx.op)));
}
}  // namespace

WorkPtr Backend::send(const TensorView&, int, const OpContext& c) { unsupported(*this, c); }
WorkPtr Backend::recv(const TensorView&, int, const OpContext& c) { unsupported(*this, c); }
WorkPtr Backend::batch_p2p(const std::vector<P2POp>&, const OpContext& c) { unsupported(*this, c); }
WorkPtr Backend::broadcast(const TensorView&, int, const OpContext& c) { unsupported(*this, c); }
WorkPtr Backend::all_reduce(const TensorView&, const ReduceOp&, const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::reduce(const TensorView&, int, const ReduceOp&, const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::all_gather(const std::vector<TensorView>&, const TensorView&, const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::all_gather_single(const TensorView&, const TensorView&, const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::reduce_scatter(const TensorView&, const std::vector<TensorView>&, const ReduceOp&,
                                const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::reduce_scatter_single(const TensorView&, const TensorView&, const ReduceOp&,
                                       const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::all_to_all_v_single(const TensorView&, const TensorView&,
                                     const std::vector<int64_t>&, const std::vector<int64_t>&,
                                     const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::all_to_all(const std::vector<TensorView>&, const std::vector<TensorView>&,
                            const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::barrier(const OpContext& c) { unsupported(*this, c); }
WorkPtr Backend::scatter(const TensorView&, const std::vector<TensorView>&, int,
                         const OpContext& c) {
  unsupported(*this, c);
}
WorkPtr Backend::gather(const std::vector<TensorView>&, const TensorView&, int,
                        const OpContext& c) {
  unsupported(*this, c);
}
void Backend::register_memory(void*, int64_t, const std::string& where) {
  throw Error(ErrorCode::kUnsupported,
              where + "tensor_register is not implemented by backend '" + name() + "'");
}
void Backend::deregister_memory(void*, const std::string& where) {
  throw Error(ErrorCode::kUnsupported,
              where + "tensor_deregister is not implemented by backend '" + name() + "'");
}
std::shared_ptr<Window> Backend::new_window(const OpContext& c) {
  throw Error(ErrorCode::kUnsupported, c.prefix + "backend '" + name() + "' has no windows");
}
std::unique_ptr<Backend> Backend::split(const std::vector<int>&, const std::string&,
                                        const BackendInit*) {
  throw Error(ErrorCode::kUnsupported,
              detail::cat("backend '", name(), "' does not implement split"));
}

}  // namespace fastcomms

namespace fastcomms {

// The device API where a window's backend has none (NOTE [device window ordering] in
// fastcomms/device/window.hpp says what a backend that has it provides).
namespace {
[[noreturn]] void no_device_api(const char* op) {
  throw Error(ErrorCode::kUnsupported,
              detail::cat(op,
                          ": this window's backend has no device API (device windows map "
                          "every peer's memory into the kernel through CUDA IPC: the nvlink "
                          "backend, and nccl with every rank on one host)"));
}
}  // namespace

void* Window::device_window(int, int, int) { no_device_api("get_device_window"); }
void* Window::register_local_buffer(void*, int64_t) { no_device_api("register_local_buffer"); }
void Window::deregister_local_buffer(void*) { no_device_api("deregister_local_buffer"); }
void Window::arm_device_faults(uint32_t) { no_device_api("arm_device_faults"); }

namespace {
std::shared_ptr<Window> (*&store_window_maker())(const StoreWindowInit&) {
  static std::shared_ptr<Window> (*maker)(const StoreWindowInit&) = nullptr;
  return maker;
}
}  // namespace

void set_store_window_maker(std::shared_ptr<Window> (*maker)(const StoreWindowInit&)) {
  store_window_maker() = maker;
}

std::shared_ptr<Window> make_store_window(const StoreWindowInit& init) {
  auto maker = store_window_maker();
  FASTCOMMS_CHECK(maker != nullptr, kUnsupported, "[rank ", init.rank, "/", init.size, " ",
                  init.name, " store_window] this build has no CUDA, so no CUDA IPC windows");
  return maker(init);
}

}  // namespace fastcomms
