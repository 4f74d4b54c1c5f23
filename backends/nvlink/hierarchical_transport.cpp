// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The hierarchical Ulysses transport on CUDA ("hierarchical_nvlink", NOTE [hierarchical split]):
// this host's ranks over the NVLink engine, the other hosts' over the group's byte exchange
// (NCCL through the communicator, or a torch ProcessGroup), both in flight at once.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <memory>
#include <mutex>

#include "backends/nvlink/nvlink_ulysses.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/cuda/copy.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/hierarchical.hpp"

namespace fastcomms {
namespace {

class NvlinkHierarchicalTransport final : public UlyssesTransport {
 public:
  explicit NvlinkHierarchicalTransport(const TransportInit& init)
      : UlyssesTransport(init.rank, init.size, init.name),
        init_(init),
        map_(host_map(init.host_of, init.rank)) {
    FASTCOMMS_CHECK(init.device.type == DeviceType::kCUDA && init.device.index >= 0,
                    kInvalidArgument, prefix(),
                    "the hierarchical path on CUDA serves a CUDA device, got ", init.device.str());
    FASTCOMMS_CHECK(init.store != nullptr, kInvalidArgument, prefix(),
                    "the hierarchical path needs a store its host's ranks share");
    exchange_ = init.exchange;
    if (!exchange_) {
      FASTCOMMS_CHECK(init.comm != nullptr, kInvalidArgument, prefix(),
                      "the hierarchical path needs a communicator or a byte exchange between "
                      "hosts");
      exchange_ = comm_exchange(init.comm);
    }
    cuda::DeviceGuard guard(init.device.index);
    NvlinkUlyssesOptions o;
    o.rank = map_.local_rank;
    o.size = static_cast<int>(map_.members.size());
    o.device = init.device.index;
    // One key space per host: the hosts' engines set up side by side.
    o.store =
        std::make_shared<PrefixStore>(detail::cat("host", map_.host_of[init.rank]), init.store);
    o.name = init.name + "/host";
    o.timeout = init.timeout;
    o.plan_ranks = map_.members;
    engine_ = std::make_shared<NvlinkUlysses>(std::move(o));
    // NOTE [hierarchical residency]: the engine's spinning grid shares the GPU with the kernels
    // of the exchange between hosts (pack, NCCL, unpack) in flight beside it, so it takes half of
    // what it would hold alone (as beside a second lane), leaving SMs for them.
    engine_->share_gpu_with_lane();
    mask_.resize(size_);
    for (int q = 0; q < size_; ++q) mask_[q] = map_.host_of[q] != map_.host_of[rank_];
  }
  std::string kind() const override { return "hierarchical"; }

  std::shared_ptr<void> empty_output(int64_t bytes) override {
    void* p = engine().empty_output(bytes);
    return std::shared_ptr<void>(engine_, p);
  }
  std::shared_ptr<UlyssesTransport> async_lane() override {
    std::lock_guard<std::mutex> lock(mu_);
    if (!async_) {  // NOTE [async lane]: its own windows, pads, epochs and stream
      TransportInit init = init_;
      init.name = init_.name + "/async";
      init.store = std::make_shared<PrefixStore>("async", init_.store);
      async_ = std::make_shared<NvlinkHierarchicalTransport>(init);
    }
    return async_;
  }
  UlyssesMemoryStats memory_stats() const override {
    UlyssesMemoryStats s;
    if (engine_) s.device_bytes = engine_->memory_bytes();
    s.device_bytes += static_cast<int64_t>(send_.size() + recv_.size());
    s.calls = calls_;
    return s;
  }
  void check_errors() override {
    engine().check_errors();
    std::shared_ptr<UlyssesTransport> a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      a = async_;
    }
    if (a) a->check_errors();
  }
  void destroy() override {
    std::shared_ptr<UlyssesTransport> a;
    {
      std::lock_guard<std::mutex> lock(mu_);
      a = std::move(async_);
    }
    if (a) a->destroy();
    engine_.reset();
  }
  void tune(const std::string& knob, const std::string& value) override {
    // Test faults of this transport; every other knob is the engine's.
    if (knob == "fault") {
      FASTCOMMS_CHECK(value == "none" || value == "skip_remote", kInvalidArgument, prefix(),
                      "fault must be none or skip_remote, got '", value, "'");
      fault_ = value;
      return;
    }
    try {
      engine().tune(knob, value);
    } catch (const Error& e) {
      throw Error(e.code(), prefix() + e.what());
    }
  }

