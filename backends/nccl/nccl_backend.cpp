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
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <utility>

#include "backends/ipc/ipc_window.hpp"
#include "backends/nccl/nccl_api.hpp"
#include "backends/nccl/nccl_backend.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/log.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::nccl_backend {
namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at the ops in flight and at the communicator's asynchronous error.
constexpr std::chrono::milliseconds kWatchdogTick{50};

const char* nccl_result_name(ncclResult_t r) {
  switch (r) {
    case ncclSuccess:
      return "ncclSuccess";
    case ncclUnhandledCudaError:
      return "ncclUnhandledCudaError";
    case ncclSystemError:
      return "ncclSystemError";
    case ncclInternalError:
      return "ncclInternalError";
    case ncclInvalidArgument:
      return "ncclInvalidArgument";
    case ncclInvalidUsage:
      return "ncclInvalidUsage";
    case ncclRemoteError:
      return "ncclRemoteError";
    case ncclInProgress:
      return "ncclInProgress";
    case ncclNumResults:
      break;
  }
  return "an unknown ncclResult_t";
}

// NOTE [nccl error codes]: what a failed NCCL call raises. An argument or a usage NCCL refuses is
// the caller's (kInvalidArgument: a ValueError in Python, and never a process abort, the
// communicator still works); a CUDA failure inside NCCL is kCudaError; a system, remote (a peer
// failed) or internal NCCL failure is the transport's (kBackendError). ncclInProgress cannot come
// from the blocking communicators this backend makes, so it is a broken invariant (kInternal).
ErrorCode nccl_error_code(ncclResult_t r) {
  switch (r) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return ErrorCode::kInvalidArgument;
    case ncclUnhandledCudaError:
      return ErrorCode::kCudaError;
    case ncclInProgress:
      return ErrorCode::kInternal;
    default:
      return ErrorCode::kBackendError;
  }
}

// "ncclSystemError (unhandled system error); NCCL's last error: ...": a result in words.
std::string nccl_result_text(NcclApi& api, ncclComm_t comm, ncclResult_t r) {
  std::string text = detail::cat(nccl_result_name(r), " (", api.get_error_string(r), ")");
  if (comm != nullptr) {
    const char* last = api.get_last_error(comm);
    if (last != nullptr && *last != '\0') text += detail::cat("; NCCL's last error: ", last);
  }
  return text;
}

// Throws the Error of a failed NCCL call: `prefix` (rank, communicator, op), the call, its result.
void nccl_check(NcclApi& api, ncclComm_t comm, const std::string& prefix, const char* call,
                ncclResult_t r) {
  if (r != ncclSuccess) [[unlikely]]
    throw Error(nccl_error_code(r),
                detail::cat(prefix, call, " failed: ", nccl_result_text(api, comm, r)));
}

// Throws kCudaError for a failed CUDA runtime call: `prefix`, the call, the CUDA error.
void cuda_check(NcclApi& api, const std::string& prefix, const char* call, cudaError_t err) {
  if (err != cudaSuccess) [[unlikely]]
    throw Error(ErrorCode::kCudaError,
                detail::cat(prefix, call, " failed: ", api.cuda_get_error_name(err), " (",
                            api.cuda_get_error_string(err), ")"));
}

