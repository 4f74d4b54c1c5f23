// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The nccl backend: every op of the communicator API on CUDA tensors through NCCL.
//
// NOTE [nccl backend streams]: each op is ordered after the caller's stream with an event, runs on
// the communicator's internal stream, and records a completion event. Work::wait() makes the
// caller's stream wait on that event (no host block); a sync op does the same before returning,
// so it is ordered on the caller's stream and capturable in a CUDA graph. A watchdog thread polls
// the completion events of ops in flight; one that outlives its timeout is marked TIMEDOUT and the
// communicator is aborted with ncclCommAbort (which ends the stuck kernels), or the process is
// aborted when abort_process_on_timeout_or_error is set. It polls the communicator's asynchronous
// error too (NOTE [nccl async errors]). Every NCCL and CUDA runtime call goes through NcclApi
// (NOTE [nccl seam]), so tests/host/test_nccl_fake.cpp checks this note without a GPU.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>

#include "backends/ipc/ipc_window.hpp"
#include "backends/nccl/call_checker.hpp"
#include "backends/nccl/nccl_api.hpp"
#include "backends/nccl/nccl_backend.hpp"
#include "backends/nccl/nccl_config.hpp"
#include "backends/nccl/nccl_util.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/half.hpp"
#include "fastcomms/core/log.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::nccl_backend {
namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at the ops in flight and at the communicator's asynchronous error.
constexpr std::chrono::milliseconds kWatchdogTick{50};

// Checks that `init` names a CUDA device and makes it current, before the backend makes anything
// on it; returns `api`.
NcclApi& on_device(NcclApi& api, const BackendInit& init, const std::string& prefix) {
  FASTCOMMS_CHECK(init.device.type == DeviceType::kCUDA && init.device.index >= 0, kInvalidArgument,
                  prefix, "the nccl backend serves CUDA devices, got ", init.device.str());
  cuda_check(api, prefix, "cudaSetDevice", api.cuda_set_device(init.device.index));
  return api;
}

ncclDataType_t nccl_type(DType dt, const std::string& prefix) {
  switch (dt) {
    case DType::kFloat16:
      return ncclFloat16;
    case DType::kBFloat16:
      return ncclBfloat16;
    case DType::kFloat32:
      return ncclFloat32;
    case DType::kFloat64:
      return ncclFloat64;
    case DType::kFloat8E4M3FN:
      return ncclFloat8e4m3;
    case DType::kFloat8E5M2:
      return ncclFloat8e5m2;
    case DType::kInt8:
      return ncclInt8;
    case DType::kUInt8:
    case DType::kBool:
      return ncclUint8;
    case DType::kInt32:
      return ncclInt32;
    case DType::kInt64:
      return ncclInt64;
  }
  throw Error(ErrorCode::kTypeError, prefix + "unsupported dtype");
}

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
char* bytes(const TensorView& t) { return static_cast<char*>(t.data); }
size_t nbytes(const TensorView& t) { return static_cast<size_t>(t.nbytes()); }

// Completion of one op on the internal stream (it owns `done`).
class NcclWork : public CheckedWork {
 public:
  // `checker`: the call check this op's call is compared by (NOTE [nccl call check]), or null.
  NcclWork(std::shared_ptr<NcclApi> api, cudaEvent_t done, cudaStream_t caller, const OpContext& c,
           std::shared_ptr<CallChecker> checker)
      : api_(std::move(api)),
        done_(done),
        caller_(caller),
        prefix_(c.prefix),
        what_(detail::cat(op_name(c.op), " (op ", c.op_id, ")")),
        timeout_(c.timeout),
        deadline_(Clock::now() + c.timeout),
        checker_(std::move(checker)) {}
  ~NcclWork() override { (void)api_->cuda_event_destroy(done_); }

  WorkStatus status() const override {
    if (const WorkStatus s = settled(); s != WorkStatus::kInProgress) return s;
    const cudaError_t err = api_->cuda_event_query(done_);
    if (err == cudaErrorNotReady) return WorkStatus::kInProgress;
    if (err != cudaSuccess) {
      (void)api_->cuda_get_last_error();
      return WorkStatus::kError;
    }
    if (checker_) {
      // NOTE [nccl call check]: the op's fingerprints landed before its completion event, so
      // they are compared before the op reports completion; a mismatch fails this work.
      RelaxedCapture relaxed(*api_);
      checker_->poll();
      if (const WorkStatus s = settled(); s != WorkStatus::kInProgress) return s;
    }
    return WorkStatus::kCompleted;
  }
  void wait() override {
    const int s = state_.load();
    if (s == kTimedOut)
      throw Error(ErrorCode::kTimeout,
                  detail::cat(prefix_, "nccl: timed out after ", timeout_.count(),
                              " ms; the communicator was aborted"));
    if (s == kAborted)
      throw Error(ErrorCode::kAborted, prefix_ + "nccl: the communicator was aborted");
    if (s == kFailed) {
      if (checker_) checker_->note_raised();  // NOTE [nccl call check]: finalize need not
      std::lock_guard<std::mutex> lock(mu_);
      throw Error(failed_code_, prefix_ + "nccl: " + failed_why_);
    }
    cuda_check(*api_, prefix_ + "nccl: ", "cudaStreamWaitEvent",
               api_->cuda_stream_wait_event(caller_, done_, 0));
  }
  // Watchdog side.
  bool overdue(Clock::time_point now) const { return now > deadline_; }
  // "all_reduce (op 3) timed out after 300 ms", for the log and later ops' errors.
  std::string timed_out() const {
    return detail::cat(what_, " timed out after ", timeout_.count(), " ms");
  }
  bool done() const { return api_->cuda_event_query(done_) == cudaSuccess; }
  // The first of mark() and fail() wins: a timed-out op stays timed out, a failed one failed.
  void mark(int s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() == kRunning) state_.store(s);
  }
  // NOTE [nccl async errors]: the communicator failed under this op; NOTE [nccl call check]:
  // the op's call was mismatched.
  void fail(ErrorCode code, std::string why) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load() != kRunning) return;
    failed_code_ = code;
    failed_why_ = std::move(why);
    state_.store(kFailed);
  }
  static constexpr int kRunning = 0, kTimedOut = 1, kAborted = 2, kFailed = 3;

 private:
  // What the state says (kInProgress: still running as far as it knows).
  WorkStatus settled() const {
    const int s = state_.load();
    if (s == kTimedOut) return WorkStatus::kTimedOut;
    if (s == kAborted || s == kFailed) return WorkStatus::kError;
    return WorkStatus::kInProgress;
  }

  std::shared_ptr<NcclApi> api_;
  cudaEvent_t done_;
  cudaStream_t caller_;
  std::string prefix_;  // the op's, "[rank r/n comm op] "
  std::string what_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  std::shared_ptr<CallChecker> checker_;
  mutable std::mutex mu_;  // a failure's code and reason, and state changes
  ErrorCode failed_code_ = ErrorCode::kBackendError;
  std::string failed_why_;
  std::atomic<int> state_{kRunning};
};

