// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// FP8 rows (NOTE [fp8 wire] in include/fastcomms/ulysses/fp8.hpp) on torch tensors, for
// bind_fp8.cpp's test entry points and the Ulysses op's FP8 overloads (tensors.cpp).
#include <ATen/core/Tensor.h>

namespace fastcomms::python {

/// `x` (float16, bfloat16 or float32) quantized over its last dimension into `q` (x's shape, an
/// FP8 dtype) and `scales` (float32, x's shape without the last dimension). Every tensor
/// contiguous, on one device: CPU tensors take the host implementation, CUDA tensors the kernels
/// on the caller's current stream (kUnsupported in a build without CUDA). `what` starts an
/// error's message. The GIL is not needed.
void fp8_quantize(const char* what, const at::Tensor& x, const at::Tensor& q,
                  const at::Tensor& scales);
/// The inverse: `q` times its row's scale into `out` (float16, bfloat16 or float32).
void fp8_dequantize(const char* what, const at::Tensor& q, const at::Tensor& scales,
                    const at::Tensor& out);

}  // namespace fastcomms::python