 protected:
  plan::Path path() const override { return plan::Path::kPeerToPeer; }
  void check_input(const TensorView& x) const override {
    FASTCOMMS_CHECK(x.device == init_.device, kInvalidArgument, prefix(), "x is on ",
                    x.device.str(), ", the group serves ", init_.device.str());
    (void)engine();
  }
  WorkPtr run(const TensorView& x, const TensorView& out, const UlyssesArgs& args,
              const plan::UlyssesRequest& req, const std::shared_ptr<const plan::UlyssesPlan>& plan,
              void* stream_ptr) override;

 private:
  NvlinkUlysses& engine() const {
    FASTCOMMS_CHECK(engine_ != nullptr, kInvalidArgument, prefix(), "the group was destroyed");
    return *engine_;
  }

  TransportInit init_;
  HostMap map_;
  ByteExchange exchange_;
  std::shared_ptr<NvlinkUlysses> engine_;
  std::vector<bool> mask_;  // the peers on other hosts
  cuda::Stream side_;       // the exchange between hosts
  cuda::Event fork_, join_;
  cuda::DeviceBuffer send_, recv_;
  uint64_t calls_ = 0;
  std::string fault_ = "none";
  std::mutex mu_;
  std::shared_ptr<NvlinkHierarchicalTransport> async_;
};

WorkPtr NvlinkHierarchicalTransport::run(const TensorView& x, const TensorView& out,
                                         const UlyssesArgs&, const plan::UlyssesRequest& req,
                                         const std::shared_ptr<const plan::UlyssesPlan>& plan,
                                         void* stream_ptr) {
  NvlinkUlysses& e = engine();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  cuda::DeviceGuard guard(init_.device.index);
  ++calls_;
  plan::UlyssesRequest creq = req;
  creq.path = plan::Path::kCollective;
  const auto cplan = plan_for(creq);
  const ExchangePart remote = exchange_part(*cplan, mask_);
  // The side stream starts after what the caller enqueued before the call (x is ready), then
  // packs, exchanges and unpacks the other hosts' blocks while the engine moves this host's.
  fork_.record(stream);
  fork_.wait_on(side_.get());
  e.run(x, out, req, *plan, stream, e.tuning().engine);
  if (fault_ == "skip_remote") return std::make_shared<CompletedWork>();  // test fault
  // Grow-only scratch, never empty (a byte exchange gets real device pointers even for 0 bytes).
  const auto grow = [&](cuda::DeviceBuffer& b, int64_t bytes) {
    if (b.get() != nullptr && static_cast<int64_t>(b.size()) >= bytes) return;
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(side_.get()));  // earlier calls are done with it
    b = cuda::DeviceBuffer(static_cast<size_t>(std::max<int64_t>(bytes, 256)));
  };
  grow(send_, remote.send_total);
  grow(recv_, remote.recv_total);
  std::vector<cuda::CopyJob> pack, unpack;
  for (int q = 0; q < size_; ++q) {
    if (!remote.pack[q].empty()) pack.push_back({x.data, send_.get(), remote.pack[q]});
    if (!remote.unpack[q].empty()) unpack.push_back({recv_.get(), out.data, remote.unpack[q]});
  }
  if (!pack.empty())
    cuda::copy_sm_async(pack.data(), static_cast<int>(pack.size()), 0, side_.get());
  exchange_(TensorView::contiguous(recv_.get(), DType::kUInt8, {remote.recv_total}, x.device),
            TensorView::contiguous(send_.get(), DType::kUInt8, {remote.send_total}, x.device),
            remote.recv_bytes, remote.send_bytes, side_.get(), ulysses_call_key(*cplan, x.dtype));
  if (!unpack.empty())
    cuda::copy_sm_async(unpack.data(), static_cast<int>(unpack.size()), 0, side_.get());
  join_.record(side_.get());
  join_.wait_on(stream);
  return std::make_shared<CompletedWork>();  // enqueued on the caller's stream
}

const StaticTransportRegistration kRegistration("hierarchical_nvlink", [](const TransportInit& i) {
  return std::make_shared<NvlinkHierarchicalTransport>(i);
});

}  // namespace
}  // namespace fastcomms