class NcclBackend : public Backend {
 public:
  // `comm` null: a new communicator by unique id through the store, made with `config`; else a
  // split's, now owned (made with `config`).
  NcclBackend(const BackendInit& init, std::shared_ptr<NcclApi> api, ncclComm_t comm,
              NcclConfig config);
  ~NcclBackend() override;

  std::string name() const override { return "nccl"; }
  std::string version() const override {
    int v = 0;
    (void)api_->get_version(&v);
    return detail::cat("nccl ", v / 10000, ".", (v / 100) % 100, ".", v % 100);
  }
  Capabilities capabilities() const override {
    Capabilities c;
    for (int i = 0; i < static_cast<int>(OpKind::kCount); ++i) c.ops |= uint64_t{1} << i;
    c.cuda_tensors = true;
    return c;
  }

  // NOTE [nccl windows]: NCCL 2.28 registers windows (ncclCommWindowRegister) but has no host
  // API to put or signal into them (ncclPutSignal and ncclWaitSignal came with 2.29), so the
  // nccl backend's windows are the CUDA IPC windows the nvlink backend has (backends/ipc):
  // every rank on one host, which the window checks at creation (a clear error otherwise).
  // Puts move on the copy engines, outside NCCL's stream and kernels.
  bool supports_window() const override { return true; }

