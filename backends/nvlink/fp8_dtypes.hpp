// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// core's DType onto the FP8 kernels' enums (cuda/ does not see DType). The callers checked the
// dtypes (check_fp8_rows, the fused path's checks): only these arrive.
#include "fastcomms/core/tensor.hpp"
#include "fastcomms/cuda/fp8.hpp"

namespace fastcomms {

inline cuda::Fp8Wire fp8_wire_of(DType dt) {
  return dt == DType::kFloat8E4M3FN ? cuda::Fp8Wire::kE4M3FN : cuda::Fp8Wire::kE5M2;
}

inline cuda::Fp8Value fp8_value_of(DType dt) {
  switch (dt) {
    case DType::kFloat16:
      return cuda::Fp8Value::kFloat16;
    case DType::kBFloat16:
      return cuda::Fp8Value::kBFloat16;
    default:
      return cuda::Fp8Value::kFloat32;
  }
}

}  // namespace fastcomms
