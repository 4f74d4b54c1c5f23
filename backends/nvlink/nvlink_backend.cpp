// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The communicator-level "nvlink" backend: all_to_all_single moves peer-to-peer over NVLink
// (NvlinkUlysses: CUDA IPC windows, device epoch barriers, 16-byte pushes); every other op
// delegates to an inner nccl communicator created through the registry, so this file has no
// link-time dependency on NCCL.
//
// NOTE [all_to_all_single as a Ulysses call]: an all_to_all_single of P equal chunks of c bytes
// is the Ulysses mode-0 exchange of x viewed as (b=1, s=1, N=P, d=c) bytes into out viewed as
// (1, P, 1, c): rank r's head block q (chunk q of its input) lands at sequence row r of rank q's
// output, which is chunk r. So the peer-to-peer path serves it unchanged, with its mismatch
// detection and device-side timeout, whenever c is a multiple of 16 bytes (the path's vector
// width); other shapes and the uneven all_to_all_v_single go to NCCL.
//
// NOTE [nvlink lazy nccl]: with the hint nvlink.lazy_nccl=1 the inner nccl communicator is made
// by the first op that needs it (collectively, as every op is), not by new_comm. What needs
// only the store works without it: windows, device_alltoallv_single, and the peer-to-peer
// all_to_all_single. So ranks that share one GPU (MPS clients, which NCCL refuses as duplicate
// GPUs) get an nvlink communicator for those; any other op then fails as NCCL's init does.

#include <cuda_runtime_api.h>

#include <memory>
#include <string>
#include <vector>

#include <atomic>
#include <mutex>

#include "backends/ipc/ipc_window.hpp"
#include "backends/nvlink/nvlink_transport.hpp"
#include "fastcomms/core/backend.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/forwarding_backend.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

class NvlinkBackend final : public ForwardingBackend<Backend> {
 public:
  /// @param inner the nccl communicator to delegate to; null: create one through the store
  NvlinkBackend(const BackendInit& init, std::unique_ptr<Backend> inner)
      : size_(init.size), inner_(std::move(inner)) {
    const std::string where = detail::cat("[rank ", init.rank, "/", init.size, " ",
                                          init.options.name, " new_comm] nvlink: ");
    FASTCOMMS_CHECK(init.device.type == DeviceType::kCUDA && init.device.index >= 0,
                    kInvalidArgument, where, "the nvlink backend serves CUDA devices, got ",
                    init.device.str());
    FASTCOMMS_CHECK(is_backend_registered("nccl"), kUnsupported, where,
                    "the nvlink backend delegates every op but all_to_all_single to nccl, which "
                    "this build lacks");
    if (!inner_) {
      inner_init_ = init;
      inner_init_.options.store = std::make_shared<PrefixStore>("inner_nccl", init.options.store);
      const auto lazy = init.options.hints.find("nvlink.lazy_nccl");
      const bool later =
          lazy != init.options.hints.end() && (lazy->second == "1" || lazy->second == "true");
      if (!later) inner_ = create_backend("nccl", inner_init_);
    }
    made_.store(inner_ != nullptr);
    TransportInit t;
    t.rank = init.rank;
    t.size = init.size;
    t.device = init.device;
    t.store = std::make_shared<PrefixStore>("p2p", init.options.store);
    t.name = init.options.name;
    t.timeout = init.options.timeout;
    p2p_ = std::make_shared<NvlinkTransport>(t, /*owned=*/false);
    window_init_ = t;
    window_init_.store = std::make_shared<PrefixStore>("win", init.options.store);
  }

  // NOTE [the nvlink backend lends its engine]: Ulysses groups over this communicator use the
  // engine all_to_all_single uses (and its async lane), so no second set of windows exists.
  // get_nccl_comm_ptr: the inner nccl communicator's ncclComm_t, which every op but the
  // peer-to-peer all-to-all runs on (made with the same NCCL config, NOTE [nccl config hints]).
  std::shared_ptr<void> lend(const std::string& what) override {
    if (what == kLentUlyssesTransport) return std::static_pointer_cast<UlyssesTransport>(p2p_);
    if (what == kLentNcclComm) return inner().lend(what);
    return nullptr;
  }
  bool supports_window() const override { return true; }
  // NOTE [nccl memory registration]: with the inner NCCL communicator, which every op but the
  // peer-to-peer all-to-all runs on.
  void register_memory(void* ptr, int64_t bytes, const std::string& where) override {
    inner().register_memory(ptr, bytes, where);
  }
  void deregister_memory(void* ptr, const std::string& where) override {
    inner().deregister_memory(ptr, where);
  }
  std::shared_ptr<Window> new_window(const OpContext&) override {
    IpcWindowOptions o;
    o.rank = window_init_.rank;
    o.size = window_init_.size;
    o.device = window_init_.device.index;
    o.store = window_init_.store;
    o.name = detail::cat(window_init_.name, "/", windows_++);  // every rank counts alike
    o.timeout = window_init_.timeout;
    o.backend = "nvlink";
    return std::make_shared<IpcWindow>(std::move(o));
  }