  // NOTE [nccl memory registration]: TorchComm.tensor_register on nccl is NCCL's user buffer
  // registration (ncclCommRegister), which lets NCCL's kernels use the buffer in place where its
  // algorithms can; registrations left at finalize or destruction are dropped before the
  // communicator goes.
  void register_memory(void* ptr, int64_t bytes, const std::string& where) override {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked(where + "nccl: ");
    FASTCOMMS_CHECK(!registered_.count(ptr), kInvalidArgument, where,
                    "this tensor's memory is registered already; call tensor_deregister first");
    DeviceGuard guard(*api_, device_, where);
    void* handle = nullptr;
    nccl_check(*api_, comm_, where + "nccl: ", "ncclCommRegister",
               api_->comm_register(comm_, ptr, static_cast<size_t>(bytes), &handle));
    registered_[ptr] = handle;
  }
  void deregister_memory(void* ptr, const std::string& where) override {
    void* handle = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = registered_.find(ptr);
      FASTCOMMS_CHECK(it != registered_.end(), kInvalidArgument, where,
                      "this tensor's memory is not registered with the communicator");
      handle = it->second;
      registered_.erase(it);
    }
    DeviceGuard guard(*api_, device_, where);
    nccl_check(*api_, comm_, where + "nccl: ", "ncclCommDeregister",
               api_->comm_deregister(comm_, handle));
  }
  // get_nccl_comm_ptr (torchcomms' TorchCommNCCL::getCommPtr): the ncclComm_t, not owned; none
  // once the communicator is aborted (the watchdog's abort included).
  std::shared_ptr<void> lend(const std::string& what) override {
    if (what != kLentNcclComm) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_ || comm_ == nullptr) return nullptr;
    return std::shared_ptr<void>(std::shared_ptr<void>(), static_cast<void*>(comm_));
  }
  std::shared_ptr<Window> new_window(const OpContext&) override {
    FASTCOMMS_CHECK(options_.store != nullptr, kUnsupported, "[rank ", rank_, "/", size_, " ",
                    options_.name, " new_window] ", "windows need the store");
    IpcWindowOptions o;
    o.rank = rank_;
    o.size = size_;
    o.device = device_;
    o.store = std::make_shared<PrefixStore>("win", options_.store);
    o.name = detail::cat(options_.name, "/", windows_++);  // every rank counts alike
    o.timeout = options_.timeout;
    o.backend = "nccl";
    return std::make_shared<IpcWindow>(std::move(o));
  }

  WorkPtr send(const TensorView& t, int dst, const OpContext& c) override {
    return batch_p2p({P2POp{P2POp::Kind::kSend, t, dst}}, c);
  }
  WorkPtr recv(const TensorView& t, int src, const OpContext& c) override {
    return batch_p2p({P2POp{P2POp::Kind::kRecv, t, src}}, c);
  }
  WorkPtr batch_p2p(const std::vector<P2POp>& ops, const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      group(c, [&] {
        for (const P2POp& op : ops) {
          if (op.kind == P2POp::Kind::kSend)
            check(c, "ncclSend",
                  api_->send(op.tensor.data, nbytes(op.tensor), ncclUint8, op.peer, comm_, s));
          else
            check(c, "ncclRecv",
                  api_->recv(op.tensor.data, nbytes(op.tensor), ncclUint8, op.peer, comm_, s));
        }
      });
    });
  }
  WorkPtr broadcast(const TensorView& t, int root, const OpContext& c) override {
    return run_collective(c, [&](cudaStream_t s) {
      check(c, "ncclBroadcast",
            api_->broadcast(t.data, t.data, nbytes(t), ncclUint8, root, comm_, s));
    });
  }
  WorkPtr all_reduce(const TensorView& t, const ReduceOp& op, const OpContext& c) override {
    const ncclDataType_t dt = nccl_type(t.dtype, c.prefix);
    return run_collective(c, [&](cudaStream_t s) {
      with_op(op, t.dtype, dt, c, [&](ncclRedOp_t r) {
        check(c, "ncclAllReduce", api_->all_reduce(t.data, t.data, t.numel(), dt, r, comm_, s));
      });
    });
  }
  WorkPtr reduce(const TensorView& t, int root, const ReduceOp& op, const OpContext& c) override {
    const ncclDataType_t dt = nccl_type(t.dtype, c.prefix);
    return run_collective(c, [&](cudaStream_t s) {
      with_op(op, t.dtype, dt, c, [&](ncclRedOp_t r) {
        check(c, "ncclReduce", api_->reduce(t.data, t.data, t.numel(), dt, r, root, comm_, s));
      });
    });
  }
  WorkPtr all_gather(const std::vector<TensorView>& outputs, const TensorView& input,
                     const OpContext& c) override {
    // Every rank broadcasts its input into the matching output (sizes may differ per rank).
    return run_collective(c, [&](cudaStream_t s) {
      group(c, [&] {
        for (int r = 0; r < size_; ++r) {
          const void* src = r == rank_ ? input.data : outputs[r].data;
          check(c, "ncclBroadcast",
                api_->broadcast(src, outputs[r].data, nbytes(outputs[r]), ncclUint8, r, comm_, s));
        }
      });
    });
  }
  WorkPtr all_gather_single(const TensorView& output, const TensorView& input,
                            const OpContext& c) override {
    return run_collective(c, [&](cudaStream_t s) {
      check(c, "ncclAllGather",
            api_->all_gather(input.data, output.data, nbytes(input), ncclUint8, comm_, s));
    });
  }
  WorkPtr reduce_scatter(const TensorView& output, const std::vector<TensorView>& inputs,
                         const ReduceOp& op, const OpContext& c) override {
    // One reduce per rank into that rank's output (sizes may differ per rank).
    const ncclDataType_t dt = nccl_type(output.dtype, c.prefix);
    return run_collective(c, [&](cudaStream_t s) {
      with_op(op, output.dtype, dt, c, [&](ncclRedOp_t r) {
        group(c, [&] {
          for (int q = 0; q < size_; ++q)
            check(c, "ncclReduce",
                  api_->reduce(inputs[q].data, q == rank_ ? output.data : nullptr,
                               inputs[q].numel(), dt, r, q, comm_, s));
        });
      });
    });
  }
  WorkPtr reduce_scatter_single(const TensorView& output, const TensorView& input,
                                const ReduceOp& op, const OpContext& c) override {
    const ncclDataType_t dt = nccl_type(output.dtype, c.prefix);
    return run_collective(c, [&](cudaStream_t s) {
      with_op(op, output.dtype, dt, c, [&](ncclRedOp_t r) {
        check(c, "ncclReduceScatter",
              api_->reduce_scatter(input.data, output.data, output.numel(), dt, r, comm_, s));
      });
    });
  }
  WorkPtr all_to_all_v_single(const TensorView& output, const TensorView& input,
                              const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits,
                              const OpContext& c) override {
    const int64_t in_row = input.rows() ? input.nbytes() / input.rows() : 0;
    const int64_t out_row = output.rows() ? output.nbytes() / output.rows() : 0;
    return run(c, [&](cudaStream_t s) {
      group(c, [&] {
        int64_t in_off = 0, out_off = 0;
        for (int q = 0; q < size_; ++q) {
          check(
              c, "ncclSend",
              api_->send(bytes(input) + in_off, input_splits[q] * in_row, ncclUint8, q, comm_, s));
          check(c, "ncclRecv",
                api_->recv(bytes(output) + out_off, output_splits[q] * out_row, ncclUint8, q, comm_,
                           s));
          in_off += input_splits[q] * in_row;
          out_off += output_splits[q] * out_row;
        }
      });
    });
  }
  WorkPtr all_to_all(const std::vector<TensorView>& outputs, const std::vector<TensorView>& inputs,
                     const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      group(c, [&] {
        for (int q = 0; q < size_; ++q) {
          check(c, "ncclSend",
                api_->send(inputs[q].data, nbytes(inputs[q]), ncclUint8, q, comm_, s));
          check(c, "ncclRecv",
                api_->recv(outputs[q].data, nbytes(outputs[q]), ncclUint8, q, comm_, s));
        }
      });
    });
  }
  WorkPtr barrier(const OpContext& c) override {
    return run_collective(c, [&](cudaStream_t s) {
      check(c, "ncclAllReduce",
            api_->all_reduce(barrier_buf_.get(), barrier_buf_.get(), 1, ncclInt32, ncclSum, comm_,
                             s));
    });
  }
  WorkPtr scatter(const TensorView& output, const std::vector<TensorView>& inputs, int root,
                  const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      group(c, [&] {
        if (rank_ == root)
          for (int q = 0; q < size_; ++q)
            check(c, "ncclSend",
                  api_->send(inputs[q].data, nbytes(output), ncclUint8, q, comm_, s));
        check(c, "ncclRecv", api_->recv(output.data, nbytes(output), ncclUint8, root, comm_, s));
      });
    });
  }
  WorkPtr gather(const std::vector<TensorView>& outputs, const TensorView& input, int root,
                 const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      group(c, [&] {
        check(c, "ncclSend", api_->send(input.data, nbytes(input), ncclUint8, root, comm_, s));
        if (rank_ == root)
          for (int q = 0; q < size_; ++q)
            check(c, "ncclRecv",
                  api_->recv(outputs[q].data, nbytes(input), ncclUint8, q, comm_, s));
      });
    });
  }
  std::unique_ptr<Backend> split(const std::vector<int>& ranks, const std::string&,
                                 const BackendInit* init) override {
    // ncclCommSplit is collective over this communicator: every rank calls it, non-members with
    // NCCL_SPLIT_NOCOLOR. The color names the group (a hash of its sorted ranks), the key orders
    // the new ranks as `ranks` does.
    check_usable(prefix_);
    int color = NCCL_SPLIT_NOCOLOR, key = 0;
    if (init) {
      std::vector<int> sorted = ranks;
      std::sort(sorted.begin(), sorted.end());
      uint32_t h = 2166136261u;
      for (int r : sorted) h = (h ^ static_cast<uint32_t>(r)) * 16777619u;
      color = static_cast<int>(h & 0x3fffffff);
      key = init->rank;
    }
    // NOTE [nccl config hints]: a member's new communicator gets the config its hints ask for
    // (commName its name), as torchcomms' split passes one; a rank joining none passes none.
    std::optional<NcclConfig> config;
    if (init)
      config.emplace(
          init->options.hints, init->options.name,
          detail::cat("[rank ", rank_, "/", size_, " ", options_.name, " split] nccl: "));
    DeviceGuard guard(*api_, device_, prefix_);
    ncclComm_t sub = nullptr;
    nccl_check(*api_, comm_, prefix_, "ncclCommSplit",
               api_->comm_split(comm_, color, key, &sub, config ? config->get() : nullptr));
    if (!init) return nullptr;
    return std::make_unique<NcclBackend>(*init, api_, sub, std::move(*config));
  }
  void abort() override;
  void finalize() override;

  // NOTE [nccl call check]: with the default setting this backend compares collectives itself,
  // beside the op, so the communicator runs no check through the store.
  bool checks_calls(const OpContext& ctx) const override {
    return size_ > 1 && op_mode(ctx) == CheckMode::kDefault;
  }

 private:
  // FASTCOMMS_CHECK_CALLS, or the hint check_calls (NOTE [nccl call check]): off, the default
  // (beside the op), or strict (the communicator's check, through the store, before data moves).
  using CheckMode = CallCheckMode;
  // The op's mode: its hint check_calls (as the communicator reads it), else the communicator's.
  // Every rank must give an op the same.
  CheckMode op_mode(const OpContext& ctx) const {
    return op_call_check_mode(ctx, mode_, {"check_calls"});
  }
  template <typename Fn>
  WorkPtr run(const OpContext& c, Fn&& issue, bool collective_kernels = false);
  // An op made of NCCL collectives (not of sends and receives): with nccl.check_calls_fuse=1
  // its call check's all-gather joins its NCCL group (NOTE [nccl call check]).
  template <typename Fn>
  WorkPtr run_collective(const OpContext& c, Fn&& issue) {
    return run(c, std::forward<Fn>(issue), true);
  }
  // NOTE [nccl call check]: compares the checks whose fingerprints landed (without blocking) and
  // aborts the communicator on a mismatch. `relaxed`: this thread's capture mode is relaxed
  // already (the watchdog's). mu_ held by `lock`, released around ncclCommAbort.
  void sync_checks_locked(std::unique_lock<std::mutex>& lock, bool relaxed);
  // Fails the ops in flight with the mismatch and aborts the communicator; mu_ held by `lock`.
  void abort_for_mismatch(std::unique_lock<std::mutex>& lock);
  // Marks the communicator aborted for `why` and calls ncclCommAbort; mu_ held by `lock`, which it
  // releases around the call.
  void abort_comm_locked(std::unique_lock<std::mutex>& lock, const std::string& why);
  // Issues fn's calls as one NCCL group (one launch; a batch's sends and receives are matched
  // together, so no rank waits on a peer's later call).
  template <typename Fn>
  void group(const OpContext& c, Fn&& fn) {
    check(c, "ncclGroupStart", api_->group_start());
    try {
      fn();
    } catch (...) {
      // The call's own error is the one raised; the group is closed so this thread's next NCCL
      // call does not join it. NCCL's ncclGroupEnd then returns the group's error, usually the
      // same one, so its result goes to the log at info level only.
      const ncclResult_t r = api_->group_end();
      if (r != ncclSuccess)
        FASTCOMMS_LOG(kInfo, c.prefix,
                      "nccl: ncclGroupEnd closing the group after the failed call: ",
                      nccl_result_text(*api_, comm_, r));
      throw;
    }
    check(c, "ncclGroupEnd", api_->group_end());
  }
  // Throws the Error of a failed NCCL call of op `c` (NOTE [nccl error codes]).
  void check(const OpContext& c, const char* call, ncclResult_t r) const {
    nccl_check(*api_, comm_, c.prefix + "nccl: ", call, r);
  }
  // Throws kAborted (with why, where the backend aborted itself) once the communicator is aborted;
  // `prefix` ends with "nccl: ".
  void check_usable(const std::string& prefix) {
    std::lock_guard<std::mutex> lock(mu_);
    check_usable_locked(prefix);
  }
  void check_usable_locked(const std::string& prefix) {
    // NOTE [nccl call check]: a mismatch is the callers' error, raised by every later call.
    if (!mismatch_.empty()) {
      mismatch_raised_ = true;
      throw Error(
          ErrorCode::kInvalidArgument,
          detail::cat(prefix,
                      "the communicator was aborted after a mismatched collective: ", mismatch_));
    }
    if (aborted_)
      throw Error(ErrorCode::kAborted,
                  detail::cat(prefix, "the communicator was aborted",
                              abort_reason_.empty() ? "" : " after ", abort_reason_));
  }
  template <typename Fn>
  void with_op(const ReduceOp& op, DType t, ncclDataType_t dt, const OpContext& c, Fn&& fn);
  void watchdog();

  // Aborts the communicator (NOTE [nccl backend streams]); `why` is logged. Called with mu_ held
  // by `lock`, which it releases around the process abort and ncclCommAbort.
  void abort_from_watchdog(std::unique_lock<std::mutex>& lock, const std::string& why);

  std::shared_ptr<NcclApi> api_;  // NOTE [nccl seam]: first, so it outlives every member
  int rank_, size_, device_;
  std::string prefix_;
  CommOptions options_;
  std::shared_ptr<ProcessAbort> process_abort_;  // NOTE [process abort]
  NcclConfig config_;                            // NOTE [nccl config hints]
  ncclComm_t comm_ = nullptr;
  Stream stream_;
  Event ready_;
  DeviceBuffer barrier_buf_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<NcclWork>> in_flight_;
  std::atomic<bool> aborted_{false};
  std::string abort_reason_;  // why the watchdog aborted (empty: abort() was called); under mu_
  bool stop_ = false;
  std::thread watchdog_;
  int windows_ = 0;                    // windows made so far (their store namespace)
  std::map<void*, void*> registered_;  // NOTE [nccl memory registration]: pointer -> handle
  void drop_registrations();
  // NOTE [nccl call check]
  CheckMode mode_ = CheckMode::kDefault;
  std::shared_ptr<CallChecker> checker_;  // null at size 1
  std::mutex issue_mu_;           // one op's exchange and its NCCL calls go out together, in order
  uint64_t collectives_ = 0;      // collectives issued (under issue_mu_): their sequence numbers
  std::string mismatch_;          // the mismatch that aborted the communicator; under mu_
  bool mismatch_raised_ = false;  // a call raised it (else finalize() does); under mu_
};

