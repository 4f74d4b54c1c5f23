// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// FP8 on the wire, host side (NOTE [fp8 wire] in include/fastcomms/ulysses/fp8.hpp).
#include "fastcomms/ulysses/fp8.hpp"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <limits>
#include <mutex>
#include <utility>

#include "fastcomms/core/half.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

// An FP8 format: exponent bias and mantissa bits (float8_e4m3fn: 7, 3; float8_e5m2: 15, 2).
struct Fp8Format {
  int bias;
  int mant;
  float max;
};

constexpr Fp8Format kE4M3{7, 3, 448.0f};
constexpr Fp8Format kE5M2{15, 2, 57344.0f};
constexpr uint8_t kFp8NaN = 0x7f;  // a NaN in both formats: the byte every NaN becomes

Fp8Format format_of(DType wire) { return wire == DType::kFloat8E4M3FN ? kE4M3 : kE5M2; }

// The FP8 byte nearest `y` (ties to even), for |y| <= the format's max or NaN: integer
// arithmetic on float32's bits, so no rounding mode or flush-to-zero setting can change it.
// A value is counted in quanta of its FP8 binade (or of the subnormal binade), rounded, and the
// count laid over the binade's code: the code of k quanta in the binade of unbiased exponent e
// is ((e + bias - 1) << mant) + k, which also carries a rounding up into the next binade and
// makes the subnormal codes (k alone) a special case of the same formula.
uint8_t encode_fp8(float y, const Fp8Format& f) {
  const uint32_t bits = std::bit_cast<uint32_t>(y);
  const auto sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t a = bits & 0x7fffffffu;
  if (a > 0x7f800000u) return kFp8NaN;
  const int field = static_cast<int>(a >> 23);
  const uint32_t sig = field == 0 ? (a & 0x7fffffu) : ((a & 0x7fffffu) | 0x800000u);
  const int e = (field == 0 ? 1 : field) - 127;  // value = sig * 2^(e - 23)
  const int binade = std::max(e, 1 - f.bias);    // FP8's exponent for this value
  // Quanta are 2^(binade - mant); value / quantum = sig * 2^(e - 23 - binade + mant).
  const int shift = 23 - f.mant + binade - e;  // >= 23 - mant >= 20
  uint32_t k = 0;
  if (shift < 32) {
    k = sig >> shift;
    const uint32_t rem = sig & ((1u << shift) - 1u);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (k & 1u))) ++k;
  }  // else: below a quarter of the smallest subnormal, k = 0
  const auto code = static_cast<uint32_t>((binade + f.bias - 1) << f.mant) + k;
  return static_cast<uint8_t>(sign | (k == 0 ? 0u : code));
}

// The float every FP8 byte holds (exact; the NaN bytes are NaN, e5m2's 0x7c/0xfc +-inf).
std::array<float, 256> decode_table(const Fp8Format& f) {
  std::array<float, 256> t{};
  const int exp_mask = (1 << (7 - f.mant)) - 1;
  for (int c = 0; c < 256; ++c) {
    const int e = (c >> f.mant) & exp_mask;
    const int m = c & ((1 << f.mant) - 1);
    float v;
    if (f.bias == 7 && (c & 0x7f) == 0x7f) {
      v = std::numeric_limits<float>::quiet_NaN();  // e4m3fn: S.1111.111 only
    } else if (f.bias == 15 && e == exp_mask) {
      v = m == 0 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    } else if (e == 0) {
      v = std::ldexp(static_cast<float>(m), 1 - f.bias - f.mant);
    } else {
      v = std::ldexp(static_cast<float>((1 << f.mant) + m), e - f.bias - f.mant);
    }
    t[c] = (c & 0x80) ? -v : v;
  }
  return t;
}

const std::array<float, 256>& decode_of(DType wire) {
  static const std::array<float, 256> e4m3 = decode_table(kE4M3);
  static const std::array<float, 256> e5m2 = decode_table(kE5M2);
  return wire == DType::kFloat8E4M3FN ? e4m3 : e5m2;
}

