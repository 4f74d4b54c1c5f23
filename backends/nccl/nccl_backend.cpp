// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The nccl backend: every op of the communicator API on CUDA tensors through NCCL.
//
// NOTE [nccl backend streams]: each op is ordered after the caller's stream with an event, runs on
// the communicator's internal stream, and records a completion event. Work::wait() makes the
// caller's stream wait on that event (no host block); a sync op does the same before returning,
// so it is ordered on the caller's stream and capturable in a CUDA graph. A watchdog thread polls
// the completion events of ops in flight; one that outlives its timeout is marked TIMEDOUT and the
// communicator is aborted with ncclCommAbort (which ends the stuck kernels), or the process is
// aborted when abort_process_on_timeout_or_error is set.
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "backends/ipc/ipc_window.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::nccl_backend {
namespace {

using Clock = std::chrono::steady_clock;

#define FASTCOMMS_NCCL_CHECK(prefix, call)                                                  \
  do {                                                                                      \
    const ncclResult_t fc_r_ = (call);                                                      \
    if (fc_r_ != ncclSuccess)                                                               \
      throw ::fastcomms::Error(                                                             \
          ::fastcomms::ErrorCode::kBackendError,                                            \
          ::fastcomms::detail::cat(prefix, #call, " failed: ", ncclGetErrorString(fc_r_))); \
  } while (0)

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

// Completion of one op on the internal stream.
class NcclWork : public Work {
 public:
  NcclWork(cudaEvent_t done, cudaStream_t caller, std::string prefix, Clock::time_point deadline)
      : done_(done), caller_(caller), prefix_(std::move(prefix)), deadline_(deadline) {}
  ~NcclWork() override { (void)cudaEventDestroy(done_); }

  WorkStatus status() const override {
    const int s = state_.load();
    if (s == kTimedOut) return WorkStatus::kTimedOut;
    if (s == kAborted) return WorkStatus::kError;
    const cudaError_t err = cudaEventQuery(done_);
    if (err == cudaSuccess) return WorkStatus::kCompleted;
    if (err == cudaErrorNotReady) return WorkStatus::kInProgress;
    (void)cudaGetLastError();
    return WorkStatus::kError;
  }
  void wait() override {
    const int s = state_.load();
    if (s == kTimedOut)
      throw Error(ErrorCode::kTimeout, prefix_ + "timed out; the communicator was aborted");
    if (s == kAborted) throw Error(ErrorCode::kAborted, prefix_ + "the communicator was aborted");
    FASTCOMMS_CUDA_CHECK(cudaStreamWaitEvent(caller_, done_, 0));
  }
  // Watchdog side.
  bool overdue(Clock::time_point now) const { return now > deadline_; }
  bool done() const { return cudaEventQuery(done_) == cudaSuccess; }
  void mark(int s) { state_.store(s); }
  static constexpr int kRunning = 0, kTimedOut = 1, kAborted = 2;

 private:
  cudaEvent_t done_;
  cudaStream_t caller_;
  std::string prefix_;
  Clock::time_point deadline_;
  std::atomic<int> state_{kRunning};
};

class NcclBackend : public Backend {
 public:
  NcclBackend(const BackendInit& init, ncclComm_t comm);
  explicit NcclBackend(const BackendInit& init) : NcclBackend(init, nullptr) {}
  ~NcclBackend() override;

  std::string name() const override { return "nccl"; }
  std::string version() const override {
    int v = 0;
    ncclGetVersion(&v);
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
    FASTCOMMS_CHECK(!aborted_, kAborted, where, "the communicator was aborted");
    std::lock_guard<std::mutex> lock(mu_);
    FASTCOMMS_CHECK(!registered_.count(ptr), kInvalidArgument, where,
                    "this tensor's memory is registered already; call tensor_deregister first");
    cuda::DeviceGuard guard(device_);
    void* handle = nullptr;
    FASTCOMMS_NCCL_CHECK(where, ncclCommRegister(comm_, ptr, static_cast<size_t>(bytes), &handle));
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
    cuda::DeviceGuard guard(device_);
    FASTCOMMS_NCCL_CHECK(where, ncclCommDeregister(comm_, handle));
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
      group([&] {
        for (const P2POp& op : ops) {
          if (op.kind == P2POp::Kind::kSend)
            check(c, ncclSend(op.tensor.data, nbytes(op.tensor), ncclUint8, op.peer, comm_, s));
          else
            check(c, ncclRecv(op.tensor.data, nbytes(op.tensor), ncclUint8, op.peer, comm_, s));
        }
      });
    });
  }
  WorkPtr broadcast(const TensorView& t, int root, const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      check(c, ncclBroadcast(t.data, t.data, nbytes(t), ncclUint8, root, comm_, s));
    });
  }
  WorkPtr all_reduce(const TensorView& t, const ReduceOp& op, const OpContext& c) override {
    const ncclDataType_t dt = nccl_type(t.dtype, c.prefix);
    return run(c, [&](cudaStream_t s) {
      with_op(op, t.dtype, dt, c, [&](ncclRedOp_t r) {
        check(c, ncclAllReduce(t.data, t.data, t.numel(), dt, r, comm_, s));
      });
    });
  }
  WorkPtr reduce(const TensorView& t, int root, const ReduceOp& op, const OpContext& c) override {
    const ncclDataType_t dt = nccl_type(t.dtype, c.prefix);
    return run(c, [&](cudaStream_t s) {
      with_op(op, t.dtype, dt, c, [&](ncclRedOp_t r) {
        check(c, ncclReduce(t.data, t.data, t.numel(), dt, r, root, comm_, s));
      });
    });
  }
  WorkPtr all_gather(const std::vector<TensorView>& outputs, const TensorView& input,
                     const OpContext& c) override {
    // Every rank broadcasts its input into the matching output (sizes may differ per rank).
    return run(c, [&](cudaStream_t s) {
      group([&] {
        for (int r = 0; r < size_; ++r) {
          const void* src = r == rank_ ? input.data : outputs[r].data;
          check(c, ncclBroadcast(src, outputs[r].data, nbytes(outputs[r]), ncclUint8, r, comm_, s));
        }
      });
    });
  }
  WorkPtr all_gather_single(const TensorView& output, const TensorView& input,
                            const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      check(c, ncclAllGather(input.data, output.data, nbytes(input), ncclUint8, comm_, s));
    });
  }
  WorkPtr reduce_scatter(const TensorView& output, const std::vector<TensorView>& inputs,
                         const ReduceOp& op, const OpContext& c) override {
    // One reduce per rank into that rank's output (sizes may differ per rank).
    const ncclDataType_t dt = nccl_type(output.dtype, c.prefix);
    return run(c, [&](cudaStream_t s) {
      with_op(op, output.dtype, dt, c, [&](ncclRedOp_t r) {
        group([&] {
          for (int q = 0; q < size_; ++q)
            check(c, ncclReduce(inputs[q].data, q == rank_ ? output.data : nullptr,
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
        check(c, ncclReduceScatter(input.data, output.data, output.numel(), dt, r, comm_, s));
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
      group([&] {
        int64_t in_off = 0, out_off = 0;
        for (int q = 0; q < size_; ++q) {
          check(c,
                ncclSend(bytes(input) + in_off, input_splits[q] * in_row, ncclUint8, q, comm_, s));
          check(c, ncclRecv(bytes(output) + out_off, output_splits[q] * out_row, ncclUint8, q,
                            comm_, s));
          in_off += input_splits[q] * in_row;
          out_off += output_splits[q] * out_row;
        }
      });
    });
  }
  WorkPtr all_to_all(const std::vector<TensorView>& outputs, const std::vector<TensorView>& inputs,
                     const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      group([&] {
        for (int q = 0; q < size_; ++q) {
          check(c, ncclSend(inputs[q].data, nbytes(inputs[q]), ncclUint8, q, comm_, s));
          check(c, ncclRecv(outputs[q].data, nbytes(outputs[q]), ncclUint8, q, comm_, s));
        }
      });
    });
  }
  WorkPtr barrier(const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      check(c,
            ncclAllReduce(barrier_buf_.get(), barrier_buf_.get(), 1, ncclInt32, ncclSum, comm_, s));
    });
  }
  WorkPtr scatter(const TensorView& output, const std::vector<TensorView>& inputs, int root,
                  const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      group([&] {
        if (rank_ == root)
          for (int q = 0; q < size_; ++q)
            check(c, ncclSend(inputs[q].data, nbytes(output), ncclUint8, q, comm_, s));
        check(c, ncclRecv(output.data, nbytes(output), ncclUint8, root, comm_, s));
      });
    });
  }
  WorkPtr gather(const std::vector<TensorView>& outputs, const TensorView& input, int root,
                 const OpContext& c) override {
    return run(c, [&](cudaStream_t s) {
      group([&] {
        check(c, ncclSend(input.data, nbytes(input), ncclUint8, root, comm_, s));
        if (rank_ == root)
          for (int q = 0; q < size_; ++q)
            check(c, ncclRecv(outputs[q].data, nbytes(input), ncclUint8, q, comm_, s));
      });
    });
  }
  std::unique_ptr<Backend> split(const std::vector<int>& ranks, const BackendInit* init) override {
    // ncclCommSplit is collective over this communicator: every rank calls it, non-members with
    // NCCL_SPLIT_NOCOLOR. The color names the group (a hash of its sorted ranks), the key orders
    // the new ranks as `ranks` does.
    FASTCOMMS_CHECK(!aborted_, kAborted, prefix_, "the communicator was aborted");
    int color = NCCL_SPLIT_NOCOLOR, key = 0;
    if (init) {
      std::vector<int> sorted = ranks;
      std::sort(sorted.begin(), sorted.end());
      uint32_t h = 2166136261u;
      for (int r : sorted) h = (h ^ static_cast<uint32_t>(r)) * 16777619u;
      color = static_cast<int>(h & 0x3fffffff);
      key = init->rank;
    }
    cuda::DeviceGuard guard(device_);
    ncclComm_t sub = nullptr;
    FASTCOMMS_NCCL_CHECK(prefix_, ncclCommSplit(comm_, color, key, &sub, nullptr));
    if (!init) return nullptr;
    return std::make_unique<NcclBackend>(*init, sub);
  }
  void abort() override;
  void finalize() override;

 private:
  template <typename Fn>
  WorkPtr run(const OpContext& c, Fn&& issue);
  template <typename Fn>
  void group(Fn&& fn) {
    FASTCOMMS_NCCL_CHECK(prefix_, ncclGroupStart());
    try {
      fn();
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    FASTCOMMS_NCCL_CHECK(prefix_, ncclGroupEnd());
  }
  void check(const OpContext& c, ncclResult_t r) const {
    if (r != ncclSuccess)
      throw Error(ErrorCode::kBackendError, c.prefix + "NCCL failed: " + ncclGetErrorString(r));
  }
  template <typename Fn>
  void with_op(const ReduceOp& op, DType t, ncclDataType_t dt, const OpContext& c, Fn&& fn);
  void watchdog();

  int rank_, size_, device_;
  std::string prefix_;
  CommOptions options_;
  std::shared_ptr<ProcessAbort> process_abort_;  // NOTE [process abort]
  ncclComm_t comm_ = nullptr;
  cuda::Stream stream_;
  cuda::Event ready_;
  cuda::DeviceBuffer barrier_buf_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<NcclWork>> in_flight_;
  std::atomic<bool> aborted_{false};
  bool stop_ = false;
  std::thread watchdog_;
  int windows_ = 0;                    // windows made so far (their store namespace)
  std::map<void*, void*> registered_;  // NOTE [nccl memory registration]: pointer -> handle
  void drop_registrations();
};

