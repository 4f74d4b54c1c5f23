// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// FP8 on the wire (issue 38): rows of `d` values quantized to FP8 with one float32 scale per
/// row, and back. The host implementation (CPU memory) lives here; the CUDA kernels
/// (include/fastcomms/cuda/fp8.hpp) are reached through fp8_quantize_rows_device() and
/// fp8_dequantize_rows_device(), which a CUDA build registers (this layer includes no CUDA).
///
/// NOTE [fp8 wire]: the numerics, identical bit for bit in python/fastcomms/_fp8.py (torch ops,
/// the reference), in this file's host implementation and in cuda/fp8.cu. FMAX is 448 for
/// float8_e4m3fn and 57344 for float8_e5m2. Per row x[0..d) of a float16, bfloat16 or float32
/// tensor, every step in float32 with IEEE round-to-nearest-even:
///   amax  = max |x[i]| over the row, NaN ignored (a row of zeros and NaNs, or d == 0: 0)
///   scale = amax / FMAX                      (a division, never a multiply by 1/FMAX)
///   y[i]  = x[i] / scale  if scale > 0 (scale = +inf included), else x[i]
///   q[i]  = fp8(clamp(y[i], -FMAX, FMAX))    (nearest, ties to even, as torch's `.to(fp8)`;
///                                             -0 stays -0; a NaN y is the byte 0x7F)
/// and on receipt, for an output dtype of float16, bfloat16 or float32:
///   out[i] = to_dtype(float(q[i]) * scale)   (nearest even, as torch's `.to`; a NaN product
///                                             is the dtype's positive quiet NaN: 0x7E00,
///                                             0x7FC0, 0x7FC00000)
/// Consequences: no value is out of range on the wire (clamped; rounding can only push y past
/// FMAX by an ulp); a row whose scale is 0 is sent as signed zeros and its NaNs, and comes back
/// as zeros (also a row so small that amax / FMAX underflows: amax <= FMAX * 2^-150, 3.1e-43
/// for e4m3 and 4.0e-41 for e5m2); a NaN element comes back NaN at that position only; an
/// infinity in a row makes its scale +inf, its finite values quantize to +-0 and inf / inf to
/// NaN, so every element of that row dequantizes to NaN (0 * inf and NaN * inf are NaN).
/// NaNs are canonical (the sign and payload of an input NaN are not kept): GPU arithmetic returns
/// canonical NaNs where x86 keeps the operand's and makes 0 * inf negative, and torch's own CPU
/// conversions differ by dtype (a NaN to bfloat16 is 0xFFFF, -NaN to float16 0xFE00); fixing the
/// bytes is what lets the three implementations agree on every device.
/// Error bound: while |y| is in FP8's normal range (|x| >= amax * 2^-6 / 448 for e4m3,
/// amax * 2^-14 / 57344 for e5m2) a value comes back within half an FP8 ulp, a relative error of
/// at most 2^-4 (e4m3) or 2^-3 (e5m2), plus the output dtype's own rounding; below that the
/// error is absolute, at most amax * 2^-10 / 448 (e4m3) or amax * 2^-17 / 57344 (e5m2).

#include <cstdint>
#include <functional>

#include "fastcomms/core/tensor.hpp"

namespace fastcomms {

/// The largest finite value of `wire` (448 for float8_e4m3fn, 57344 for float8_e5m2); throws
/// kTypeError for any other dtype.
float fp8_max(DType wire);

/// Checks the arguments of a quantize or dequantize call: `value` (the unquantized side) is
/// float16, bfloat16 or float32, `wire` is float8_e4m3fn or float8_e5m2, rows and d are >= 0 and
/// rows * d fits, and the pointers are non-null when there are elements (scales: rows). `what`
/// starts the message. Throws kTypeError (dtypes) or kInvalidArgument.
void check_fp8_rows(const char* what, DType value, DType wire, int64_t rows, int64_t d,
                    const void* a, const void* b, const float* scales);

/// Quantizes `rows` rows of `d` values of `x` (CPU memory, dtype `in`: float16, bfloat16 or
/// float32, rows contiguous) into `q` (rows * d bytes, dtype `wire`) and `scales` (rows
/// float32), as NOTE [fp8 wire] says.
void fp8_quantize_rows(const void* x, DType in, int64_t rows, int64_t d, void* q, DType wire,
                       float* scales);

/// Dequantizes `rows` rows of `d` FP8 values `q` (dtype `wire`) with their `scales` into `out`
/// (dtype `out_dtype`: float16, bfloat16 or float32), as NOTE [fp8 wire] says. CPU memory.
void fp8_dequantize_rows(const void* q, DType wire, const float* scales, int64_t rows, int64_t d,
                         void* out, DType out_dtype);

/// The CUDA kernels as this layer sees them: same arguments as the host functions (device
/// pointers) plus the stream (a cudaStream_t; null: the default stream) they are ordered on.
struct Fp8DeviceKernels {
  std::function<void(const void* x, DType in, int64_t rows, int64_t d, void* q, DType wire,
                     float* scales, void* stream)>
      quantize;  ///< cuda::fp8_quantize_rows behind a dtype mapping
  std::function<void(const void* q, DType wire, const float* scales, int64_t rows, int64_t d,
                     void* out, DType out_dtype, void* stream)>
      dequantize;  ///< cuda::fp8_dequantize_rows behind a dtype mapping
};

/// Registers the CUDA kernels (a static initializer of a CUDA build, backends/nvlink).
void register_fp8_device_kernels(Fp8DeviceKernels kernels);
/// Whether this build registered CUDA kernels.
bool has_fp8_device_kernels();

/// fp8_quantize_rows on device memory, enqueued on `stream` (the current CUDA device must be the
/// pointers' device). Throws kUnsupported in a build without CUDA.
void fp8_quantize_rows_device(const void* x, DType in, int64_t rows, int64_t d, void* q, DType wire,
                              float* scales, void* stream);
/// fp8_dequantize_rows on device memory, enqueued on `stream`. Throws kUnsupported in a build
/// without CUDA.
void fp8_dequantize_rows_device(const void* q, DType wire, const float* scales, int64_t rows,
                                int64_t d, void* out, DType out_dtype, void* stream);

}  // namespace fastcomms
