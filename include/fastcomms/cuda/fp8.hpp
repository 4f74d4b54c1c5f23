// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// FP8 on the wire, the CUDA kernels: rows of `d` values quantized to FP8 with one float32 scale
/// per row, and back, bit for bit as the host implementation and the torch reference (NOTE [fp8
/// wire] in include/fastcomms/ulysses/fp8.hpp). Plain launchers over device pointers, ordered on
/// `stream`, launched on the current device. This layer does not see core's DType, hence the two
/// small enums (the Ulysses layer maps DType onto them where it registers these launchers).

#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastcomms/plan/ulysses_plan.hpp"

namespace fastcomms::cuda {

/// The FP8 format on the wire.
enum class Fp8Wire : int8_t {
  kE4M3FN = 0,  ///< torch.float8_e4m3fn (max 448)
  kE5M2 = 1,    ///< torch.float8_e5m2 (max 57344)
};

/// The unquantized side's dtype.
enum class Fp8Value : int8_t {
  kFloat16 = 0,   ///< torch.float16
  kBFloat16 = 1,  ///< torch.bfloat16
  kFloat32 = 2,   ///< torch.float32
};

/// Quantizes `rows` contiguous rows of `d` values of `x` into `q` (rows * d bytes) and `scales`
/// (rows float32). Any d >= 0 and any alignment; 16-byte loads where x is 16-byte aligned and a
/// row is a whole number of 16-byte vectors (and q aligned to the bytes one vector makes).
/// @param x device pointer, rows * d values of dtype `in`
/// @param in the dtype of x
/// @param rows, d the shape (rows >= 0, d >= 0)
/// @param q device pointer, rows * d bytes
/// @param wire the FP8 format of q
/// @param scales device pointer, rows floats
/// @param stream the stream the kernel is ordered on
void fp8_quantize_rows(const void* x, Fp8Value in, int64_t rows, int64_t d, void* q, Fp8Wire wire,
                       float* scales, cudaStream_t stream);

/// One destination of the fused quantize-and-push (NOTE [fp8 fused push] in cuda/fp8.cu).
struct Fp8PushJob {
  const void* x = nullptr;  ///< Base of the source values (desc's source offsets, in elements).
  void* q = nullptr;        ///< Base of the destination FP8 bytes (desc's destination offsets).
  float* scales = nullptr;  ///< Base of the destination scales: one per destination row of d.
  plan::CopyDesc desc;      ///< In FP8 bytes (one per element): whole rows of d on both sides.
};

/// Quantizes the rows the jobs' descriptors cover, writing the FP8 bytes and each row's scale
/// at the destination (a peer's window over NVLink, or local memory): one read of the source,
/// bit for bit fp8_quantize_rows's values. Descriptors must cover whole rows of `d`.
/// @param jobs, count the destinations
/// @param d the row length (values)
/// @param in the dtype of the sources
/// @param wire the FP8 format written
/// @param stream the stream the kernels are ordered on
void fp8_quantize_push(const Fp8PushJob* jobs, int count, int64_t d, Fp8Value in, Fp8Wire wire,
                       cudaStream_t stream);

/// Dequantizes `rows` rows of `d` FP8 values `q` with their `scales` into `out` (rows * d values
/// of dtype `out_dtype`). Any d >= 0 and any alignment; 16-byte stores where out is 16-byte
/// aligned and a row is a whole number of 16-byte vectors (and q aligned to the bytes one vector
/// takes).
/// @param q device pointer, rows * d bytes of format `wire`
/// @param wire the FP8 format of q
/// @param scales device pointer, rows floats
/// @param rows, d the shape (rows >= 0, d >= 0)
/// @param out device pointer, rows * d values of dtype `out_dtype`
/// @param out_dtype the dtype of out
/// @param stream the stream the kernel is ordered on
void fp8_dequantize_rows(const void* q, Fp8Wire wire, const float* scales, int64_t rows, int64_t d,
                         void* out, Fp8Value out_dtype, cudaStream_t stream);

}  // namespace fastcomms::cuda
