// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/half.hpp"

namespace fastcomms {

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      exp = 127 - 15 + 1;
      while ((mant & 0x400u) == 0) {
        mant <<= 1;
        --exp;
      }
      mant &= 0x3ffu;
      bits = sign | (exp << 23) | (mant << 13);
    }
  } else if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u;
  x &= 0x7fffffffu;
  if (x > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (x >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (x < 0x38800000u) {                                               // subnormal or zero in half
    if (x < 0x33000000u) return static_cast<uint16_t>(sign);           // rounds to zero
    const uint32_t exp = x >> 23;
    uint32_t mant = (x & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14 + (113 - exp)
    const uint32_t half_mant = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    uint32_t r = half_mant;
    if (rem > halfway || (rem == halfway && (half_mant & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  // normal: rebias exponent and round mantissa to 10 bits, nearest even
  uint32_t r = x - 0x38000000u;  // exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

}  // namespace fastcomms
