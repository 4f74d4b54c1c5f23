// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The registry of the MoE row kernels (fastcomms/core/rows.hpp, NOTE [moe row kernels]).
#include "fastcomms/core/rows.hpp"

#include <mutex>
#include <utility>

#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

std::mutex& mu() {
  static std::mutex m;
  return m;
}
RowKernels& kernels() {
  static RowKernels k;
  return k;
}
RowKernels get(const char* what) {
  std::lock_guard<std::mutex> lock(mu());
  FASTCOMMS_CHECK(kernels().gather != nullptr, kUnsupported, what,
                  ": this build of fastcomms has no CUDA layer");
  return kernels();
}

}  // namespace

void register_row_kernels(RowKernels k) {
  std::lock_guard<std::mutex> lock(mu());
  kernels() = std::move(k);
}

bool has_row_kernels() {
  std::lock_guard<std::mutex> lock(mu());
  return static_cast<bool>(kernels().gather);
}

void gather_rows_device(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch,
                        int64_t src_rows, int64_t width, const int64_t* index, int64_t n,
                        const int64_t* count, bool zero_rest, void* stream) {
  FASTCOMMS_CHECK(n >= 0 && width >= 0 && src_rows >= 0, kInvalidArgument,
                  "gather_rows: rows and width must be >= 0, got n=", n, " width=", width,
                  " src_rows=", src_rows);
  FASTCOMMS_CHECK(dst_pitch >= width && src_pitch >= width, kInvalidArgument,
                  "gather_rows: a row pitch is below the row width (", width, " bytes): dst ",
                  dst_pitch, ", src ", src_pitch);
  get("gather_rows")
      .gather(dst, dst_pitch, src, src_pitch, src_rows, width, index, n, count, zero_rest, stream);
}

void weighted_sum_rows_device(void* out, DType out_type, const void* src, DType in_type,
                              int64_t src_pitch, int64_t src_rows, const int64_t* index,
                              const float* w, int64_t tokens, int64_t k, int64_t d, void* stream) {
  const auto ok = [](DType t) {
    return t == DType::kFloat16 || t == DType::kBFloat16 || t == DType::kFloat32;
  };
  FASTCOMMS_CHECK(ok(in_type) && ok(out_type), kTypeError,
                  "weighted_sum_rows: rows and output must be float16, bfloat16 or float32, got ",
                  dtype_name(in_type), " rows and a ", dtype_name(out_type), " output");
  FASTCOMMS_CHECK(tokens >= 0 && k >= 0 && d >= 0, kInvalidArgument,
                  "weighted_sum_rows: sizes must be >= 0, got tokens=", tokens, " k=", k, " d=", d);
  FASTCOMMS_CHECK(src_pitch >= d * static_cast<int64_t>(dtype_size(in_type)), kInvalidArgument,
                  "weighted_sum_rows: the row pitch (", src_pitch, " bytes) is below a row (", d,
                  " values)");
  get("weighted_sum_rows")
      .weighted_sum(out, out_type, src, in_type, src_pitch, src_rows, index, w, tokens, k, d,
                    stream);
}

}  // namespace fastcomms
