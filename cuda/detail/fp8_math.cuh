// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// FP8 on the wire, per element on the device (private to cuda/): what cuda/fp8.cu's kernels
// compute, kept apart so a transfer kernel that quantizes as it sends computes the same bytes.
// NOTE [fp8 wire] in include/fastcomms/ulysses/fp8.hpp is the contract; the choices here:
//  - IEEE division and multiplication spelled out (__fdiv_rn, __fmul_rn), so the bytes do not
//    depend on -use_fast_math, -prec-div or FMA contraction;
//  - cuda_fp8.h's saturating conversion (sm_89+: one cvt.rn.satfinite instruction; sm_80: the
//    header's integer emulation) only on values already clamped to +-FMAX and not NaN, where it
//    is round-to-nearest-even like torch's `.to(float8)`; a NaN is set to 0x7F here rather than
//    left to each path's NaN rule (torch's own `.to` keeps a NaN's sign);
//  - a row whose scale is 0 holds only zeros, NaNs and values of at most FMAX * 2^-150 (3.1e-43
//    for e4m3, 4.0e-41 for e5m2): they are written as signed zeros and 0x7F with no conversion,
//    so the instruction never meets a float32 subnormal input it might flush.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace fastcomms::cuda::detail {

constexpr uint8_t kFp8NaN = 0x7f;  // a NaN in both formats

template <bool kE4M3>
struct Fp8Traits {
  static constexpr float kMax = kE4M3 ? 448.0f : 57344.0f;
  static constexpr __nv_fp8_interpretation_t kInterp = kE4M3 ? __NV_E4M3 : __NV_E5M2;
};

/// The row's scale from its amax (NaN-free, >= 0).
template <bool kE4M3>
__device__ __forceinline__ float fp8_scale(float amax) {
  return __fdiv_rn(amax, Fp8Traits<kE4M3>::kMax);
}

/// The FP8 byte of value `v` in a row of scale `scale`.
template <bool kE4M3>
__device__ __forceinline__ uint8_t fp8_encode(float v, float scale) {
  using T = Fp8Traits<kE4M3>;
  if (!(scale > 0.0f)) return isnan(v) ? kFp8NaN : (signbit(v) ? uint8_t{0x80} : uint8_t{0});
  const float y = __fdiv_rn(v, scale);
  if (isnan(y)) return kFp8NaN;
  const float c = fminf(fmaxf(y, -T::kMax), T::kMax);
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(c, __NV_SATFINITE, T::kInterp));
}

/// Two FP8 bytes (v0 in the low byte): one conversion instruction on sm_89+.
template <bool kE4M3>
__device__ __forceinline__ uint16_t fp8_encode2(float v0, float v1, float scale) {
  using T = Fp8Traits<kE4M3>;
  if (!(scale > 0.0f)) {
    return static_cast<uint16_t>(fp8_encode<kE4M3>(v0, scale) |
                                 (fp8_encode<kE4M3>(v1, scale) << 8));
  }
  const float y0 = __fdiv_rn(v0, scale);
  const float y1 = __fdiv_rn(v1, scale);
  const float c0 = fminf(fmaxf(y0, -T::kMax), T::kMax);
  const float c1 = fminf(fmaxf(y1, -T::kMax), T::kMax);
  uint16_t r = __nv_cvt_float2_to_fp8x2(make_float2(c0, c1), __NV_SATFINITE, T::kInterp);
  if (isnan(y0)) r = static_cast<uint16_t>((r & 0xff00u) | kFp8NaN);
  if (isnan(y1)) r = static_cast<uint16_t>((r & 0x00ffu) | (kFp8NaN << 8));
  return r;
}

/// The float an FP8 byte holds (exact: every FP8 value is a float16).
template <bool kE4M3>
__device__ __forceinline__ float fp8_decode(uint8_t b) {
  const __half_raw h = __nv_cvt_fp8_to_halfraw(b, Fp8Traits<kE4M3>::kInterp);
  return __half2float(__half(h));
}

/// The dequantized float of byte `b` in a row of scale `scale` (before the output rounding).
template <bool kE4M3>
__device__ __forceinline__ float fp8_dequant(uint8_t b, float scale) {
  return __fmul_rn(fp8_decode<kE4M3>(b), scale);
}

/// The unquantized dtypes: storage, load (exact), store (nearest even; NaN canonical).
struct F16Value {
  using Storage = uint16_t;
  static __device__ __forceinline__ float load(Storage s) {
    return __half2float(__ushort_as_half(s));
  }
  static __device__ __forceinline__ Storage store(float v) {
    return isnan(v) ? Storage{0x7e00} : __half_as_ushort(__float2half_rn(v));
  }
};
struct BF16Value {
  using Storage = uint16_t;
  static __device__ __forceinline__ float load(Storage s) {
    return __bfloat162float(__ushort_as_bfloat16(s));
  }
  static __device__ __forceinline__ Storage store(float v) {
    return isnan(v) ? Storage{0x7fc0} : __bfloat16_as_ushort(__float2bfloat16_rn(v));
  }
};
struct F32Value {
  using Storage = float;
  static __device__ __forceinline__ float load(Storage s) { return s; }
  static __device__ __forceinline__ Storage store(float v) {
    return isnan(v) ? __int_as_float(0x7fc00000) : v;
  }
};

}  // namespace fastcomms::cuda::detail
