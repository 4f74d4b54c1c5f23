// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Row kernels of the MoE device transport (NOTE [moe row kernels] in
/// include/fastcomms/core/rows.hpp): a row gather bounded by a count that lives on the GPU, and
/// the combine's weighted sum of k rows per token in float32, slot order, no fused multiply-add
/// (bit for bit torch's `acc = acc + w * row` loop). Plain launchers over device pointers, ordered
/// on `stream`, launched on the current device; this layer does not see core's DType.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace fastcomms::cuda {

/// The value types of the weighted sum (rows and output).
enum class RowValue : int8_t { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };

/// dst row i = src row index[i] (`width` bytes) for i < min(n, *count) (count null: n); an index
/// < 0 or >= src_rows writes a zero row (never reads past src); rows from *count on are zeroed
/// when `zero_rest`, else not written. Pitches are the bytes from one row to the next.
void gather_rows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, int64_t src_rows,
                 int64_t width, const int64_t* index, int64_t n, const int64_t* count,
                 bool zero_rest, cudaStream_t stream);

/// out (tokens, d) = for each token t, float32 acc = 0, then for j < k in order:
/// acc = acc + w[t * k + j] * float(row(t, j)) (each product and sum rounded on its own), stored
/// in out's type. row(t, j) is src row index[t * k + j] (index null: row t * k + j; an index < 0
/// or >= src_rows: zeros), of d values of type `in`, rows `src_pitch` bytes apart; out contiguous.
void weighted_sum_rows(void* out, RowValue out_type, const void* src, RowValue in_type,
                       int64_t src_pitch, int64_t src_rows, const int64_t* index, const float* w,
                       int64_t tokens, int64_t k, int64_t d, cudaStream_t stream);

/// out row i (d values of out_type, rows contiguous) = the FP8 row index[i] of src (d bytes,
/// `e4m3` or e5m2, rows `src_pitch` bytes apart) dequantized with scales[i]: each value
/// out_type(float(byte) * scales[i]), bit for bit fp8_dequantize_rows (cuda/fp8.hpp) of the
/// gathered row. Rows i < min(n, *count) only (count null: n); rows from *count on are not
/// written; an index < 0 or >= src_rows writes zeros (never reads past src).
void gather_dequant_rows(void* out, RowValue out_type, const void* src, bool e4m3,
                         int64_t src_pitch, int64_t src_rows, const float* scales,
                         const int64_t* index, int64_t n, const int64_t* count, int64_t d,
                         cudaStream_t stream);

}  // namespace fastcomms::cuda
