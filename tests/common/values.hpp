// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// Small-integer test values in every dtype, shared by the host and GPU tiers (no gtest here).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "fastcomms/core/tensor.hpp"

namespace fastcomms::test {

inline uint16_t small_to_half(double v) {  // exact for values representable in fp16
  if (v == 0) return std::signbit(v) ? 0x8000 : 0;
  const uint16_t sign = v < 0 ? 0x8000 : 0;
  int e;
  const double m = std::frexp(std::fabs(v), &e);  // v = m * 2^e, m in [0.5, 1)
  const int exp = e - 1 + 15;
  const auto mant = static_cast<uint16_t>(std::llround((m * 2 - 1) * 1024));
  return static_cast<uint16_t>(sign | (exp << 10) | mant);
}
inline double half_to_double(uint16_t h) {
  const int exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  const double s = (h & 0x8000) ? -1 : 1;
  if (exp == 0) return s * std::ldexp(mant, -24);
  if (exp == 31) return mant ? NAN : s * INFINITY;
  return s * std::ldexp(1024 + mant, exp - 25);
}

inline void encode(DType dt, void* p, double v) {
  switch (dt) {
    case DType::kFloat16: {
      const uint16_t h = small_to_half(v);
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::kBFloat16: {
      const float f = static_cast<float>(v);
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      const auto h = static_cast<uint16_t>(bits >> 16);  // exact for the small values we use
      std::memcpy(p, &h, 2);
      break;
    }
    case DType::kFloat32: {
      const float f = static_cast<float>(v);
      std::memcpy(p, &f, 4);
      break;
    }
    case DType::kFloat64:
      std::memcpy(p, &v, 8);
      break;
    case DType::kInt8:
      *static_cast<int8_t*>(p) = static_cast<int8_t>(v);
      break;
    case DType::kUInt8:
    case DType::kBool:
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
      *static_cast<uint8_t*>(p) = static_cast<uint8_t>(static_cast<int64_t>(v));
      break;
    case DType::kInt32: {
      const auto i = static_cast<int32_t>(v);
      std::memcpy(p, &i, 4);
      break;
    }
    case DType::kInt64: {
      const auto i = static_cast<int64_t>(v);
      std::memcpy(p, &i, 8);
      break;
    }
  }
}

inline double decode(DType dt, const void* p) {
  switch (dt) {
    case DType::kFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return half_to_double(h);
    }
    case DType::kBFloat16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    case DType::kFloat32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::kFloat64: {
      double d;
      std::memcpy(&d, p, 8);
      return d;
    }
    case DType::kInt8:
      return *static_cast<const int8_t*>(p);
    case DType::kUInt8:
    case DType::kBool:
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
      return *static_cast<const uint8_t*>(p);
    case DType::kInt32: {
      int32_t i;
      std::memcpy(&i, p, 4);
      return i;
    }
    case DType::kInt64: {
      int64_t i;
      std::memcpy(&i, p, 8);
      return static_cast<double>(i);
    }
  }
  return 0;
}

}  // namespace fastcomms::test
