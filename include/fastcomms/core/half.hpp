// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// float <-> float16 and bfloat16 bits on the host, round to nearest even as torch's `.to()`.
/// Shared by the gloo reductions and the Ulysses layer's FP8 codec (no CUDA, no torch here).

#include <cstdint>
#include <cstring>

namespace fastcomms {

/// The float a bfloat16 holds (exact).
inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// The bfloat16 nearest `f` (ties to even; a NaN stays a NaN with its sign, quieted).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

/// The float an IEEE half holds (exact).
float half_to_float(uint16_t h);
/// The IEEE half nearest `f` (ties to even, overflow to infinity, NaN stays NaN with its sign).
uint16_t float_to_half(float f);

}  // namespace fastcomms