  std::string name() const override { return "nvlink"; }
  std::string version() const override {
    return "nvlink (CUDA IPC) + " +
           (made_.load() ? inner_->version() : std::string("nccl (made at its first op)"));
  }
  Capabilities capabilities() const override {
    if (made_.load()) return inner_->capabilities();
    Capabilities c;  // what the nccl backend serves (NOTE [nvlink lazy nccl]): every op, on CUDA
    for (int i = 0; i < static_cast<int>(OpKind::kCount); ++i) c.ops |= uint64_t{1} << i;
    c.cuda_tensors = true;
    return c;
  }

  WorkPtr all_to_all_v_single(const TensorView& output, const TensorView& input,
                              const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits,
                              const OpContext& ctx) override {
    if (ctx.op == OpKind::kAllToAllSingle && p2p_eligible(output, input, ctx)) {
      const int64_t chunk = input.nbytes() / size_;
      const TensorView x =
          TensorView::contiguous(input.data, DType::kUInt8, {1, 1, size_, chunk}, input.device);
      const TensorView out =
          TensorView::contiguous(output.data, DType::kUInt8, {1, size_, 1, chunk}, output.device);
      UlyssesArgs args;
      args.mode = 0;
      // A failure of an earlier call surfaces in the call, on every rank.
      p2p_->engine().all_to_all_4d(x, out, args, static_cast<cudaStream_t>(ctx.stream),
                                   TransferEngine::kAuto);
      return std::make_shared<CompletedWork>();  // enqueued on the caller's stream
    }
    return inner().all_to_all_v_single(output, input, output_splits, input_splits, ctx);
  }

  std::unique_ptr<Backend> split(const std::vector<int>& ranks, const std::string& name,
                                 const BackendInit* init) override {
    // The inner split is collective over this communicator (ncclCommSplit): every rank takes
    // part, members then set up their own peer-to-peer group through the split's store.
    auto inner = this->inner().split(ranks, name, init);
    if (init == nullptr) return nullptr;
    return std::make_unique<NvlinkBackend>(*init, std::move(inner));
  }
  void finalize() override {
    if (made_.load()) inner_->finalize();
    p2p_->check_errors();
  }
  void abort() override {
    if (made_.load()) inner_->abort();
  }

  // Before a deferred inner communicator exists (NOTE [nvlink lazy nccl]) nothing checks in
  // band: the communicator's store check applies where asked for.
  bool checks_calls(const OpContext& ctx) const override {
    return made_.load() && inner_->checks_calls(ctx);
  }

 protected:
  // Every op but the peer-to-peer all-to-all (and finalize's check) runs on the inner nccl
  // communicator.
  Backend& target() const override { return inner(); }

 private:
  bool p2p_eligible(const TensorView& output, const TensorView& input, const OpContext& ctx) const {
    if (!input.is_contiguous() || !output.is_contiguous()) return false;
    if (input.device != output.device || input.dtype != output.dtype) return false;
    const int64_t bytes = input.nbytes();
    if (bytes == 0 || bytes % size_ != 0 || (bytes / size_) % 16 != 0) return false;
    // A captured call cannot grow the window: until an eager call has grown it, NCCL serves.
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    FASTCOMMS_CUDA_CHECK(cudaStreamIsCapturing(static_cast<cudaStream_t>(ctx.stream), &capture));
    return capture == cudaStreamCaptureStatusNone ||
           p2p_->engine().window_bytes() >= output.nbytes();
  }

  // The inner nccl communicator, made here where NOTE [nvlink lazy nccl] deferred it.
  Backend& inner() const {
    if (!made_.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(inner_mu_);
      if (!inner_) inner_ = create_backend("nccl", inner_init_);
      made_.store(true, std::memory_order_release);
    }
    return *inner_;
  }

  int size_;
  mutable std::unique_ptr<Backend> inner_;
  BackendInit inner_init_;
  mutable std::mutex inner_mu_;
  mutable std::atomic<bool> made_{false};
  std::shared_ptr<NvlinkTransport> p2p_;
  TransportInit window_init_;
  std::atomic<uint64_t> windows_{0};
};

const StaticBackendRegistration kRegistration("nvlink", [](const BackendInit& init) {
  return std::make_unique<NvlinkBackend>(init, nullptr);
});

}  // namespace
}  // namespace fastcomms