NcclBackend::NcclBackend(const BackendInit& init, std::shared_ptr<NcclApi> api, ncclComm_t comm,
                         NcclConfig config)
    : api_(std::move(api)),
      rank_(init.rank),
      size_(init.size),
      device_(init.device.index),
      prefix_(detail::cat("[rank ", init.rank, "/", init.size, " ", init.options.name,
                          " new_comm] nccl: ")),
      options_(init.options),
      process_abort_(init.process_abort),
      config_(std::move(config)),
      comm_(comm),
      stream_(on_device(*api_, init, prefix_), config_.high_priority_stream(), prefix_),
      ready_(*api_, prefix_),
      barrier_buf_(*api_, sizeof(int), prefix_) {
  // NOTE [nccl call check]: the setting, the same on every rank (checked below), since a checked
  // call's all-gather would otherwise meet a peer's op.
  CheckPlacement placement;
  {
    const auto hint = [&](const char* name, const char* otherwise) {
      auto it = init.options.hints.find(name);
      return it == init.options.hints.end() ? std::string(otherwise) : it->second;
    };
    // Opt-in here (FASTCOMMS_CHECK_CALLS=1 or the hint): issue 39 puts the check beside the op
    // on by default only where it costs <= 3% from 1 MiB, which needs two GPUs to measure and
    // has not been measured yet (docs/reliability.md). Unset, nccl and nvlink check nothing.
    const char* e = std::getenv("FASTCOMMS_CHECK_CALLS");
    const std::string v = hint("check_calls", e ? e : "0");
    const std::string fuse = hint("nccl.check_calls_fuse", "0");
    const std::string memory = hint("nccl.check_calls_memory", "device");
    FASTCOMMS_CHECK(parse_call_check_mode(v, &mode_), kInvalidArgument, prefix_,
                    "check_calls (hint check_calls or FASTCOMMS_CHECK_CALLS) must be 0, 1 or "
                    "strict, got '",
                    v, "'");
    FASTCOMMS_CHECK(fuse == "0" || fuse == "1", kInvalidArgument, prefix_,
                    "hint nccl.check_calls_fuse must be 0 or 1, got '", fuse, "'");
    FASTCOMMS_CHECK(memory == "device" || memory == "host", kInvalidArgument, prefix_,
                    "hint nccl.check_calls_memory must be device or host, got '", memory, "'");
    placement.fuse = fuse == "1";
    placement.mapped = memory == "host";
    if (size_ > 1) {
      const std::string mine = detail::cat(v, " fuse=", fuse, " memory=", memory);
      init.options.store->set_string(detail::cat("check_calls/", rank_), mine);
      const int peer = rank_ == 0 ? 1 : 0;
      const auto got =
          init.options.store->get(detail::cat("check_calls/", peer), init.options.timeout);
      const std::string theirs(got.begin(), got.end());
      FASTCOMMS_CHECK(theirs == mine, kInvalidArgument, prefix_, "rank ", peer,
                      " runs the call check as '", theirs, "' and this rank as '", mine,
                      "': every rank needs the same FASTCOMMS_CHECK_CALLS and hints check_calls, "
                      "nccl.check_calls_fuse and nccl.check_calls_memory (NOTE [nccl call "
                      "check])");
      checker_ = std::make_shared<CallChecker>(api_, size_, placement);
    }
  }
  if (comm_ == nullptr) {
    ncclUniqueId id;
    const std::string key = "nccl_unique_id";
    if (rank_ == 0) {
      nccl_check(*api_, nullptr, prefix_, "ncclGetUniqueId", api_->get_unique_id(&id));
      init.options.store->set(key,
                              std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                                   reinterpret_cast<uint8_t*>(&id) + sizeof id));
    } else {
      const auto v = init.options.store->get(key, init.options.timeout);
      FASTCOMMS_CHECK(v.size() == sizeof id, kInternal, prefix_, "malformed unique id: ", v.size(),
                      " bytes in the store, expected ", sizeof id);
      std::memcpy(&id, v.data(), sizeof id);
    }
    // NOTE [nccl config hints]
    nccl_check(*api_, nullptr, prefix_, "ncclCommInitRankConfig",
               api_->comm_init_rank_config(&comm_, size_, id, rank_, config_.get()));
  }
  {
    // Landed before the first barrier, which runs on a non-blocking stream that a plain
    // cudaMemset does not order (NOTE [legacy stream ordering], fastcomms/cuda/runtime.hpp); on
    // a stream of its own, so the caller's other work on the device is not waited for.
    Stream zero(*api_, false, prefix_);
    cuda_check(*api_, prefix_, "cudaMemsetAsync",
               api_->cuda_memset_async(barrier_buf_.get(), 0, sizeof(int), zero.get()));
    cuda_check(*api_, prefix_, "cudaStreamSynchronize", api_->cuda_stream_synchronize(zero.get()));
  }
  watchdog_ = std::thread([this] { watchdog(); });
}

