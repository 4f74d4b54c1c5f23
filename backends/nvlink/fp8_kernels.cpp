// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The CUDA FP8 kernels (cuda/fp8.cu) registered with the Ulysses layer, which includes no CUDA
// (include/fastcomms/ulysses/fp8.hpp): the dtypes mapped onto the kernels' enums, nothing else.
// Here because this backend is the one target that sees both layers in every CUDA build.
#include <cuda_runtime_api.h>

#include <utility>

#include "backends/nvlink/fp8_dtypes.hpp"
#include "fastcomms/cuda/fp8.hpp"
#include "fastcomms/ulysses/fp8.hpp"

namespace fastcomms {
namespace {

const bool kRegistered = [] {
  Fp8DeviceKernels k;
  k.quantize = [](const void* x, DType in, int64_t rows, int64_t d, void* q, DType wire,
                  float* scales, void* stream) {
    cuda::fp8_quantize_rows(x, fp8_value_of(in), rows, d, q, fp8_wire_of(wire), scales,
                            static_cast<cudaStream_t>(stream));
  };
  k.dequantize = [](const void* q, DType wire, const float* scales, int64_t rows, int64_t d,
                    void* out, DType out_dtype, void* stream) {
    cuda::fp8_dequantize_rows(q, fp8_wire_of(wire), scales, rows, d, out, fp8_value_of(out_dtype),
                              static_cast<cudaStream_t>(stream));
  };
  register_fp8_device_kernels(std::move(k));
  return true;
}();

}  // namespace
}  // namespace fastcomms
