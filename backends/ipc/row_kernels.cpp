// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The MoE row kernels (cuda/rows.cu) registered with core (NOTE [moe row kernels] in
// include/fastcomms/core/rows.hpp): the dtypes mapped onto the kernels' enum, nothing else. Here
// beside the device all-to-all-v they serve, in the one target that sees core and cuda.
#include <cuda_runtime_api.h>

#include <string>
#include <utility>

#include "fastcomms/core/rows.hpp"
#include "fastcomms/cuda/moe_plan.hpp"
#include "fastcomms/cuda/rows.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

cuda::RowValue value_of(DType t) {
  switch (t) {
    case DType::kFloat16:
      return cuda::RowValue::kFloat16;
    case DType::kBFloat16:
      return cuda::RowValue::kBFloat16;
    case DType::kFloat32:
      return cuda::RowValue::kFloat32;
    default:
      throw Error(ErrorCode::kTypeError,
                  "weighted_sum_rows: no kernel for " + std::string(dtype_name(t)));
  }
}

const bool kRegistered = [] {
  RowKernels k;
  k.gather = [](void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, int64_t src_rows,
                int64_t width, const int64_t* index, int64_t n, const int64_t* count,
                bool zero_rest, void* stream) {
    cuda::gather_rows(dst, dst_pitch, src, src_pitch, src_rows, width, index, n, count, zero_rest,
                      static_cast<cudaStream_t>(stream));
  };
  k.weighted_sum = [](void* out, DType out_type, const void* src, DType in_type, int64_t src_pitch,
                      int64_t src_rows, const int64_t* index, const float* w, int64_t tokens,
                      int64_t k_, int64_t d, void* stream) {
    cuda::weighted_sum_rows(out, value_of(out_type), src, value_of(in_type), src_pitch, src_rows,
                            index, w, tokens, k_, d, static_cast<cudaStream_t>(stream));
  };
  k.gather_dequant = [](void* out, DType out_type, const void* src, DType wire, int64_t src_pitch,
                        int64_t src_rows, const float* scales, const int64_t* index, int64_t n,
                        const int64_t* count, int64_t d, void* stream) {
    cuda::gather_dequant_rows(out, value_of(out_type), src, wire == DType::kFloat8E4M3FN, src_pitch,
                              src_rows, scales, index, n, count, d,
                              static_cast<cudaStream_t>(stream));
  };
  k.plan_home = [](const plan::MoePlanHome& a, void* stream) {
    cuda::moe_plan_home(a, static_cast<cudaStream_t>(stream));
  };
  k.plan_send = [](const plan::MoePlanSend& a, void* stream) {
    cuda::moe_plan_send(a, static_cast<cudaStream_t>(stream));
  };
  k.plan_expert = [](const plan::MoePlanExpert& a, void* stream) {
    cuda::moe_plan_expert(a, static_cast<cudaStream_t>(stream));
  };
  register_row_kernels(std::move(k));
  return true;
}();

}  // namespace
}  // namespace fastcomms