void NcclBackend::drop_registrations() {
  std::map<void*, void*> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(registered_);
  }
  for (auto& [ptr, handle] : left) {
    const ncclResult_t r = api_->comm_deregister(comm_, handle);
    if (r != ncclSuccess)
      FASTCOMMS_LOG(kWarn, prefix_, "ncclCommDeregister of a registration left at ", ptr,
                    " failed: ", nccl_result_text(*api_, comm_, r));
  }
}

NcclBackend::~NcclBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (comm_) {
    (void)api_->cuda_set_device(device_);
    if (!aborted_) drop_registrations();
    const bool abort = aborted_;
    const ncclResult_t r = abort ? api_->comm_abort(comm_) : api_->comm_destroy(comm_);
    if (r != ncclSuccess)
      FASTCOMMS_LOG(kWarn, prefix_, abort ? "ncclCommAbort" : "ncclCommDestroy",
                    " at destruction failed: ", nccl_result_text(*api_, nullptr, r));
  }
  // NOTE [nccl call check]: its slots go with the communicator, and the works it held.
  if (checker_) checker_->close();
}

template <typename Fn>
WorkPtr NcclBackend::run(const OpContext& c, Fn&& issue, bool collective_kernels) {
  const std::string prefix = c.prefix + "nccl: ";
  DeviceGuard guard(*api_, device_, prefix);
  cudaStream_t caller = as_stream(c.stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(*api_, prefix, "cudaStreamIsCapturing",
             api_->cuda_stream_is_capturing(caller, &capture));
  const bool captured = capture != cudaStreamCaptureStatusNone;
  {
    std::unique_lock<std::mutex> lock(mu_);
    // NOTE [nccl call check]: a mismatch whose fingerprints landed raises here at the latest
    // (not while capturing: a capture may not query events).
    if (!captured) sync_checks_locked(lock, /*relaxed=*/false);
    check_usable_locked(prefix);
  }
  const bool collective =
      c.op != OpKind::kSend && c.op != OpKind::kRecv && c.op != OpKind::kBatchP2P;
  // Captured calls are not checked: their fingerprints would be the capture's, replayed.
  const bool checked = collective && checker_ && !captured && c.fingerprint.op >= 0 &&
                       op_mode(c) == CheckMode::kDefault;
  std::lock_guard<std::mutex> issuing(issue_mu_);  // the exchange and the op, in one order
  const cudaStream_t s = stream_.get();
  cuda_check(*api_, prefix, "cudaEventRecord", api_->cuda_event_record(ready_.get(), caller));
  cuda_check(*api_, prefix, "cudaStreamWaitEvent",
             api_->cuda_stream_wait_event(s, ready_.get(), 0));
  if (collective) ++collectives_;
  int slot = -1;
  bool posted = false, landed = false;
  std::shared_ptr<NcclWork> work;
  try {
    if (checked) {
      // NOTE [nccl call check]: this rank's fingerprint, all-gathered just before the op.
      slot = checker_->acquire(
          encode_wire(c.fingerprint, c.peer_out, c.peer_in, collectives_, rank_, size_), prefix);
      checker_->stage(slot, s, prefix);
      const auto exchange = [&] {
        check(c, "ncclAllGather",
              api_->all_gather(checker_->send_buffer(slot), checker_->recv_buffer(slot),
                               sizeof(WireFingerprint), ncclUint8, comm_, s));
      };
      if (checker_->placement().fuse && collective_kernels) {
        group(c, [&] {
          exchange();
          issue(s);
        });
        posted = true;
        checker_->land(slot, s, prefix);
        landed = true;
      } else {
        exchange();
        posted = true;
        checker_->land(slot, s, prefix);
        landed = true;
        issue(s);
        checker_->join(slot, s, prefix);
      }
    } else {
      issue(s);
    }
    Event done(*api_, prefix);
    cuda_check(*api_, prefix, "cudaEventRecord", api_->cuda_event_record(done.get(), s));
    work =
        std::make_shared<NcclWork>(api_, done.release(), caller, c, checked ? checker_ : nullptr);
  } catch (...) {
    if (slot >= 0) {
      if (!posted)
        checker_->abandon(slot);
      else if (!landed)  // no event says when its fingerprints land: this rank stops comparing
        checker_->cancel();
      else  // compared all the same: the peers' ops went out
        checker_->track(slot, c.fingerprint, nullptr);
    }
    throw;
  }
  if (slot >= 0) checker_->track(slot, c.fingerprint, work);
  if (!captured) {  // captured ops have no timeline to watch
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.push_back(work);
  }
  cv_.notify_all();
  return work;
}

void NcclBackend::sync_checks_locked(std::unique_lock<std::mutex>& lock, bool relaxed) {
  if (!checker_ || aborted_) return;
  bool mismatched = false;
  if (!checker_->pending()) {  // nothing to query (a work's status() may have found one)
    mismatched = !checker_->mismatch().empty();
  } else if (relaxed) {
    mismatched = checker_->poll();
  } else {
    RelaxedCapture relax(*api_);  // NOTE [watchdog and graph capture]
    mismatched = checker_->poll();
  }
  if (mismatched) abort_for_mismatch(lock);
}

void NcclBackend::abort_for_mismatch(std::unique_lock<std::mutex>& lock) {
  mismatch_ = checker_->mismatch();
  // The mismatched op's work and the checked ones after it failed already (the first failure
  // wins); the rest in flight (sends and receives after it) end here.
  for (const auto& w : in_flight_)
    if (!w->done())
      w->fail(ErrorCode::kInvalidArgument,
              "the communicator was aborted after a mismatched collective: " + mismatch_);
  in_flight_.clear();
  FASTCOMMS_LOG(kError, "[rank ", rank_, "/", size_, " ", options_.name,
                " call check] nccl: a mismatched collective: ", mismatch_,
                "; aborting the communicator");
  abort_comm_locked(lock, "a mismatched collective");
}

void NcclBackend::abort_comm_locked(std::unique_lock<std::mutex>& lock, const std::string& why) {
  abort_reason_ = why;
  aborted_ = true;
  // NOTE [nccl call check]: what lands after the abort is no peer's call.
  if (checker_) checker_->cancel();
  const ncclComm_t comm = std::exchange(comm_, nullptr);
  lock.unlock();
  (void)api_->cuda_set_device(device_);
  // Ends the stuck kernels; the communicator is unusable after.
  const ncclResult_t r = api_->comm_abort(comm);
  if (r != ncclSuccess)
    FASTCOMMS_LOG(kWarn, prefix_, "ncclCommAbort failed: ", nccl_result_text(*api_, nullptr, r));
  lock.lock();
}

template <typename Fn>
void NcclBackend::with_op(const ReduceOp& op, DType t, ncclDataType_t dt, const OpContext& c,
                          Fn&& fn) {
  switch (op.type) {
    case RedOpType::kSum:
      return fn(ncclSum);
    case RedOpType::kProduct:
      return fn(ncclProd);
    case RedOpType::kMin:
      return fn(ncclMin);
    case RedOpType::kMax:
      return fn(ncclMax);
    case RedOpType::kAvg:
      // Integers too: NCCL divides the sum by the world size, truncating toward zero (torchcomms
      // passes ncclAvg for every type).
      return fn(ncclAvg);
    case RedOpType::kPremulSum: {
      ncclRedOp_t r;
      if (op.has_factor_tensor()) {
        // NOTE [device factor]: NCCL reads the scalar on the device when the op runs (no host
        // sync); the communicator checked its device and dtype (the reduction's).
        check(c, "ncclRedOpCreatePreMulSum",
              api_->red_op_create_pre_mul_sum(&r, op.factor_tensor.data, dt, ncclScalarDevice,
                                              comm_));
      } else {
        // NCCL copies a host scalar of the reduction's type at this call: the factor in that
        // type's bits (torchcomms passes a float for bfloat16, whose first two bytes NCCL would
        // read, and so refuses a number factor on bfloat16; this backend takes it).
        union {
          double f64;
          float f32;
          uint16_t f16;
        } scalar{};
        switch (t) {
          case DType::kFloat64:
            scalar.f64 = op.factor;
            break;
          case DType::kFloat32:
            scalar.f32 = static_cast<float>(op.factor);
            break;
          case DType::kFloat16:
            scalar.f16 = float_to_half(static_cast<float>(op.factor));
            break;
          case DType::kBFloat16:
            scalar.f16 = float_to_bf16(static_cast<float>(op.factor));
            break;
          default:
            throw Error(ErrorCode::kUnsupported,
                        detail::cat(c.prefix, "PREMUL_SUM on ", dtype_name(t),
                                    " is not supported by NCCL (float16, bfloat16, float32, "
                                    "float64)"));
        }
        check(c, "ncclRedOpCreatePreMulSum",
              api_->red_op_create_pre_mul_sum(&r, &scalar, dt, ncclScalarHostImmediate, comm_));
      }
      try {
        fn(r);
      } catch (...) {
        // The op's own error is the one raised; a failing destroy after it is logged.
        const ncclResult_t d = api_->red_op_destroy(r, comm_);
        if (d != ncclSuccess)
          FASTCOMMS_LOG(kWarn, c.prefix, "nccl: ncclRedOpDestroy after a failed call failed too: ",
                        nccl_result_text(*api_, comm_, d));
        throw;
      }
      check(c, "ncclRedOpDestroy", api_->red_op_destroy(r, comm_));
      return;
    }
    case RedOpType::kBand:
    case RedOpType::kBor:
    case RedOpType::kBxor:
      throw Error(ErrorCode::kUnsupported,
                  detail::cat(c.prefix, red_op_name(op.type), " is not supported by NCCL"));
  }
}

void NcclBackend::watchdog() {
  // NOTE [watchdog and graph capture]: the watchdog queries events while the caller's thread may
  // be capturing a CUDA graph in global mode (torch.cuda.graph's default). A query from any
  // thread in global mode invalidates that capture (seen on 2xH200: cudaErrorStreamCapture-
  // Invalidated at capture end); relaxed mode exempts this thread, which touches no stream.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
  (void)api_->cuda_thread_exchange_stream_capture_mode(&mode);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, kWatchdogTick);
    if (stop_ || aborted_) continue;
    // NOTE [nccl call check]: before the timeouts, so an op that hangs because its call was
    // mismatched ends with the mismatch, not a timeout.
    sync_checks_locked(lock, /*relaxed=*/true);
    if (stop_ || aborted_) continue;
    const auto now = Clock::now();
    while (!in_flight_.empty() && in_flight_.front()->done()) in_flight_.pop_front();
    // NOTE [nccl async errors]: a failure NCCL finds outside a call (a peer that died, a network
    // error on its proxy thread) is the communicator's asynchronous error; the ops in flight end
    // with it and the communicator is aborted, as on a timeout. Polled under mu_, so abort()
    // cannot take the communicator away meanwhile.
    ncclResult_t async = ncclSuccess;
    const ncclResult_t polled = api_->comm_get_async_error(comm_, &async);
    if (polled != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      const ncclResult_t r = polled != ncclSuccess ? polled : async;
      const std::string why = detail::cat(polled != ncclSuccess ? "ncclCommGetAsyncError failed: "
                                                                : "ncclCommGetAsyncError reported ",
                                          nccl_result_text(*api_, comm_, r));
      for (const auto& w : in_flight_)
        if (!w->done())
          w->fail(nccl_error_code(r), detail::cat("the communicator failed while this op was in "
                                                  "flight (",
                                                  why, "); the communicator was aborted"));
      abort_from_watchdog(lock, why);
      continue;
    }
    std::string why;  // the first op in flight that outlived its timeout
    for (const auto& w : in_flight_)
      if (why.empty() && !w->done() && w->overdue(now)) why = w->timed_out();
    if (why.empty()) continue;
    for (const auto& w : in_flight_)
      if (!w->done()) w->mark(w->overdue(now) ? NcclWork::kTimedOut : NcclWork::kAborted);
    abort_from_watchdog(lock, why);
  }
}