float load(const void* p, DType dt, int64_t i) {
  switch (dt) {
    case DType::kFloat16:
      return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case DType::kBFloat16:
      return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

// Stores `v` as `dt`, a NaN as the dtype's positive quiet NaN (NOTE [fp8 wire]).
void store(void* p, DType dt, int64_t i, float v) {
  const bool nan = std::isnan(v);
  switch (dt) {
    case DType::kFloat16:
      static_cast<uint16_t*>(p)[i] = nan ? uint16_t{0x7e00} : float_to_half(v);
      break;
    case DType::kBFloat16:
      static_cast<uint16_t*>(p)[i] = nan ? uint16_t{0x7fc0} : float_to_bf16(v);
      break;
    default:
      static_cast<float*>(p)[i] = nan ? std::bit_cast<float>(0x7fc00000u) : v;
      break;
  }
}

bool is_value_dtype(DType dt) {
  return dt == DType::kFloat16 || dt == DType::kBFloat16 || dt == DType::kFloat32;
}

std::mutex& device_mu() {
  static std::mutex mu;
  return mu;
}
Fp8DeviceKernels& device_kernels() {
  static Fp8DeviceKernels k;
  return k;
}

// A copy of registered kernel `which` (taken under the lock, called outside it); kUnsupported
// naming `op` in a build without CUDA kernels.
template <class Fn>
Fn device_kernel(Fn Fp8DeviceKernels::*which, const char* op) {
  Fn fn;
  {
    std::lock_guard<std::mutex> lock(device_mu());
    fn = device_kernels().*which;
  }
  FASTCOMMS_CHECK(fn, kUnsupported, op, ": this build has no CUDA kernels (built without CUDA)");
  return fn;
}

}  // namespace

float fp8_max(DType wire) {
  FASTCOMMS_CHECK(wire == DType::kFloat8E4M3FN || wire == DType::kFloat8E5M2, kTypeError,
                  "fp8: the wire dtype must be float8_e4m3fn or float8_e5m2, got ",
                  dtype_name(wire));
  return format_of(wire).max;
}

void check_fp8_rows(const char* what, DType value, DType wire, int64_t rows, int64_t d,
                    const void* a, const void* b, const float* scales) {
  FASTCOMMS_CHECK(is_value_dtype(value), kTypeError, what,
                  ": the unquantized dtype must be float16, bfloat16 or float32, got ",
                  dtype_name(value));
  FASTCOMMS_CHECK(wire == DType::kFloat8E4M3FN || wire == DType::kFloat8E5M2, kTypeError, what,
                  ": the wire dtype must be float8_e4m3fn or float8_e5m2, got ", dtype_name(wire));
  FASTCOMMS_CHECK(rows >= 0 && d >= 0, kInvalidArgument, what,
                  ": rows and d must be >= 0, got rows=", rows, " d=", d);
  // rows * d * 4 bytes must fit in int64: a wrapped product would pass the pointer checks and
  // send a kernel over memory it does not own.
  FASTCOMMS_CHECK(d == 0 || rows <= std::numeric_limits<int64_t>::max() / 4 / d, kInvalidArgument,
                  what, ": rows * d overflows, rows=", rows, " d=", d);
  FASTCOMMS_CHECK(rows == 0 || scales != nullptr, kInvalidArgument, what, ": scales is null for ",
                  rows, " rows");
  FASTCOMMS_CHECK(rows * d == 0 || (a != nullptr && b != nullptr), kInvalidArgument, what,
                  ": a data pointer is null for ", rows, " rows of ", d, " values");
}

void fp8_quantize_rows(const void* x, DType in, int64_t rows, int64_t d, void* q, DType wire,
                       float* scales) {
  check_fp8_rows("fp8_quantize_rows", in, wire, rows, d, x, q, scales);
  const Fp8Format f = format_of(wire);
  auto* out = static_cast<uint8_t*>(q);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t base = r * d;
    float amax = 0.0f;
    for (int64_t i = 0; i < d; ++i) {
      const float a = std::fabs(load(x, in, base + i));
      if (a > amax) amax = a;  // false for NaN: ignored
    }
    const float scale = amax / f.max;
    scales[r] = scale;
    for (int64_t i = 0; i < d; ++i) {
      const float v = load(x, in, base + i);
      const float y = scale > 0.0f ? v / scale : v;
      // std::fmin/fmax would turn a NaN into the bound: NaN keeps its byte instead.
      const float c = std::isnan(y) ? y : std::min(std::max(y, -f.max), f.max);
      out[base + i] = encode_fp8(c, f);
    }
  }
}

void fp8_dequantize_rows(const void* q, DType wire, const float* scales, int64_t rows, int64_t d,
                         void* out, DType out_dtype) {
  check_fp8_rows("fp8_dequantize_rows", out_dtype, wire, rows, d, q, out, scales);
  const auto& table = decode_of(wire);
  const auto* in = static_cast<const uint8_t*>(q);
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = scales[r];
    const int64_t base = r * d;
    for (int64_t i = 0; i < d; ++i) store(out, out_dtype, base + i, table[in[base + i]] * scale);
  }
}

void register_fp8_device_kernels(Fp8DeviceKernels kernels) {
  std::lock_guard<std::mutex> lock(device_mu());
  device_kernels() = std::move(kernels);
}

bool has_fp8_device_kernels() {
  std::lock_guard<std::mutex> lock(device_mu());
  return static_cast<bool>(device_kernels().quantize);
}

void fp8_quantize_rows_device(const void* x, DType in, int64_t rows, int64_t d, void* q, DType wire,
                              float* scales, void* stream) {
  check_fp8_rows("fp8_quantize_rows (cuda)", in, wire, rows, d, x, q, scales);
  device_kernel(&Fp8DeviceKernels::quantize, "fp8_quantize_rows")(x, in, rows, d, q, wire, scales,
                                                                  stream);
}

void fp8_dequantize_rows_device(const void* q, DType wire, const float* scales, int64_t rows,
                                int64_t d, void* out, DType out_dtype, void* stream) {
  check_fp8_rows("fp8_dequantize_rows (cuda)", out_dtype, wire, rows, d, q, out, scales);
  device_kernel(&Fp8DeviceKernels::dequantize, "fp8_dequantize_rows")(q, wire, scales, rows, d, out,
                                                                      out_dtype, stream);
}

}  // namespace fastcomms