NcclBackend::NcclBackend(const BackendInit& init, ncclComm_t comm)
    : rank_(init.rank),
      size_(init.size),
      device_(init.device.index),
      prefix_(detail::cat("[rank ", init.rank, "/", init.size, " ", init.options.name,
                          " new_comm] nccl: ")),
      options_(init.options),
      process_abort_(init.process_abort),
      comm_(comm),
      stream_([&] {
        FASTCOMMS_CHECK(init.device.type == DeviceType::kCUDA && init.device.index >= 0,
                        kInvalidArgument,
                        detail::cat("[rank ", init.rank, "/", init.size, " ", init.options.name,
                                    " new_comm] nccl: "),
                        "the nccl backend serves CUDA devices, got ", init.device.str());
        FASTCOMMS_CUDA_CHECK(cudaSetDevice(init.device.index));
        const auto it = init.options.hints.find("nccl.high_priority");
        return cuda::Stream(it != init.options.hints.end() && it->second == "1");
      }()),
      barrier_buf_(sizeof(int)) {
  if (comm_ == nullptr) {
    ncclUniqueId id;
    const std::string key = "nccl_unique_id";
    if (rank_ == 0) {
      FASTCOMMS_NCCL_CHECK(prefix_, ncclGetUniqueId(&id));
      init.options.store->set(key,
                              std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                                   reinterpret_cast<uint8_t*>(&id) + sizeof id));
    } else {
      const auto v = init.options.store->get(key, init.options.timeout);
      FASTCOMMS_CHECK(v.size() == sizeof id, kInternal, prefix_, "malformed unique id");
      std::memcpy(&id, v.data(), sizeof id);
    }
    FASTCOMMS_NCCL_CHECK(prefix_, ncclCommInitRank(&comm_, size_, id, rank_));
  }
  {
    // Landed before the first barrier, which runs on a non-blocking stream that a plain
    // cudaMemset does not order (NOTE [legacy stream ordering], fastcomms/cuda/runtime.hpp); on
    // a stream of its own, so the caller's other work on the device is not waited for.
    cuda::Stream zero;
    FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(barrier_buf_.get(), 0, sizeof(int), zero.get()));
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(zero.get()));
  }
  watchdog_ = std::thread([this] { watchdog(); });
}

