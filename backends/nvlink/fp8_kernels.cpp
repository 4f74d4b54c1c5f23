// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The CUDA FP8 kernels (cuda/fp8.cu) registered with the Ulysses layer, which includes no CUDA
// (include/fastcomms/ulysses/fp8.hpp): the dtypes mapped onto the kernels' enums, nothing else.
// Here because this backend is the one target that sees both layers in every CUDA build.
#include <cuda_runtime_api.h>

#include <utility>

#include "fastcomms/cuda/fp8.hpp"
#include "fastcomms/ulysses/fp8.hpp"

namespace fastcomms {
namespace {

// The arguments were checked by the Ulysses layer (check_fp8_rows): only these dtypes arrive.
cuda::Fp8Wire wire_of(DType dt) {
  return dt == DType::kFloat8E4M3FN ? cuda::Fp8Wire::kE4M3FN : cuda::Fp8Wire::kE5M2;
}
cuda::Fp8Value value_of(DType dt) {
  switch (dt) {
    case DType::kFloat16:
      return cuda::Fp8Value::kFloat16;
    case DType::kBFloat16:
      return cuda::Fp8Value::kBFloat16;
    default:
      return cuda::Fp8Value::kFloat32;
  }
}

const bool kRegistered = [] {
  Fp8DeviceKernels k;
  k.quantize = [](const void* x, DType in, int64_t rows, int64_t d, void* q, DType wire,
                  float* scales, void* stream) {
    cuda::fp8_quantize_rows(x, value_of(in), rows, d, q, wire_of(wire), scales,
                            static_cast<cudaStream_t>(stream));
  };
  k.dequantize = [](const void* q, DType wire, const float* scales, int64_t rows, int64_t d,
                    void* out, DType out_dtype, void* stream) {
    cuda::fp8_dequantize_rows(q, wire_of(wire), scales, rows, d, out, value_of(out_dtype),
                              static_cast<cudaStream_t>(stream));
  };
  register_fp8_device_kernels(std::move(k));
  return true;
}();

}  // namespace
}  // namespace fastcomms
