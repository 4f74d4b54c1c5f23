// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/backend.hpp"

#include <cstdio>
#include <cstdlib>
#include <future>
#include <thread>

#include "fastcomms/error.hpp"

namespace fastcomms {

void ProcessAbort::set_hooks(std::function<void()> run_hooks) {
  std::lock_guard<std::mutex> lock(mu_);
  run_hooks_ = std::move(run_hooks);
}

// NOTE [process abort]
void ProcessAbort::abort_process(const std::string& why) const {
  std::fprintf(stderr, "fastcomms: aborting the process (abort_process_on_timeout_or_error): %s\n",
               why.c_str());
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
      }
      done->set_value();
    }).detach();
    if (finished.wait_for(kHookGrace) != std::future_status::ready)
      std::fprintf(stderr, "fastcomms: the abort hooks did not finish within %lld s\n",
                   static_cast<long long>(kHookGrace.count()));
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
  return s + "(" + args + ")";
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
std::unique_ptr<Backend> Backend::split(const std::vector<int>&, const BackendInit*) {
  throw Error(ErrorCode::kUnsupported,
              detail::cat("backend '", name(), "' does not implement split"));
}

}  // namespace fastcomms
