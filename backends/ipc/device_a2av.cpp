// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The device all-to-all-v over CUDA IPC (fastcomms/core/device_alltoallv.hpp; the protocol is
// NOTE [device all-to-all-v] in fastcomms/cuda/device_a2av.hpp). One buffer per rank (count pad,
// done pad, staging), mapped into every peer through an IpcWindow, which also refuses ranks on
// several hosts.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <memory>
#include <string>

#include "backends/ipc/ipc_window.hpp"
#include "fastcomms/core/device_alltoallv.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/device_a2av.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

class IpcDeviceAlltoallv final : public DeviceAlltoallv {
 public:
  explicit IpcDeviceAlltoallv(const DeviceAlltoallvInit& init);
  ~IpcDeviceAlltoallv() override;
  IpcDeviceAlltoallv(const IpcDeviceAlltoallv&) = delete;
  IpcDeviceAlltoallv& operator=(const IpcDeviceAlltoallv&) = delete;

  void run(const TensorView& output, const TensorView& input, const TensorView& output_splits,
           const TensorView& input_splits, void* stream, std::chrono::milliseconds timeout,
           const TensorView* input_index) override;
  void check_errors() override;
  void raise_flagged();  // throws what the device flagged since the last look, clearing it
  int64_t capacity_bytes() const override { return cap_; }
  uint64_t calls() const override { return calls_; }

 private:
  std::string prefix() const {
    return detail::cat("[rank ", init_.rank, "/", init_.size, " ", init_.name,
                       " device_alltoallv_single] ");
  }
  void check_tensor(const char* arg, const TensorView& t) const;
  void check_splits(const char* arg, const TensorView& t) const;

  DeviceAlltoallvInit init_;
  int64_t cap_ = 0;
  // Declared before the window: the window (peers' mappings) goes first, then this memory.
  cuda::DeviceBuffer buffer_;  // count pad, done pad, staging (mapped into every peer)
  cuda::DeviceBuffer peers_;   // device array: char* per rank
  cuda::DeviceBuffer state_;   // cuda::DeviceA2avState
  cuda::DeviceBuffer plan_;    // cuda::DeviceA2avPeerPlan per rank
  cuda::PinnedBuffer error_;   // cuda::DeviceA2avError, mapped
  cuda::DeviceA2avError* error_dev_ = nullptr;
  std::unique_ptr<IpcWindow> window_;
  uint64_t calls_ = 0;
};

IpcDeviceAlltoallv::IpcDeviceAlltoallv(const DeviceAlltoallvInit& init) : init_(init) {
  FASTCOMMS_CHECK(init_.store != nullptr, kInvalidArgument, prefix(), "a store is required");
  FASTCOMMS_CHECK(init_.device.type == DeviceType::kCUDA && init_.device.index >= 0, kUnsupported,
                  prefix(), "needs a communicator on a CUDA device, this one is on ",
                  init_.device.str());
  FASTCOMMS_CHECK(init_.size <= 1024, kUnsupported, prefix(),
                  "serves groups of at most 1024 ranks, this one has ", init_.size);
  cuda::DeviceGuard guard(init_.device.index);
  IpcWindowOptions o;
  o.rank = init_.rank;
  o.size = init_.size;
  o.device = init_.device.index;
  o.store = init_.store;
  o.timeout = init_.timeout;
  o.name = "device_a2av";
  o.backend = init_.backend;
  try {
    window_ = std::make_unique<IpcWindow>(std::move(o));  // collective: every rank on one host
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kUnsupported) throw;
    throw Error(ErrorCode::kUnsupported,
                detail::cat(prefix(),
                            "the counts and rows move through buffers mapped into every "
                            "peer (CUDA IPC), which needs every rank on one host (",
                            e.what(), ")"));
  }
  // Every rank's staging has the largest capacity any rank asked for (the rows a rank receives
  // are bounded by its output, which the ranks do not know of each other).
  init_.store->set_string(detail::cat("cap/", init_.rank), std::to_string(init_.capacity_bytes));
  int64_t cap = std::max<int64_t>(init_.capacity_bytes, 0);
  for (int q = 0; q < init_.size; ++q) {
    if (q == init_.rank) continue;
    cap = std::max<int64_t>(
        cap, std::stoll(init_.store->get_string(detail::cat("cap/", q), init_.timeout)));
  }
  cap_ = std::max<int64_t>((cap + 255) / 256 * 256, 256);
  const int64_t total = cuda::staging_offset(init_.size) + cap_;
  buffer_ = cuda::DeviceBuffer(static_cast<size_t>(total));
  FASTCOMMS_CUDA_CHECK(cudaMemset(buffer_.get(), 0, static_cast<size_t>(total)));
  state_ = cuda::DeviceBuffer(sizeof(cuda::DeviceA2avState));
  FASTCOMMS_CUDA_CHECK(cudaMemset(state_.get(), 0, sizeof(cuda::DeviceA2avState)));
  plan_ = cuda::DeviceBuffer(sizeof(cuda::DeviceA2avPeerPlan) * init_.size);
  FASTCOMMS_CUDA_CHECK(cudaMemset(plan_.get(), 0, sizeof(cuda::DeviceA2avPeerPlan) * init_.size));
  error_ = cuda::PinnedBuffer(sizeof(cuda::DeviceA2avError));
  std::memset(error_.get(), 0, sizeof(cuda::DeviceA2avError));
  FASTCOMMS_CUDA_CHECK(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_.get(), 0));
  // The pads are zero before any peer can map them (the window publishes after this).
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
  window_->register_buffer(buffer_.get(), total);
  std::vector<char*> ptrs(init_.size);
  for (int q = 0; q < init_.size; ++q) ptrs[q] = static_cast<char*>(window_->remote(q));
  peers_ = cuda::DeviceBuffer(sizeof(char*) * init_.size);
  FASTCOMMS_CUDA_CHECK(
      cudaMemcpy(peers_.get(), ptrs.data(), sizeof(char*) * init_.size, cudaMemcpyHostToDevice));
}

