// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The registry of the MoE row kernels (fastcomms/core/rows.hpp, NOTE [moe row kernels]).
#include "fastcomms/core/rows.hpp"

#include <algorithm>
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

void gather_dequant_rows_device(void* out, DType out_type, const void* src, DType wire,
                                int64_t src_pitch, int64_t src_rows, const float* scales,
                                const int64_t* index, int64_t n, const int64_t* count, int64_t d,
                                void* stream) {
  FASTCOMMS_CHECK(
      out_type == DType::kFloat16 || out_type == DType::kBFloat16 || out_type == DType::kFloat32,
      kTypeError, "gather_dequant_rows: the output must be float16, bfloat16 or float32, got ",
      dtype_name(out_type));
  FASTCOMMS_CHECK(wire == DType::kFloat8E4M3FN || wire == DType::kFloat8E5M2, kTypeError,
                  "gather_dequant_rows: the rows must be float8_e4m3fn or float8_e5m2, got ",
                  dtype_name(wire));
  FASTCOMMS_CHECK(n >= 0 && d >= 0 && src_rows >= 0, kInvalidArgument,
                  "gather_dequant_rows: sizes must be >= 0, got n=", n, " d=", d,
                  " src_rows=", src_rows);
  FASTCOMMS_CHECK(src_pitch >= d, kInvalidArgument, "gather_dequant_rows: the row pitch (",
                  src_pitch, " bytes) is below a row (", d, " bytes)");
  get("gather_dequant_rows")
      .gather_dequant(out, out_type, src, wire, src_pitch, src_rows, scales, index, n, count, d,
                      stream);
}

bool moe_plan_fits(int64_t ranks, int64_t local_experts) {
  return ranks >= 1 && local_experts >= 1 && ranks <= plan::kMoePlanMaxKeys &&
         local_experts <= plan::kMoePlanMaxKeys;
}

namespace {

constexpr int64_t kMaxElems = int64_t{1} << 31;

void check_plan_sizes(const char* what, int64_t ranks, int64_t local_experts, int64_t elems) {
  FASTCOMMS_CHECK(moe_plan_fits(ranks, local_experts), kUnsupported, what,
                  ": the plan kernels take 1 to ", plan::kMoePlanMaxKeys,
                  " ranks and local experts, got ", ranks, " ranks and ", local_experts,
                  " local experts");
  FASTCOMMS_CHECK(elems >= 0 && elems < kMaxElems, kInvalidArgument, what,
                  ": the (row, slot) pairs must number below 2^31, got ", elems);
}

}  // namespace

void moe_plan_home_device(const plan::MoePlanHome& a, void* stream) {
  const char* what = "moe plan_home";
  FASTCOMMS_CHECK(a.tokens >= 0 && a.k >= 1 && a.num_experts >= 1 && a.num_experts < kMaxElems &&
                      a.num_experts == a.ranks * a.local_experts,
                  kInvalidArgument, what,
                  ": tokens >= 0, k >= 1 and num_experts = ranks * "
                  "local experts below 2^31 expected, got tokens=",
                  a.tokens, " k=", a.k, " num_experts=", a.num_experts, " ranks=", a.ranks,
                  " local experts=", a.local_experts);
  check_plan_sizes(what, a.ranks, a.local_experts, a.tokens * a.k);
  FASTCOMMS_CHECK(a.send_rows == a.tokens * std::min(a.k, a.ranks), kInvalidArgument, what,
                  ": send rows must be tokens * min(k, ranks) = ",
                  a.tokens * std::min(a.k, a.ranks), ", got ", a.send_rows);
  FASTCOMMS_CHECK(a.scratch != nullptr, kInvalidArgument, what, ": no scratch");
  get(what).plan_home(a, stream);
}

void moe_plan_send_device(const plan::MoePlanSend& a, void* stream) {
  const char* what = "moe plan_send";
  FASTCOMMS_CHECK(a.tokens >= 0 && a.k >= 1, kInvalidArgument, what,
                  ": tokens >= 0 and k >= 1 expected, got tokens=", a.tokens, " k=", a.k);
  check_plan_sizes(what, a.ranks, 1, a.tokens * a.k);
  FASTCOMMS_CHECK(a.send_rows == a.tokens * std::min(a.k, a.ranks), kInvalidArgument, what,
                  ": send rows must be tokens * min(k, ranks) = ",
                  a.tokens * std::min(a.k, a.ranks), ", got ", a.send_rows);
  FASTCOMMS_CHECK(a.meta_pitch >= 4 * (2 + 2 * a.k), kInvalidArgument, what,
                  ": the send rows' pitch (", a.meta_pitch, " bytes) is below the metadata (",
                  4 * (2 + 2 * a.k), " bytes)");
  FASTCOMMS_CHECK(a.scratch != nullptr, kInvalidArgument, what, ": no scratch");
  get(what).plan_send(a, stream);
}

void moe_plan_expert_device(const plan::MoePlanExpert& a, void* stream) {
  const char* what = "moe plan_expert";
  FASTCOMMS_CHECK(a.recv_rows >= 0 && a.k >= 1 && a.capacity >= 0 && a.capacity < kMaxElems,
                  kInvalidArgument, what,
                  ": receive rows >= 0, k >= 1 and a capacity below 2^31 expected, got rows=",
                  a.recv_rows, " k=", a.k, " capacity=", a.capacity);
  check_plan_sizes(what, a.ranks, a.local_experts, a.recv_rows * a.k);
  FASTCOMMS_CHECK(a.meta_pitch >= 4 * (2 + 2 * a.k), kInvalidArgument, what,
                  ": the receive rows' pitch (", a.meta_pitch, " bytes) is below the metadata (",
                  4 * (2 + 2 * a.k), " bytes)");
  FASTCOMMS_CHECK(a.scratch != nullptr, kInvalidArgument, what, ": no scratch");
  get(what).plan_expert(a, stream);
}

}  // namespace fastcomms