// RAII over the seam (NOTE [nccl seam]), as fastcomms/cuda/runtime.hpp has over the runtime:
// copy deleted, destructors do local work only and never throw.
class DeviceGuard {
 public:
  DeviceGuard(NcclApi& api, int device, const std::string& prefix) : api_(api) {
    cuda_check(api_, prefix, "cudaGetDevice", api_.cuda_get_device(&previous_));
    if (device != previous_)
      cuda_check(api_, prefix, "cudaSetDevice", api_.cuda_set_device(device));
  }
  ~DeviceGuard() { (void)api_.cuda_set_device(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  NcclApi& api_;
  int previous_ = 0;
};

// A non-blocking stream of the current device.
class Stream {
 public:
  Stream(NcclApi& api, bool high_priority, const std::string& prefix) : api_(&api) {
    int lo = 0, hi = 0;
    cuda_check(*api_, prefix, "cudaDeviceGetStreamPriorityRange",
               api_->cuda_device_get_stream_priority_range(&lo, &hi));
    cuda_check(*api_, prefix, "cudaStreamCreateWithPriority",
               api_->cuda_stream_create_with_priority(&s_, cudaStreamNonBlocking,
                                                      high_priority ? hi : lo));
  }
  ~Stream() {
    if (s_) (void)api_->cuda_stream_destroy(s_);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
  cudaStream_t get() const { return s_; }

 private:
  NcclApi* api_;
  cudaStream_t s_ = nullptr;
};

// An event without timing.
class Event {
 public:
  Event(NcclApi& api, const std::string& prefix) : api_(&api) {
    cuda_check(*api_, prefix, "cudaEventCreateWithFlags",
               api_->cuda_event_create_with_flags(&e_, cudaEventDisableTiming));
  }
  ~Event() {
    if (e_) (void)api_->cuda_event_destroy(e_);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
  cudaEvent_t get() const { return e_; }
  cudaEvent_t release() { return std::exchange(e_, nullptr); }

 private:
  NcclApi* api_;
  cudaEvent_t e_ = nullptr;
};

// Device memory of the current device.
class DeviceBuffer {
 public:
  DeviceBuffer(NcclApi& api, size_t bytes, const std::string& prefix) : api_(&api) {
    cuda_check(*api_, prefix, "cudaMalloc", api_->cuda_malloc(&p_, bytes));
  }
  ~DeviceBuffer() {
    if (p_) (void)api_->cuda_free(p_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* get() const { return p_; }

 private:
  NcclApi* api_;
  void* p_ = nullptr;
};

// Checks that `init` names a CUDA device and makes it current, before the backend makes anything
// on it; returns `api`.
NcclApi& on_device(NcclApi& api, const BackendInit& init, const std::string& prefix) {
  FASTCOMMS_CHECK(init.device.type == DeviceType::kCUDA && init.device.index >= 0, kInvalidArgument,
                  prefix, "the nccl backend serves CUDA devices, got ", init.device.str());
  cuda_check(api, prefix, "cudaSetDevice", api.cuda_set_device(init.device.index));
  return api;
}

// The hint nccl.high_priority=1 puts the internal stream at the device's highest priority.
bool high_priority(const BackendInit& init) {
  const auto it = init.options.hints.find("nccl.high_priority");
  return it != init.options.hints.end() && it->second == "1";
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
class NcclWork : public Work {
 public:
  NcclWork(std::shared_ptr<NcclApi> api, cudaEvent_t done, cudaStream_t caller, const OpContext& c)
      : api_(std::move(api)),
        done_(done),
        caller_(caller),
        prefix_(c.prefix),
        what_(detail::cat(op_name(c.op), " (op ", c.op_id, ")")),
        timeout_(c.timeout),
        deadline_(Clock::now() + c.timeout) {}
  ~NcclWork() override { (void)api_->cuda_event_destroy(done_); }

  WorkStatus status() const override {
    const int s = state_.load();
    if (s == kTimedOut) return WorkStatus::kTimedOut;
    if (s == kAborted || s == kFailed) return WorkStatus::kError;
    const cudaError_t err = api_->cuda_event_query(done_);
    if (err == cudaSuccess) return WorkStatus::kCompleted;
    if (err == cudaErrorNotReady) return WorkStatus::kInProgress;
    (void)api_->cuda_get_last_error();
    return WorkStatus::kError;
  }
  void wait() override {
    const int s = state_.load();
    if (s == kTimedOut)
      throw Error(ErrorCode::kTimeout,
                  detail::cat(prefix_, "nccl: timed out after ", timeout_.count(),
                              " ms; the communicator was aborted"));
    if (s == kAborted)
      throw Error(ErrorCode::kAborted, prefix_ + "nccl: the communicator was aborted");
    if (s == kFailed) throw Error(failed_code_, prefix_ + "nccl: " + failed_why_);
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
  void mark(int s) { state_.store(s); }
  // NOTE [nccl async errors]: the communicator failed under this op.
  void fail(ErrorCode code, std::string why) {
    failed_code_ = code;
    failed_why_ = std::move(why);
    state_.store(kFailed);  // publishes the two above
  }
  static constexpr int kRunning = 0, kTimedOut = 1, kAborted = 2, kFailed = 3;

 private:
  std::shared_ptr<NcclApi> api_;
  cudaEvent_t done_;
  cudaStream_t caller_;
  std::string prefix_;  // the op's, "[rank r/n comm op] "
  std::string what_;
  std::chrono::milliseconds timeout_;
  Clock::time_point deadline_;
  ErrorCode failed_code_ = ErrorCode::kBackendError;
  std::string failed_why_;
  std::atomic<int> state_{kRunning};
};

class NcclBackend : public Backend {
 public:
  // `comm` null: a new communicator by unique id through the store; else a split's, now owned.
  NcclBackend(const BackendInit& init, std::shared_ptr<NcclApi> api, ncclComm_t comm);
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
    return run(c, [&](cudaStream_t s) {
      check(c, "ncclBroadcast",
            api_->broadcast(t.data, t.data, nbytes(t), ncclUint8, root, comm_, s));
    });
  }
  WorkPtr all_reduce(const TensorView& t, const ReduceOp& op, const OpContext& c) override {
    const ncclDataType_t dt = nccl_type(t.dtype, c.prefix);
    return run(c, [&](cudaStream_t s) {
      with_op(op, t.dtype, dt, c, [&](ncclRedOp_t r) {
        check(c, "ncclAllReduce", api_->all_reduce(t.data, t.data, t.numel(), dt, r, comm_, s));
      });
    });
  }
  WorkPtr reduce(const TensorView& t, int root, const ReduceOp& op, const OpContext& c) override {
    const ncclDataType_t dt = nccl_type(t.dtype, c.prefix);
    return run(c, [&](cudaStream_t s) {
      with_op(op, t.dtype, dt, c, [&](ncclRedOp_t r) {
        check(c, "ncclReduce", api_->reduce(t.data, t.data, t.numel(), dt, r, root, comm_, s));
      });
    });
  }
  WorkPtr all_gather(const std::vector<TensorView>& outputs, const TensorView& input,
                     const OpContext& c) override {
    // Every rank broadcasts its input into the matching output (sizes may differ per rank).
    return run(c, [&](cudaStream_t s) {
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
    return run(c, [&](cudaStream_t s) {
      check(c, "ncclAllGather",
            api_->all_gather(input.data, output.data, nbytes(input), ncclUint8, comm_, s));
    });
  }
  WorkPtr reduce_scatter(const TensorView& output, const std::vector<TensorView>& inputs,
                         const ReduceOp& op, const OpContext& c) override {
    // One reduce per rank into that rank's output (sizes may differ per rank).
    const ncclDataType_t dt = nccl_type(output.dtype, c.prefix);
    return run(c, [&](cudaStream_t s) {
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
    return run(c, [&](cudaStream_t s) {
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
    return run(c, [&](cudaStream_t s) {
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
  std::unique_ptr<Backend> split(const std::vector<int>& ranks, const BackendInit* init) override {
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
    DeviceGuard guard(*api_, device_, prefix_);
    ncclComm_t sub = nullptr;
    nccl_check(*api_, comm_, prefix_, "ncclCommSplit",
               api_->comm_split(comm_, color, key, &sub, nullptr));
    if (!init) return nullptr;
    return std::make_unique<NcclBackend>(*init, api_, sub);
  }
  void abort() override;
  void finalize() override;

 private:
  template <typename Fn>
  WorkPtr run(const OpContext& c, Fn&& issue);
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
  void check_usable_locked(const std::string& prefix) const {
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
};

NcclBackend::NcclBackend(const BackendInit& init, std::shared_ptr<NcclApi> api, ncclComm_t comm)
    : api_(std::move(api)),
      rank_(init.rank),
      size_(init.size),
      device_(init.device.index),
      prefix_(detail::cat("[rank ", init.rank, "/", init.size, " ", init.options.name,
                          " new_comm] nccl: ")),
      options_(init.options),
      process_abort_(init.process_abort),
      comm_(comm),
      stream_(on_device(*api_, init, prefix_), high_priority(init), prefix_),
      ready_(*api_, prefix_),
      barrier_buf_(*api_, sizeof(int), prefix_) {
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
    nccl_check(*api_, nullptr, prefix_, "ncclCommInitRank",
               api_->comm_init_rank(&comm_, size_, id, rank_));
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
}

template <typename Fn>
WorkPtr NcclBackend::run(const OpContext& c, Fn&& issue) {
  const std::string prefix = c.prefix + "nccl: ";
  check_usable(prefix);
  DeviceGuard guard(*api_, device_, prefix);
  cudaStream_t caller = as_stream(c.stream);
  cuda_check(*api_, prefix, "cudaEventRecord", api_->cuda_event_record(ready_.get(), caller));
  cuda_check(*api_, prefix, "cudaStreamWaitEvent",
             api_->cuda_stream_wait_event(stream_.get(), ready_.get(), 0));
  issue(stream_.get());
  Event done(*api_, prefix);
  cuda_check(*api_, prefix, "cudaEventRecord", api_->cuda_event_record(done.get(), stream_.get()));
  auto work = std::make_shared<NcclWork>(api_, done.release(), caller, c);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cuda_check(*api_, prefix, "cudaStreamIsCapturing",
             api_->cuda_stream_is_capturing(caller, &capture));
  if (capture == cudaStreamCaptureStatusNone) {  // captured ops have no timeline to watch
    std::lock_guard<std::mutex> lock(mu_);
    in_flight_.push_back(work);
  }
  cv_.notify_all();
  return work;
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
      FASTCOMMS_CHECK(!dtype_is_integral(t), kUnsupported, c.prefix, "AVG on ", dtype_name(t),
                      " is not supported by NCCL");
      return fn(ncclAvg);
    case RedOpType::kPremulSum: {
      ncclRedOp_t r;
      if (t == DType::kFloat64) {
        double f = op.factor;
        check(c, "ncclRedOpCreatePreMulSum",
              api_->red_op_create_pre_mul_sum(&r, &f, dt, ncclScalarHostImmediate, comm_));
      } else {
        // NCCL reads the host scalar in the reduction's type; half types take a float here only
        // through the float32 path.
        FASTCOMMS_CHECK(t == DType::kFloat32, kUnsupported, c.prefix, "PREMUL_SUM on ",
                        dtype_name(t), " is not supported yet");
        float f = static_cast<float>(op.factor);
        check(c, "ncclRedOpCreatePreMulSum",
              api_->red_op_create_pre_mul_sum(&r, &f, dt, ncclScalarHostImmediate, comm_));
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
  abort_reason_ = why;
  aborted_ = true;
  const ncclComm_t comm = std::exchange(comm_, nullptr);
  lock.unlock();
  (void)api_->cuda_set_device(device_);
  // Ends the stuck kernels; the communicator is unusable after.
  const ncclResult_t r = api_->comm_abort(comm);
  if (r != ncclSuccess)
    FASTCOMMS_LOG(kWarn, where, "ncclCommAbort failed: ", nccl_result_text(*api_, nullptr, r));
  lock.lock();
}

void NcclBackend::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.exchange(true)) return;
  for (const auto& w : in_flight_)
    if (!w->done()) w->mark(NcclWork::kAborted);
  in_flight_.clear();
  if (comm_) {
    (void)api_->cuda_set_device(device_);
    const ncclResult_t r = api_->comm_abort(comm_);
    if (r != ncclSuccess)
      FASTCOMMS_LOG(kWarn, prefix_, "ncclCommAbort failed: ", nccl_result_text(*api_, nullptr, r));
    comm_ = nullptr;
  }
}

void NcclBackend::finalize() {
  if (aborted_) return;
  DeviceGuard guard(*api_, device_, prefix_);
  cuda_check(*api_, prefix_, "cudaStreamSynchronize", api_->cuda_stream_synchronize(stream_.get()));
  drop_registrations();  // NOTE [nccl memory registration]
}

}  // namespace

std::unique_ptr<Backend> make_nccl_backend(const BackendInit& init, std::shared_ptr<NcclApi> api) {
  FASTCOMMS_CHECK(api != nullptr, kInvalidArgument, "[rank ", init.rank, "/", init.size, " ",
                  init.options.name, " new_comm] nccl: ", "the NCCL API must not be null");
  return std::make_unique<NcclBackend>(init, std::move(api), nullptr);
}

namespace {
const StaticBackendRegistration kRegistration("nccl", [](const BackendInit& init) {
  return make_nccl_backend(init, real_nccl_api());
});
}  // namespace
}  // namespace fastcomms::nccl_backend