IpcDeviceAlltoallv::~IpcDeviceAlltoallv() {
  // Every call's waits end (or time out) before the memory goes: no peer writes into it after
  // this rank's last wait kernel, which waited for every peer's last push.
  (void)cudaSetDevice(init_.device.index);
  (void)cudaDeviceSynchronize();
}

void IpcDeviceAlltoallv::check_tensor(const char* arg, const TensorView& t) const {
  FASTCOMMS_CHECK(t.device == init_.device, kInvalidArgument, prefix(), arg, " must be on ",
                  init_.device.str(), " (the communicator's device), got ", t.device.str());
  FASTCOMMS_CHECK(t.is_contiguous(), kInvalidArgument, prefix(), arg, " must be contiguous, got ",
                  t.describe());
  FASTCOMMS_CHECK(!t.shape.empty(), kInvalidArgument, prefix(), arg,
                  " must have a dim 0 (split sizes count its rows), got a 0-d tensor");
}

void IpcDeviceAlltoallv::check_splits(const char* arg, const TensorView& t) const {
  FASTCOMMS_CHECK(t.dtype == DType::kInt64, kTypeError, prefix(), arg,
                  " must be an int64 tensor, got ", t.describe());
  FASTCOMMS_CHECK(t.device == init_.device, kInvalidArgument, prefix(), arg,
                  " must be a CUDA tensor on ", init_.device.str(),
                  " (the counts are read on the device, never by the host), got ", t.device.str());
  FASTCOMMS_CHECK(t.shape.size() == 1 && t.shape[0] == init_.size && t.is_contiguous(),
                  kInvalidArgument, prefix(), arg, " must be contiguous of shape (", init_.size,
                  ",) (one count per rank), got ", t.describe());
}

void IpcDeviceAlltoallv::run(const TensorView& output, const TensorView& input,
                             const TensorView& output_splits, const TensorView& input_splits,
                             void* stream, std::chrono::milliseconds timeout,
                             const TensorView* input_index) {
  check_tensor("output", output);
  check_tensor("input", input);
  FASTCOMMS_CHECK(output.dtype == input.dtype, kTypeError, prefix(),
                  "output and input must have one dtype, got ", output.describe(), " and ",
                  input.describe());
  // A row is every dim but 0 (also of a tensor with no rows).
  const auto row_of = [](const TensorView& t) {
    int64_t n = static_cast<int64_t>(t.element_size());
    for (size_t i = 1; i < t.shape.size(); ++i) n *= t.shape[i];
    return n;
  };
  const int64_t rb = row_of(input);
  FASTCOMMS_CHECK(row_of(output) == rb, kInvalidArgument, prefix(),
                  "output and input rows (every dim but 0) must have one size, got ",
                  output.describe(), " and ", input.describe());
  check_splits("output_split_sizes", output_splits);
  check_splits("input_split_sizes", input_splits);
  cuda::DeviceA2avArgs a;
  a.rank = init_.rank;
  a.size = init_.size;
  a.peers = static_cast<char* const*>(peers_.get());
  a.state = static_cast<cuda::DeviceA2avState*>(state_.get());
  a.plan = static_cast<cuda::DeviceA2avPeerPlan*>(plan_.get());
  a.error = error_dev_;
  a.send_counts = static_cast<const int64_t*>(input_splits.data);
  a.recv_counts = static_cast<const int64_t*>(output_splits.data);
  a.input = static_cast<const char*>(input.data);
  a.output = static_cast<char*>(output.data);
  a.input_rows = input.rows();
  a.output_rows = output.rows();
  if (input_index != nullptr) {  // NOTE [indexed push]
    const TensorView& ix = *input_index;
    FASTCOMMS_CHECK(ix.dtype == DType::kInt64, kTypeError, prefix(),
                    "input_index must be an int64 tensor, got ", ix.describe());
    FASTCOMMS_CHECK(ix.device == init_.device && ix.shape.size() == 1 && ix.is_contiguous(),
                    kInvalidArgument, prefix(), "input_index must be a contiguous 1-d tensor on ",
                    init_.device.str(), ", got ", ix.describe());
    a.input_index = static_cast<const int64_t*>(ix.data);
    a.input_src_rows = input.rows();
    a.input_rows = ix.shape[0];  // the rows the splits count
  }
  a.row_bytes = rb;
  a.staging_bytes = cap_;
  if (timeout.count() <= 0) timeout = init_.timeout;
  a.timeout_ms = static_cast<uint64_t>(timeout.count());
  a.timeout_ns = a.timeout_ms * 1'000'000ull;
  // The widest unit that divides every offset: rows, both tensors' bases (staging is aligned).
  const uint64_t bits = static_cast<uint64_t>(rb) | reinterpret_cast<uintptr_t>(input.data) |
                        reinterpret_cast<uintptr_t>(output.data) | 16u;
  a.vector_bytes = static_cast<int>(bits & (~bits + 1));
  // What an earlier call flagged, taken before this call is enqueued (a flag this call's own
  // kernels set, were they quick enough to finish before the host looks, belongs to the next
  // call) and raised once it is enqueued: every rank takes part in every call (a rank that
  // raised first would leave its peers waiting), and every rank saw the error (NOTE [device
  // all-to-all-v]), so each one raises it, at this call or the next.
  std::exception_ptr earlier;
  try {
    raise_flagged();
  } catch (...) {
    earlier = std::current_exception();
  }
  cuda::DeviceGuard guard(init_.device.index);
  cuda::device_a2av_async(a, 0, static_cast<cudaStream_t>(stream));
  ++calls_;
  if (earlier) std::rethrow_exception(earlier);
}

