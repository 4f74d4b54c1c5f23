// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

// Element-wise reduction functions on the CPU for every reducible dtype, in the form Gloo takes:
// c[i] = a[i] op b[i]. Half types compute in float and round to nearest even, as torch does.

#include <cstdint>
#include <cstring>
#include <functional>

#include "fastcomms/core/reduce_op.hpp"
#include "fastcomms/core/tensor.hpp"

namespace fastcomms::gloo_backend {

using ReduceFn = std::function<void(void*, const void*, const void*, size_t)>;

/// float <-> bfloat16 bits, round to nearest even (NaN stays NaN).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

/// float <-> IEEE half bits, round to nearest even.
float half_to_float(uint16_t h);
uint16_t float_to_half(float f);

/// The reduce function for (op, dtype); throws kUnsupported for combinations that have none.
ReduceFn reduce_fn(RedOpType op, DType dt);

/// Multiplies every element of `data` by `factor` in place (PREMUL_SUM's pre-step).
void scale_in_place(void* data, int64_t n, DType dt, double factor);

/// Divides every element by `n` in place (AVG's post-step; integer division for integers).
void divide_in_place(void* data, int64_t count, DType dt, int64_t n);

}  // namespace fastcomms::gloo_backend
