// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "reduce_kernels.hpp"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "fastcomms/error.hpp"

namespace fastcomms::gloo_backend {

namespace {

// Storage type S, computed in C.
template <typename S, typename C>
struct Codec {
  static C load(S v) { return static_cast<C>(v); }
  static S store(C v) { return static_cast<S>(v); }
};
struct HalfCodec {
  static float load(uint16_t v) { return half_to_float(v); }
  static uint16_t store(float v) { return float_to_half(v); }
};
struct BF16Codec {
  static float load(uint16_t v) { return bf16_to_float(v); }
  static uint16_t store(float v) { return float_to_bf16(v); }
};

template <typename S, typename Cd, typename Op>
ReduceFn make(Op op) {
  return [op](void* c, const void* a, const void* b, size_t n) {
    auto* pc = static_cast<S*>(c);
    const auto* pa = static_cast<const S*>(a);
    const auto* pb = static_cast<const S*>(b);
    for (size_t i = 0; i < n; ++i) pc[i] = Cd::store(op(Cd::load(pa[i]), Cd::load(pb[i])));
  };
}

template <typename S, typename Cd, bool Integral>
ReduceFn for_op(RedOpType op) {
  switch (op) {
    case RedOpType::kSum:
    case RedOpType::kAvg:
    case RedOpType::kPremulSum:
      return make<S, Cd>([](auto x, auto y) { return x + y; });
    case RedOpType::kProduct:
      return make<S, Cd>([](auto x, auto y) { return x * y; });
    case RedOpType::kMin:
      return make<S, Cd>([](auto x, auto y) { return std::min(x, y); });
    case RedOpType::kMax:
      return make<S, Cd>([](auto x, auto y) { return std::max(x, y); });
    case RedOpType::kBand:
    case RedOpType::kBor:
    case RedOpType::kBxor:
      if constexpr (Integral) {
        if (op == RedOpType::kBand) return make<S, Cd>([](auto x, auto y) { return x & y; });
        if (op == RedOpType::kBor) return make<S, Cd>([](auto x, auto y) { return x | y; });
        return make<S, Cd>([](auto x, auto y) { return x ^ y; });
      }
      break;
  }
  throw Error(ErrorCode::kUnsupported,
              detail::cat("gloo: no reduction ", red_op_name(op), " for this dtype"));
}

}  // namespace

ReduceFn reduce_fn(RedOpType op, DType dt) {
  switch (dt) {
    case DType::kFloat16:
      return for_op<uint16_t, HalfCodec, false>(op);
    case DType::kBFloat16:
      return for_op<uint16_t, BF16Codec, false>(op);
    case DType::kFloat32:
      return for_op<float, Codec<float, float>, false>(op);
    case DType::kFloat64:
      return for_op<double, Codec<double, double>, false>(op);
    case DType::kInt8:
      return for_op<int8_t, Codec<int8_t, int8_t>, true>(op);
    case DType::kUInt8:
      return for_op<uint8_t, Codec<uint8_t, uint8_t>, true>(op);
    case DType::kInt32:
      return for_op<int32_t, Codec<int32_t, int32_t>, true>(op);
    case DType::kInt64:
      return for_op<int64_t, Codec<int64_t, int64_t>, true>(op);
    case DType::kBool:
      return for_op<uint8_t, Codec<uint8_t, uint8_t>, true>(op);
    default:
      break;
  }
  throw Error(ErrorCode::kUnsupported,
              detail::cat("gloo: reductions on ", dtype_name(dt), " are not supported"));
}

namespace {
template <typename S, typename Cd, typename F>
void map_in_place(void* data, int64_t n, F f) {
  auto* p = static_cast<S*>(data);
  for (int64_t i = 0; i < n; ++i) p[i] = Cd::store(f(Cd::load(p[i])));
}

template <typename F>
void map_any(void* data, int64_t n, DType dt, F f) {
  switch (dt) {
    case DType::kFloat16:
      return map_in_place<uint16_t, HalfCodec>(data, n, f);
    case DType::kBFloat16:
      return map_in_place<uint16_t, BF16Codec>(data, n, f);
    case DType::kFloat32:
      return map_in_place<float, Codec<float, float>>(data, n, f);
    case DType::kFloat64:
      return map_in_place<double, Codec<double, double>>(data, n, f);
    case DType::kInt8:
      return map_in_place<int8_t, Codec<int8_t, int8_t>>(data, n, f);
    case DType::kUInt8:
    case DType::kBool:
      return map_in_place<uint8_t, Codec<uint8_t, uint8_t>>(data, n, f);
    case DType::kInt32:
      return map_in_place<int32_t, Codec<int32_t, int32_t>>(data, n, f);
    case DType::kInt64:
      return map_in_place<int64_t, Codec<int64_t, int64_t>>(data, n, f);
    default:
      throw Error(ErrorCode::kUnsupported,
                  detail::cat("gloo: arithmetic on ", dtype_name(dt), " is not supported"));
  }
}
}  // namespace

double factor_in(DType dt, double factor) {
  switch (dt) {
    case DType::kFloat16:
      return half_to_float(float_to_half(static_cast<float>(factor)));
    case DType::kBFloat16:
      return bf16_to_float(float_to_bf16(static_cast<float>(factor)));
    case DType::kFloat32:
      return static_cast<float>(factor);
    default:
      return factor;
  }
}

double read_factor(const TensorView& f) {
  switch (f.dtype) {
    case DType::kFloat16:
      return half_to_float(*static_cast<const uint16_t*>(f.data));
    case DType::kBFloat16:
      return bf16_to_float(*static_cast<const uint16_t*>(f.data));
    case DType::kFloat32:
      return *static_cast<const float*>(f.data);
    case DType::kFloat64:
      return *static_cast<const double*>(f.data);
    default:
      throw Error(ErrorCode::kTypeError, detail::cat("gloo: a PREMUL_SUM factor of dtype ",
                                                     dtype_name(f.dtype), " is not supported"));
  }
}

void scale_in_place(void* data, int64_t n, DType dt, double factor) {
  // NOTE [premul arithmetic]: as NCCL's FuncPreMulSum, the factor is first rounded to the
  // reduction's type and each element is multiplied in that type (for half types the product of
  // two half values is exact in float, so one rounding to the type gives NCCL's __hmul2 result).
  const double f = factor_in(dt, factor);
  map_any(data, n, dt, [f](auto v) {
    using T = decltype(v);
    return static_cast<T>(v * static_cast<T>(f));
  });
}

void divide_in_place(void* data, int64_t count, DType dt, int64_t n) {
  map_any(data, count, dt, [n](auto v) {
    using T = decltype(v);
    if constexpr (std::is_integral_v<T>) {
      // Truncated toward zero, as NCCL's ncclAvg on integers and torchcomms' gloo (div "trunc");
      // divided in int64 so that a world larger than the type's range divides correctly.
      return static_cast<T>(static_cast<int64_t>(v) / n);
    } else {
      return static_cast<T>(v / static_cast<T>(n));
    }
  });
}

}  // namespace fastcomms::gloo_backend
