// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// NOTE [moe row kernels]: the MoE device transport (python/fastcomms/_moe_device.py) moves rows
/// whose number only the GPU knows. Three kernels serve it, with torch's semantics where torch has
/// the op and without a host read where it has none:
/// - gather_rows_device: dst row i = src row index[i] for i < *count (a count in device memory,
///   e.g. a splits tensor's sum), a zero row for an index < 0; rows from *count on are zeroed
///   (`zero_rest`: gradients, whose unused rows autograd may add up) or left unwritten (send
///   buffers, of which only *count rows travel, and recv_x, whose rows past the counts API.md
///   leaves unspecified: zeroing them wrote as many bytes again as the rows in use);
/// - gather_dequant_rows_device: the same gather of FP8 rows, dequantized on the way with a
///   scale per output row (bit for bit the FP8 wire's dequantize of the gathered rows), so an
///   FP8 dispatch writes recv_x once and only its rows in use;
/// - weighted_sum_rows_device: the combine's sum of k rows per token, float32, slot order, each
///   product and sum rounded on its own (bit for bit the collective transport's torch loop), the
///   rows read through an index straight from a receive buffer.
/// Core knows this interface only; the CUDA kernels (include/fastcomms/cuda/rows.hpp) register
/// themselves from backends/ipc, so the binding, which may see neither, reaches them here.

#include <cstdint>
#include <functional>

#include "fastcomms/core/tensor.hpp"
#include "fastcomms/plan/moe_plan.hpp"

namespace fastcomms {

/// The registered launchers (void* stream: a cudaStream_t).
struct RowKernels {
  std::function<void(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch,
                     int64_t src_rows, int64_t width, const int64_t* index, int64_t n,
                     const int64_t* count, bool zero_rest, void* stream)>
      gather;
  std::function<void(void* out, DType out_type, const void* src, DType in_type, int64_t src_pitch,
                     int64_t src_rows, const int64_t* index, const float* w, int64_t tokens,
                     int64_t k, int64_t d, void* stream)>
      weighted_sum;
  std::function<void(void* out, DType out_type, const void* src, DType wire, int64_t src_pitch,
                     int64_t src_rows, const float* scales, const int64_t* index, int64_t n,
                     const int64_t* count, int64_t d, void* stream)>
      gather_dequant;
  // NOTE [moe plan kernels] (include/fastcomms/plan/moe_plan.hpp)
  std::function<void(const plan::MoePlanHome&, void* stream)> plan_home;
  std::function<void(const plan::MoePlanSend&, void* stream)> plan_send;
  std::function<void(const plan::MoePlanExpert&, void* stream)> plan_expert;
};

/// Called once by the CUDA layer's registration.
void register_row_kernels(RowKernels kernels);
/// Whether this build registered them.
bool has_row_kernels();

/// See NOTE [moe row kernels]. Throws kUnsupported without CUDA kernels.
void gather_rows_device(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch,
                        int64_t src_rows, int64_t width, const int64_t* index, int64_t n,
                        const int64_t* count, bool zero_rest, void* stream);
/// See NOTE [moe row kernels]; in_type and out_type are float16, bfloat16 or float32 (else
/// kTypeError). Throws kUnsupported without CUDA kernels.
void weighted_sum_rows_device(void* out, DType out_type, const void* src, DType in_type,
                              int64_t src_pitch, int64_t src_rows, const int64_t* index,
                              const float* w, int64_t tokens, int64_t k, int64_t d, void* stream);

/// See NOTE [moe row kernels]: out row i = src's FP8 row index[i] (`wire`: float8_e4m3fn or
/// float8_e5m2, else kTypeError) dequantized with scales[i] into out_type (float16, bfloat16 or
/// float32), for i < *count; rows from *count on are not written. Throws kUnsupported without
/// CUDA kernels.
void gather_dequant_rows_device(void* out, DType out_type, const void* src, DType wire,
                                int64_t src_pitch, int64_t src_rows, const float* scales,
                                const int64_t* index, int64_t n, const int64_t* count, int64_t d,
                                void* stream);

/// The routing-plan kernels (NOTE [moe plan kernels]), after checking the sizes: at most
/// plan::kMoePlanMaxKeys ranks and local experts (kUnsupported past it: the caller takes the
/// torch plan), element counts below 2^31 (kInvalidArgument). Throws kUnsupported without CUDA.
void moe_plan_home_device(const plan::MoePlanHome& a, void* stream);
void moe_plan_send_device(const plan::MoePlanSend& a, void* stream);
void moe_plan_expert_device(const plan::MoePlanExpert& a, void* stream);
/// Whether the plan kernels take P ranks and L local experts.
bool moe_plan_fits(int64_t ranks, int64_t local_experts);

}  // namespace fastcomms