void NcclBackend::drop_registrations() {
  std::map<void*, void*> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(registered_);
  }
  for (auto& [ptr, handle] : left) (void)ncclCommDeregister(comm_, handle);
}

NcclBackend::~NcclBackend() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  if (comm_) {
    (void)cudaSetDevice(device_);
    if (!aborted_) drop_registrations();
    if (aborted_)
      (void)ncclCommAbort(comm_);
    else
      (void)ncclCommDestroy(comm_);
  }
}

template <typename Fn>
WorkPtr NcclBackend::run(const OpContext& c, Fn&& issue) {
  FASTCOMMS_CHECK(!aborted_, kAborted, c.prefix, "the communicator was aborted");
  cuda::DeviceGuard guard(device_);
  cudaStream_t caller = as_stream(c.stream);
  ready_.record(caller);
  ready_.wait_on(stream_.get());
  issue(stream_.get());
  cudaEvent_t done;
  FASTCOMMS_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
  FASTCOMMS_CUDA_CHECK(cudaEventRecord(done, stream_.get()));
  auto work = std::make_shared<NcclWork>(done, caller, c.prefix, Clock::now() + c.timeout);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FASTCOMMS_CUDA_CHECK(cudaStreamIsCapturing(caller, &capture));
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
        check(c, ncclRedOpCreatePreMulSum(&r, &f, dt, ncclScalarHostImmediate, comm_));
      } else {
        // NCCL reads the host scalar in the reduction's type; half types take a float here only
        // through the float32 path.
        FASTCOMMS_CHECK(t == DType::kFloat32, kUnsupported, c.prefix, "PREMUL_SUM on ",
                        dtype_name(t), " is not supported yet");
        float f = static_cast<float>(op.factor);
        check(c, ncclRedOpCreatePreMulSum(&r, &f, dt, ncclScalarHostImmediate, comm_));
      }
      try {
        fn(r);
      } catch (...) {
        (void)ncclRedOpDestroy(r, comm_);
        throw;
      }
      check(c, ncclRedOpDestroy(r, comm_));
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
  (void)cudaThreadExchangeStreamCaptureMode(&mode);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    cv_.wait_for(lock, std::chrono::milliseconds(50));
    const auto now = Clock::now();
    while (!in_flight_.empty() && in_flight_.front()->done()) in_flight_.pop_front();
    bool overdue = false;
    for (const auto& w : in_flight_) overdue |= !w->done() && w->overdue(now);
    if (!overdue || aborted_) continue;
    for (const auto& w : in_flight_)
      if (!w->done()) w->mark(w->overdue(now) ? NcclWork::kTimedOut : NcclWork::kAborted);
    in_flight_.clear();
    if (options_.abort_process_on_timeout_or_error) {
      lock.unlock();  // NOTE [process abort]: the communicator's abort hooks run first
      process_abort_->abort_process(prefix_ + "an op timed out");
    }
    aborted_ = true;
    lock.unlock();
    (void)cudaSetDevice(device_);
    (void)ncclCommAbort(comm_);  // ends the stuck kernels; the communicator is unusable after
    comm_ = nullptr;
    lock.lock();
  }
}

void NcclBackend::abort() {
  std::lock_guard<std::mutex> lock(mu_);
  if (aborted_.exchange(true)) return;
  for (const auto& w : in_flight_)
    if (!w->done()) w->mark(NcclWork::kAborted);
  in_flight_.clear();
  if (comm_) {
    (void)cudaSetDevice(device_);
    (void)ncclCommAbort(comm_);
    comm_ = nullptr;
  }
}

void NcclBackend::finalize() {
  if (aborted_) return;
  cuda::DeviceGuard guard(device_);
  FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream_.get()));
  drop_registrations();  // NOTE [nccl memory registration]
}

const StaticBackendRegistration kRegistration("nccl", [](const BackendInit& init) {
  return std::make_unique<NcclBackend>(init);
});

}  // namespace
}  // namespace fastcomms::nccl_backend
