// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The Ulysses all-to-all on the collective path for CUDA tensors ("cuda_collective"): one pack
// kernel driven by plan/'s descriptors (16-byte vectors where alignment allows, any element size
// otherwise), one all_to_all_v_single on the communicator (NCCL), one unpack kernel; no separate
// permute copies. Everything is enqueued on the caller's stream.
#include <cuda_runtime_api.h>

#include "fastcomms/cuda/copy.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/hierarchical.hpp"

namespace fastcomms {
namespace {

class CudaCollectiveTransport final : public UlyssesTransport {
 public:
  explicit CudaCollectiveTransport(std::shared_ptr<Communicator> comm)
      : UlyssesTransport(comm->rank(), comm->size(), comm->name()), comm_(std::move(comm)) {
    FASTCOMMS_CHECK(comm_->device().type == DeviceType::kCUDA, kInvalidArgument, prefix(),
                    "the CUDA collective path needs a CUDA communicator, got ",
                    comm_->device().str());
    device_ = comm_->device().index;
  }
  std::string kind() const override { return "cuda_collective"; }
  UlyssesMemoryStats memory_stats() const override {
    return {static_cast<int64_t>(send_.size() + recv_.size()), calls_};
  }

 protected:
  plan::Path path() const override { return plan::Path::kCollective; }
  void check_input(const TensorView& x) const override {
    FASTCOMMS_CHECK(x.device == comm_->device(), kInvalidArgument, prefix(), "x is on ",
                    x.device.str(), ", the communicator serves ", comm_->device().str());
  }
  WorkPtr run(const TensorView& x, const TensorView& out, const UlyssesArgs& args,
              const plan::UlyssesRequest& req, const std::shared_ptr<const plan::UlyssesPlan>& plan,
              void* stream) override;

 private:
  std::shared_ptr<Communicator> comm_;
  int device_ = 0;
  cuda::DeviceBuffer send_, recv_;
  cuda::Event scratch_free_;  // recorded after the unpack that last read the scratch
  bool scratch_used_ = false;
  uint64_t calls_ = 0;
};

WorkPtr CudaCollectiveTransport::run(const TensorView& x, const TensorView& out, const UlyssesArgs&,
                                     const plan::UlyssesRequest&,
                                     const std::shared_ptr<const plan::UlyssesPlan>& plan_ptr,
                                     void* stream_ptr) {
  const plan::UlyssesPlan& p = *plan_ptr;
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  ++calls_;
  cuda::DeviceGuard guard(device_);
  const int64_t e = p.element_size;
  // NOTE [collective scratch reuse]: the scratch is grow-only; a call on another stream waits
  // for the unpack that last read it before packing into it again.
  if (scratch_used_) scratch_free_.wait_on(stream);
  if (static_cast<int64_t>(send_.size()) < p.send_elems * e) {
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream));
    send_ = cuda::DeviceBuffer(static_cast<size_t>(p.send_elems * e));
  }
  if (static_cast<int64_t>(recv_.size()) < p.recv_elems * e) {
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream));
    recv_ = cuda::DeviceBuffer(static_cast<size_t>(p.recv_elems * e));
  }
  const int P = p.world_size;
  std::vector<cuda::CopyJob> pack, unpack;
  std::vector<int64_t> send_bytes(P), recv_bytes(P);
  for (int q = 0; q < P; ++q) {
    if (!p.pack[q].empty()) pack.push_back({x.data, send_.get(), p.pack[q]});
    if (!p.unpack[q].empty()) unpack.push_back({recv_.get(), out.data, p.unpack[q]});
    send_bytes[q] = p.send_counts[q] * e;
    recv_bytes[q] = p.recv_counts[q] * e;
  }
  cuda::copy_sm_async(pack.data(), static_cast<int>(pack.size()), 0, stream);
  CallOptions o;
  o.stream = stream;
  // NOTE [call check]: where the check is on (FASTCOMMS_CHECK_CALLS=1), ranks compare the
  // geometry and dtype as well as the byte counts before the exchange. This path carries no chunk
  // header (docs/design.md): NCCL with counts that disagree hangs or reads past a chunk, so only a
  // check before the data can catch a mismatched call.
  o.call_key = ulysses_call_key(p, x.dtype);
  comm_->all_to_all_v_single(
      TensorView::contiguous(recv_.get(), DType::kUInt8, {p.recv_elems * e}, x.device),
      TensorView::contiguous(send_.get(), DType::kUInt8, {p.send_elems * e}, x.device), recv_bytes,
      send_bytes, o);
  cuda::copy_sm_async(unpack.data(), static_cast<int>(unpack.size()), 0, stream);
  scratch_free_.record(stream);
  scratch_used_ = true;
  return std::make_shared<CompletedWork>();  // enqueued on the caller's stream
}

const StaticTransportRegistration kRegistration("cuda_collective", [](const TransportInit& init) {
  FASTCOMMS_CHECK(init.comm != nullptr, kInvalidArgument, "[", init.name,
                  "] the CUDA collective Ulysses path needs a communicator");
  return std::make_shared<CudaCollectiveTransport>(init.comm);
});

}  // namespace
}  // namespace fastcomms
