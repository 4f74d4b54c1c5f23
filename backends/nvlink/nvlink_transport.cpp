// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The "nvlink" Ulysses transport: the peer-to-peer engine (NvlinkUlysses) behind the Ulysses
// layer's interface, and the NVML probe the layer's transport choice asks.
#include "backends/nvlink/nvlink_transport.hpp"

#include "fastcomms/core/store.hpp"
#include "fastcomms/cuda/nvml.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

NvlinkTransport::NvlinkTransport(const TransportInit& init, bool owned, const NvlinkTuning& tuning)
    : UlyssesTransport(init.rank, init.size, init.name), init_(init), owned_(owned) {
  FASTCOMMS_CHECK(init.device.type == DeviceType::kCUDA && init.device.index >= 0, kInvalidArgument,
                  prefix(), "the NVLink transport serves a CUDA device, got ", init.device.str());
  FASTCOMMS_CHECK(init.store != nullptr, kInvalidArgument, prefix(),
                  "the NVLink transport needs a store to exchange IPC handles");
  NvlinkUlyssesOptions o;
  o.rank = init.rank;
  o.size = init.size;
  o.device = init.device.index;
  o.store = init.store;
  o.name = init.name;
  o.timeout = init.timeout;
  o.tuning = tuning;
  engine_ = std::make_shared<NvlinkUlysses>(std::move(o));
}

NvlinkUlysses& NvlinkTransport::engine() const {
  FASTCOMMS_CHECK(engine_ != nullptr, kInvalidArgument, prefix(), "the group was destroyed");
  return *engine_;
}

void NvlinkTransport::check_input(const TensorView& x) const {
  FASTCOMMS_CHECK(x.device.type == DeviceType::kCUDA && x.device.index == init_.device.index,
                  kInvalidArgument, prefix(), "x is on ", x.device.str(), ", the group serves ",
                  init_.device.str());
  (void)engine();
}

WorkPtr NvlinkTransport::run(const TensorView& x, const TensorView& out, const UlyssesArgs&,
                             const plan::UlyssesRequest& req,
                             const std::shared_ptr<const plan::UlyssesPlan>& plan, void* stream) {
  NvlinkUlysses& e = engine();
  e.run(x, out, req, *plan, static_cast<cudaStream_t>(stream), e.tuning().engine);
  return std::make_shared<CompletedWork>();  // enqueued on the caller's stream
}

bool NvlinkTransport::all_to_all_4d_fp8(const TensorView& x, const TensorView& out,
                                        const TensorView* scales, const UlyssesArgs& args,
                                        DType wire, void* stream) {
  // NOTE [fp8 fused push]: groups of two ranks or more, rows a whole number of 16 bytes in FP8
  // (the peer-to-peer path's unit), float16/bfloat16/float32 values; else the caller's unfused
  // path.
  const bool value =
      x.dtype == DType::kFloat16 || x.dtype == DType::kBFloat16 || x.dtype == DType::kFloat32;
  if (size_ < 2 || !value || x.shape.size() != 4 || x.shape[3] % 16 != 0) return false;
  const std::string where = prefix();
  check_input(x);
  const plan::UlyssesRequest req =
      ulysses_request({x.shape[0], x.shape[1], x.shape[2], x.shape[3]}, 1, args, rank_, size_,
                      name_, plan::Path::kPeerToPeer);
  FASTCOMMS_CHECK(x.is_contiguous(), kInvalidArgument, where, "x must be contiguous, got ",
                  x.describe());
  const auto p8 = plan_for(req);
  const std::vector<int64_t> shape(p8->out_shape.begin(), p8->out_shape.end());
  const DType want = scales == nullptr ? x.dtype : wire;
  FASTCOMMS_CHECK(
      out.dtype == want && out.device == x.device && out.is_contiguous() && out.shape == shape,
      kInvalidArgument, where, "out is ", out.describe(), ", expected a contiguous ",
      dtype_name(want), " tensor of shape [", shape[0], ", ", shape[1], ", ", shape[2], ", ",
      shape[3], "] on ", x.device.str());
  if (scales != nullptr)
    FASTCOMMS_CHECK(scales->dtype == DType::kFloat32 && scales->device == x.device &&
                        scales->is_contiguous() &&
                        scales->shape == std::vector<int64_t>(shape.begin(), shape.end() - 1),
                    kInvalidArgument, where, "scales is ", scales->describe(),
                    ", expected a contiguous float32 tensor of out's shape without d");
  NvlinkUlysses& e = engine();
  e.run_fp8(x, out, scales ? static_cast<float*>(scales->data) : nullptr, *p8, wire,
            static_cast<cudaStream_t>(stream));
  return true;
}

std::shared_ptr<void> NvlinkTransport::empty_output(int64_t bytes) {
  void* p = engine().empty_output(bytes);
  return std::shared_ptr<void>(engine_, p);  // the mapping lives as long as the buffer is held
}

std::shared_ptr<UlyssesTransport> NvlinkTransport::async_lane() {
  // NOTE [async lane]: calls on another stream get their own windows, pads and epochs, so a
  // sync call and an async call in flight together never share a barrier slot. Created on the
  // first async call, which every rank issues in the same order.
  std::lock_guard<std::mutex> lock(mu_);
  if (!async_) {
    TransportInit init = init_;
    init.name = init_.name + "/async";
    init.store = std::make_shared<PrefixStore>("async", init_.store);
    async_ = std::make_shared<NvlinkTransport>(init, true, engine().tuning());
    // NOTE [two lanes on one GPU]: from now on two spinning grids of this group may share the
    // GPU with one rank on it too, so each lane's grids take half of what it holds.
    engine().share_gpu_with_lane();
    async_->engine().share_gpu_with_lane();
  }
  return async_;
}

UlyssesMemoryStats NvlinkTransport::memory_stats() const {
  UlyssesMemoryStats s;
  if (engine_) s = {engine_->memory_bytes(), engine_->epoch()};
  return s;
}

void NvlinkTransport::check_errors() {
  engine().check_errors();
  std::shared_ptr<NvlinkTransport> a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a = async_;
  }
  if (a) a->check_errors();
}

void NvlinkTransport::destroy() {
  if (!owned_) return;  // the communicator's engine stays with the communicator
  std::shared_ptr<NvlinkTransport> a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a = std::move(async_);
  }
  if (a) a->destroy();
  engine_.reset();
}

void NvlinkTransport::tune(const std::string& knob, const std::string& value) {
  try {
    engine().tune(knob, value);
  } catch (const Error& e) {
    throw Error(e.code(), prefix() + e.what());
  }
  std::shared_ptr<NvlinkTransport> a;
  {
    std::lock_guard<std::mutex> lock(mu_);
    a = async_;
  }
  if (a) a->tune(knob, value);
}

namespace {

const StaticTransportRegistration kRegistration("nvlink", [](const TransportInit& init) {
  return std::make_shared<NvlinkTransport>(init, true);
});

const bool kProbe = [] {
  register_nvlink_probe([](const std::vector<int>& devices) {
    std::string why;
    auto m = cuda::nvlink_matrix(devices, &why);
    return std::make_pair(std::move(m), why);
  });
  return true;
}();

}  // namespace
}  // namespace fastcomms
