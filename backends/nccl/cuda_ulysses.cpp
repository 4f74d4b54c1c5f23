// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/backends/cuda_ulysses.hpp"

#include "fastcomms/cuda/copy.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

CudaUlyssesCollective::CudaUlyssesCollective(std::shared_ptr<Communicator> comm)
    : comm_(std::move(comm)) {
  FASTCOMMS_CHECK(comm_ != nullptr, kInvalidArgument,
                  "CudaUlyssesCollective: communicator is null");
  FASTCOMMS_CHECK(comm_->device().type == DeviceType::kCUDA, kInvalidArgument, "[rank ",
                  comm_->rank(), "/", comm_->size(), " ", comm_->name(),
                  "] all_to_all_4d: the CUDA collective path needs a CUDA communicator, got ",
                  comm_->device().str());
  device_ = comm_->device().index;
}

plan::UlyssesRequest CudaUlyssesCollective::request(const TensorView& x,
                                                    const UlyssesArgs& args) const {
  const std::string prefix = detail::cat("[rank ", comm_->rank(), "/", comm_->size(), " ",
                                         comm_->name(), "] all_to_all_4d: ");
  FASTCOMMS_CHECK(x.device == comm_->device(), kInvalidArgument, prefix, "x is on ", x.device.str(),
                  ", the communicator serves ", comm_->device().str());
  return ulysses_request(x, args, comm_->rank(), comm_->size(), comm_->name(),
                         plan::Path::kCollective);
}

std::array<int64_t, 4> CudaUlyssesCollective::output_shape(const TensorView& x,
                                                           const UlyssesArgs& args) const {
  return plan::ulysses_output_shape(request(x, args));
}

void CudaUlyssesCollective::all_to_all_4d(const TensorView& x, const TensorView& out,
                                          const UlyssesArgs& args, cudaStream_t stream) {
  const plan::UlyssesRequest req = request(x, args);
  const std::string prefix = detail::cat("[rank ", comm_->rank(), "/", comm_->size(), " ",
                                         comm_->name(), "] all_to_all_4d: ");
  const auto plan_ptr = plans_.get(req);
  const plan::UlyssesPlan& p = *plan_ptr;
  FASTCOMMS_CHECK(out.dtype == x.dtype, kTypeError, prefix, "out has dtype ", dtype_name(out.dtype),
                  ", x has ", dtype_name(x.dtype));
  FASTCOMMS_CHECK(out.device == x.device && out.is_contiguous(), kInvalidArgument, prefix,
                  "out must be a contiguous tensor on ", x.device.str());
  FASTCOMMS_CHECK(out.shape == std::vector<int64_t>(p.out_shape.begin(), p.out_shape.end()),
                  kInvalidArgument, prefix, "out has shape ", out.describe(), ", expected [",
                  p.out_shape[0], ", ", p.out_shape[1], ", ", p.out_shape[2], ", ", p.out_shape[3],
                  "]");
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
  comm_->all_to_all_v_single(
      TensorView::contiguous(recv_.get(), DType::kUInt8, {p.recv_elems * e}, x.device),
      TensorView::contiguous(send_.get(), DType::kUInt8, {p.send_elems * e}, x.device), recv_bytes,
      send_bytes, o);
  cuda::copy_sm_async(unpack.data(), static_cast<int>(unpack.size()), 0, stream);
  scratch_free_.record(stream);
  scratch_used_ = true;
}

}  // namespace fastcomms