void IpcDeviceAlltoallv::check_errors() { raise_flagged(); }

void IpcDeviceAlltoallv::raise_flagged() {
  auto* e = static_cast<volatile cuda::DeviceA2avError*>(error_.get());
  if (e->timed_out) {
    const bool mine = e->ready && e->code == cuda::kA2avTimeout;
    throw Error(ErrorCode::kTimeout,
                detail::cat(prefix(), "a device-side wait of an earlier call timed out",
                            mine ? detail::cat(" after ", e->expected, " ms waiting for rank ",
                                               e->peer, e->phase == 1 ? "'s counts" : "'s rows")
                                 : std::string(),
                            " (a rank that did not make the call, or one far behind): the ranks' "
                            "calls no longer line up, so this group copies nothing from now on; "
                            "make a new communicator"));
  }
  if (!e->ready) return;
  const int code = e->code, peer = e->peer, peer2 = e->peer2, phase = e->phase;
  const int64_t expected = e->expected, got = e->got;
  e->ready = 0;
  e->code = 0;  // after `ready`: a later error can win the record only once it is read
  std::string what;
  switch (code) {
    case cuda::kA2avNegativeSend:
      what = detail::cat("input_split_sizes[", peer, "] is ", got,
                         ": counts must be >= 0 (this rank sent nothing in that call)");
      break;
    case cuda::kA2avSendOverflow:
      what = detail::cat("input_split_sizes sum to ", got, " rows, the input has ", expected,
                         " rows (this rank sent nothing in that call)");
      break;
    case cuda::kA2avNegativeRecv:
      what = detail::cat("output_split_sizes[", peer, "] is ", got,
                         ": counts must be >= 0 (nothing was copied into the output)");
      break;
    case cuda::kA2avRecvOverflow:
      what = detail::cat("output_split_sizes sum to ", got, " rows, the output has ", expected,
                         " rows (nothing was copied into the output)");
      break;
    case cuda::kA2avPeerBadCounts:
      what = phase == 1 ? detail::cat("rank ", peer,
                                      " rejected its input_split_sizes (its error says why), so "
                                      "it sent nothing")
                        : detail::cat("rank ", peer,
                                      " rejected its output_split_sizes (its error says why), so "
                                      "it received nothing");
      break;
    case cuda::kA2avCountMismatch:
      what = detail::cat("rank ", peer, "'s output_split_sizes[", peer2, "] is ", expected,
                         " rows, but rank ", peer2, "'s input_split_sizes[", peer, "] is ", got,
                         " (rank ", peer, " copied the first ", std::min(expected, got), " rows)");
      break;
    case cuda::kA2avStagingOverflow:
      what = detail::cat(
          "rank ", peer, " would receive ", got, " bytes, its receive buffer holds ", expected,
          " bytes (sized from the largest output of the first call; before capturing, call "
          "device_alltoallv_prepare(max_output_bytes) on every rank to grow it): nothing was "
          "sent to rank ",
          peer);
      break;
    case cuda::kA2avRowMismatch:
      what = detail::cat("rank ", peer, "'s rows are ", got, " bytes, this rank's ", expected,
                         " bytes (every rank passes rows of one size): nothing was copied");
      break;
    default:
      what = detail::cat("unknown device error code ", code);
  }
  throw Error(ErrorCode::kInvalidArgument,
              detail::cat(prefix(), "an earlier call failed on the device: ", what));
}

const bool kRegistered = [] {
  register_device_alltoallv(
      [](const DeviceAlltoallvInit& init) { return std::make_unique<IpcDeviceAlltoallv>(init); });
  return true;
}();

}  // namespace
}  // namespace fastcomms
