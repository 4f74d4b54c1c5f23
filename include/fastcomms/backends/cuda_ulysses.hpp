// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The Ulysses all-to-all on the collective path for CUDA tensors: one pack kernel driven by
/// plan/'s descriptors (16-byte vectors where alignment allows, any element size otherwise), one
/// all_to_all_v_single on the communicator (NCCL), one unpack kernel. No separate permute copies.

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "fastcomms/core/communicator.hpp"
#include "fastcomms/core/ulysses.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"

namespace fastcomms {

/// Ulysses all-to-all over a CUDA communicator's all_to_all_v_single.
class CudaUlyssesCollective {
 public:
  /// @param comm a communicator on a CUDA backend (nccl)
  explicit CudaUlyssesCollective(std::shared_ptr<Communicator> comm);
  /// The output shape of a call (validated like the call).
  std::array<int64_t, 4> output_shape(const TensorView& x, const UlyssesArgs& args) const;
  /// Enqueues pack, exchange and unpack on `stream` (no host block).
  void all_to_all_4d(const TensorView& x, const TensorView& out, const UlyssesArgs& args,
                     cudaStream_t stream);

 private:
  plan::UlyssesRequest request(const TensorView& x, const UlyssesArgs& args) const;
  std::shared_ptr<Communicator> comm_;
  int device_;
  cuda::DeviceBuffer send_, recv_;
  cuda::Event scratch_free_;  // recorded after the unpack that last read the scratch
  bool scratch_used_ = false;
  UlyssesPlanCache plans_;
};

}  // namespace fastcomms