void NcclBackend::abort_from_watchdog(std::unique_lock<std::mutex>& lock, const std::string& why) {
  in_flight_.clear();
  const std::string where =
      detail::cat("[rank ", rank_, "/", size_, " ", options_.name, " watchdog] nccl: ");
  FASTCOMMS_LOG(kError, where, why, "; aborting the communicator");
  if (options_.abort_process_on_timeout_or_error) {
    lock.unlock();  // NOTE [process abort]: the communicator's abort hooks run first
    process_abort_->abort_process(where + why);
  }
  abort_comm_locked(lock, why);
}

void NcclBackend::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.exchange(true)) return;
  for (const auto& w : in_flight_)
    if (!w->done()) w->mark(NcclWork::kAborted);
  in_flight_.clear();
  if (checker_) checker_->cancel();  // NOTE [nccl call check]: nothing lands from peers now
  if (comm_) {
    (void)api_->cuda_set_device(device_);
    const ncclResult_t r = api_->comm_abort(comm_);
    if (r != ncclSuccess)
      FASTCOMMS_LOG(kWarn, prefix_, "ncclCommAbort failed: ", nccl_result_text(*api_, nullptr, r));
    comm_ = nullptr;
  }
}

void NcclBackend::finalize() {
  // NOTE [nccl call check]: a mismatch no call raised yet (a sync op's caller never hears of its
  // op again) is raised here, once the last checks are compared.
  const auto raise_mismatch = [&](std::unique_lock<std::mutex>&) {
    if (mismatch_.empty() || mismatch_raised_ || (checker_ && checker_->raised())) return;
    mismatch_raised_ = true;
    throw Error(ErrorCode::kInvalidArgument,
                detail::cat("[rank ", rank_, "/", size_, " ", options_.name,
                            " finalize] nccl: a collective was mismatched across ranks and the "
                            "communicator was aborted: ",
                            mismatch_));
  };
  {
    std::unique_lock<std::mutex> lock(mu_);
    raise_mismatch(lock);
    if (aborted_) return;
  }
  DeviceGuard guard(*api_, device_, prefix_);
  cuda_check(*api_, prefix_, "cudaStreamSynchronize", api_->cuda_stream_synchronize(stream_.get()));
  {
    std::unique_lock<std::mutex> lock(mu_);
    sync_checks_locked(lock, /*relaxed=*/false);  // every op's fingerprints landed by now
    raise_mismatch(lock);
    if (aborted_) return;  // the watchdog aborted it meanwhile
  }
  drop_registrations();  // NOTE [nccl memory registration]
}

}  // namespace

std::unique_ptr<Backend> make_nccl_backend(const BackendInit& init, std::shared_ptr<NcclApi> api) {
  // NOTE [nccl config hints]: read before anything is made, so a bad hint frees nothing.
  NcclConfig config(init.options.hints, init.options.name,
                    detail::cat("[rank ", init.rank, "/", init.size, " ", init.options.name,
                                " new_comm] nccl: "));
  return make_nccl_backend(init, std::move(api), std::move(config));
}

std::unique_ptr<Backend> make_nccl_backend(const BackendInit& init, std::shared_ptr<NcclApi> api,
                                           NcclConfig config) {
  FASTCOMMS_CHECK(api != nullptr, kInvalidArgument, "[rank ", init.rank, "/", init.size, " ",
                  init.options.name, " new_comm] nccl: ", "the NCCL API must not be null");
  return std::make_unique<NcclBackend>(init, std::move(api), nullptr, std::move(config));
}

namespace {
const StaticBackendRegistration kRegistration("nccl", [](const BackendInit& init) {
  return make_nccl_backend(init, real_nccl_api());
});
}  // namespace
}  // namespace fastcomms::nccl_backend
