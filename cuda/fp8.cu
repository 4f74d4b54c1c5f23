// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// FP8 on the wire, the kernels (NOTE [fp8 wire] in include/fastcomms/ulysses/fp8.hpp; the per
// element numerics in detail/fp8_math.cuh).
//
// A group of G threads (8 or 32, by row length) owns a row: quantize reads it once for the amax
// (a shuffle reduction inside the group), then again for the bytes (the second read is served
// by L1/L2: a row is at most a few KiB); dequantize reads each scale once per row. Groups stride
// over rows, so any row count fits any grid. The vector variants move 16 bytes of the wide side
// per access; the scalar variants take any d and any alignment.
#include "fastcomms/cuda/fp8.hpp"

#include <algorithm>
#include <cstring>

#include "detail/fp8_math.cuh"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::cuda {
namespace {

using detail::BF16Value;
using detail::F16Value;
using detail::F32Value;

constexpr int kThreads = 256;
constexpr unsigned kFullMask = 0xffffffffu;

// Raw bytes of `n` FP8 values, one store (n = 4 or 8).
template <int N>
struct Bytes;
template <>
struct Bytes<4> {
  using Word = uint32_t;
};
template <>
struct Bytes<8> {
  using Word = uint2;
};

// One row of d values at xr quantized into qr, its scale into *scale_out, by the G lanes of a
// group; every lane calls it (the shuffles need whole groups), `valid` false for a group past the
// last row.
template <class V, bool kE4M3, int G, bool kVec>
__device__ __forceinline__ void quantize_row(const typename V::Storage* __restrict__ xr,
                                             uint8_t* __restrict__ qr, float* scale_out, int64_t d,
                                             int lane, bool valid) {
  using S = typename V::Storage;
  constexpr int N = 16 / static_cast<int>(sizeof(S));  // values per 16-byte vector
  float amax = 0.0f;                                   // fmaxf ignores NaN
  if (valid) {
    if constexpr (kVec) {
      const auto* xv = reinterpret_cast<const uint4*>(xr);
      for (int64_t v = lane; v < d / N; v += G) {
        const uint4 u = xv[v];
        S e[N];
        memcpy(e, &u, 16);
#pragma unroll
        for (int j = 0; j < N; ++j) amax = fmaxf(amax, fabsf(V::load(e[j])));
      }
    } else {
      for (int64_t i = lane; i < d; i += G) amax = fmaxf(amax, fabsf(V::load(xr[i])));
    }
  }
#pragma unroll
  for (int o = G / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, o, G));
  const float scale = detail::fp8_scale<kE4M3>(amax);
  if (!valid) return;
  if (lane == 0) *scale_out = scale;
  if constexpr (kVec) {
    using Word = typename Bytes<N>::Word;
    const auto* xv = reinterpret_cast<const uint4*>(xr);
    auto* qv = reinterpret_cast<Word*>(qr);
    for (int64_t v = lane; v < d / N; v += G) {
      const uint4 u = xv[v];
      S e[N];
      memcpy(e, &u, 16);
      uint16_t b[N / 2];
#pragma unroll
      for (int j = 0; j < N / 2; ++j) {
        b[j] = detail::fp8_encode2<kE4M3>(V::load(e[2 * j]), V::load(e[2 * j + 1]), scale);
      }
      Word w;
      memcpy(&w, b, sizeof(w));
      qv[v] = w;
    }
  } else {
    for (int64_t i = lane; i < d; i += G) qr[i] = detail::fp8_encode<kE4M3>(V::load(xr[i]), scale);
  }
}

// Calls f(row, lane, valid) for the rows [0, rows) owned by this thread's group of G lanes,
// striding over the grid's x blocks. Every thread of a block runs the same iterations (the
// shuffles need whole warps): past the last row `valid` is false and `row` is 0.
template <int G, class F>
__device__ __forceinline__ void for_each_row(int64_t rows, F&& f) {
  constexpr int kRowsPerBlock = kThreads / G;
  const int lane = static_cast<int>(threadIdx.x) % G;
  const int group = static_cast<int>(threadIdx.x) / G;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock; first < rows;
       first += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const int64_t row = first + group;
    const bool valid = row < rows;
    f(valid ? row : 0, lane, valid);
  }
}

template <class V, bool kE4M3, int G, bool kVec>
__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const typename V::Storage* __restrict__ x, int64_t rows, int64_t d,
                    uint8_t* __restrict__ q, float* __restrict__ scales) {
  for_each_row<G>(rows, [&](int64_t r, int lane, bool valid) {
    quantize_row<V, kE4M3, G, kVec>(x + r * d, q + r * d, scales + r, d, lane, valid);
  });
}

// NOTE [fp8 fused push]: the rows a descriptor (in FP8 bytes, i.e. elements) covers, quantized
// from the source as they are written to the destination (a peer's window): row k of a job is
// value (k % runs) of row y, slice z, where a run of width / d rows is contiguous on both sides.
constexpr int kPushJobs = 16;
struct PushBatch {
  Fp8PushJob jobs[kPushJobs];
  int count;
};
static_assert(sizeof(PushBatch) <= 4096, "kernel parameter space");

template <class V, bool kE4M3, int G, bool kVec>
__global__ void __launch_bounds__(kThreads) quantize_push_kernel(PushBatch batch, int64_t d) {
  using S = typename V::Storage;
  if (blockIdx.y >= static_cast<unsigned>(batch.count)) return;
  const Fp8PushJob& job = batch.jobs[blockIdx.y];
  const plan::CopyDesc& c = job.desc;
  const int64_t runs = c.width / d;
  for_each_row<G>(runs * c.height * c.depth, [&](int64_t k, int lane, bool valid) {
    const int64_t i = k % runs, t = k / runs, y = t % c.height, z = t / c.height;
    const int64_t src = c.src_offset + z * c.src_slice_pitch + y * c.src_pitch + i * d;
    const int64_t dst = c.dst_offset + z * c.dst_slice_pitch + y * c.dst_pitch + i * d;
    quantize_row<V, kE4M3, G, kVec>(static_cast<const S*>(job.x) + src,
                                    static_cast<uint8_t*>(job.q) + dst, job.scales + dst / d, d,
                                    lane, valid);
  });
}

template <class V, bool kE4M3, int G, bool kVec>
__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* __restrict__ q, const float* __restrict__ scales, int64_t rows,
                      int64_t d, typename V::Storage* __restrict__ out) {
  using S = typename V::Storage;
  constexpr int kRowsPerBlock = kThreads / G;
  constexpr int N = 16 / static_cast<int>(sizeof(S));
  const int lane = static_cast<int>(threadIdx.x) % G;
  const int group = static_cast<int>(threadIdx.x) / G;
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + group; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kRowsPerBlock) {
    const float scale = scales[row];
    const uint8_t* qr = q + row * d;
    S* o = out + row * d;
    if constexpr (kVec) {
      using Word = typename Bytes<N>::Word;
      const auto* qv = reinterpret_cast<const Word*>(qr);
      auto* ov = reinterpret_cast<uint4*>(o);
      for (int64_t v = lane; v < d / N; v += G) {
        const Word w = qv[v];
        uint8_t b[N];
        memcpy(b, &w, N);
        S e[N];
#pragma unroll
        for (int j = 0; j < N; ++j) e[j] = V::store(detail::fp8_dequant<kE4M3>(b[j], scale));
        uint4 u;
        memcpy(&u, e, 16);
        ov[v] = u;
      }
    } else {
      for (int64_t i = lane; i < d; i += G)
        o[i] = V::store(detail::fp8_dequant<kE4M3>(qr[i], scale));
    }
  }
}

bool aligned(const void* p, size_t n) { return reinterpret_cast<uintptr_t>(p) % n == 0; }

// Blocks for `rows` rows at `rows_per_block`; groups stride over the rest.
unsigned grid_for(int64_t rows, int rows_per_block) {
  const int64_t need = (rows + rows_per_block - 1) / rows_per_block;
  return static_cast<unsigned>(std::min<int64_t>(need, int64_t{1} << 20));
}

// Calls f.template operator()<V, kE4M3>() for the runtime (value, wire).
template <class F>
void dispatch(Fp8Value value, Fp8Wire wire, F&& f) {
  const bool e4m3 = wire == Fp8Wire::kE4M3FN;
  switch (value) {
    case Fp8Value::kFloat16:
      return e4m3 ? f.template operator()<F16Value, true>()
                  : f.template operator()<F16Value, false>();
    case Fp8Value::kBFloat16:
      return e4m3 ? f.template operator()<BF16Value, true>()
                  : f.template operator()<BF16Value, false>();
    case Fp8Value::kFloat32:
      return e4m3 ? f.template operator()<F32Value, true>()
                  : f.template operator()<F32Value, false>();
  }
}

// The vector form: the wide side 16-byte aligned in whole 16-byte rows, the FP8 side aligned to
// its words (N = 16 / sizeof(S) bytes).
template <class S>
bool vectorizable(const void* wide, const void* bytes, int64_t d) {
  constexpr int N = 16 / static_cast<int>(sizeof(S));
  return aligned(wide, 16) && (d * static_cast<int64_t>(sizeof(S))) % 16 == 0 && aligned(bytes, N);
}

// Calls launch.template operator()<G, kVec>(): G = 32 lanes a row for rows of 32 or more units
// (16-byte vectors where vec, else values), 8 below.
template <class S, class F>
void launch_rows(int64_t d, bool vec, F&& launch) {
  constexpr int N = 16 / static_cast<int>(sizeof(S));
  const int64_t units = vec ? d / N : d;
  if (units >= 32) {
    vec ? launch.template operator()<32, true>() : launch.template operator()<32, false>();
  } else {
    vec ? launch.template operator()<8, true>() : launch.template operator()<8, false>();
  }
}

void check_args(const char* what, Fp8Value value, Fp8Wire wire, int64_t rows, int64_t d) {
  FASTCOMMS_CHECK(
      value == Fp8Value::kFloat16 || value == Fp8Value::kBFloat16 || value == Fp8Value::kFloat32,
      kTypeError, what, ": unknown value dtype ", static_cast<int>(value));
  FASTCOMMS_CHECK(wire == Fp8Wire::kE4M3FN || wire == Fp8Wire::kE5M2, kTypeError, what,
                  ": unknown wire format ", static_cast<int>(wire));
  FASTCOMMS_CHECK(rows >= 0 && d >= 0, kInvalidArgument, what,
                  ": rows and d must be >= 0, got rows=", rows, " d=", d);
}

// The row kernels (quantize_kernel, dequantize_kernel): checks the arguments, picks the value
// type, the format, G and the vector form, and calls launch.template operator()<V, kE4M3, G,
// kVec>(blocks). `wide` and `bytes` are the value side and the FP8 side. Nothing is launched for
// no rows, nor for rows of no values where `skip_empty_rows` (quantize writes their scales).
template <class F>
void over_rows(const char* what, Fp8Value value, Fp8Wire wire, int64_t rows, int64_t d,
               const void* wide, const void* bytes, bool skip_empty_rows, F&& launch) {
  check_args(what, value, wire, rows, d);
  if (rows == 0 || (skip_empty_rows && d == 0)) return;
  dispatch(value, wire, [&]<class V, bool kE4M3>() {
    using S = typename V::Storage;
    launch_rows<S>(d, vectorizable<S>(wide, bytes, d), [&]<int G, bool kVec>() {
      launch.template operator()<V, kE4M3, G, kVec>(grid_for(rows, kThreads / G));
    });
  });
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void fp8_quantize_rows(const void* x, Fp8Value in, int64_t rows, int64_t d, void* q, Fp8Wire wire,
                       float* scales, cudaStream_t stream) {
  over_rows("cuda::fp8_quantize_rows", in, wire, rows, d, x, q, /*skip_empty_rows=*/false,
            [&]<class V, bool kE4M3, int G, bool kVec>(unsigned blocks) {
              quantize_kernel<V, kE4M3, G, kVec>
                  <<<blocks, kThreads, 0, stream>>>(static_cast<const typename V::Storage*>(x),
                                                    rows, d, static_cast<uint8_t*>(q), scales);
            });
}

void fp8_quantize_push(const Fp8PushJob* jobs, int count, int64_t d, Fp8Value in, Fp8Wire wire,
                       cudaStream_t stream) {
  check_args("cuda::fp8_quantize_push", in, wire, 1, d);
  if (count == 0 || d == 0) return;
  dispatch(in, wire, [&]<class V, bool kE4M3>() {
    using S = typename V::Storage;
    for (int first = 0; first < count; first += kPushJobs) {
      PushBatch batch{};
      batch.count = std::min(kPushJobs, count - first);
      bool vec = true;
      int64_t rows = 0;
      for (int j = 0; j < batch.count; ++j) {
        const Fp8PushJob& job = jobs[first + j];
        const plan::CopyDesc& c = job.desc;
        FASTCOMMS_CHECK(
            c.empty() || (c.width % d == 0 && c.src_offset % d == 0 && c.dst_offset % d == 0 &&
                          c.src_pitch % d == 0 && c.dst_pitch % d == 0),
            kInvalidArgument, "cuda::fp8_quantize_push: a descriptor not made of whole rows of ",
            d);
        batch.jobs[j] = job;
        rows = std::max(rows, c.width / d * c.height * c.depth);
        vec = vec && vectorizable<S>(job.x, job.q, d);
      }
      if (rows == 0) continue;
      auto launch = [&]<int G, bool kVec>() {
        const unsigned blocks = std::min<unsigned>(grid_for(rows, kThreads / G), 4 * 132);
        quantize_push_kernel<V, kE4M3, G, kVec>
            <<<dim3(blocks, batch.count), kThreads, 0, stream>>>(batch, d);
      };
      launch_rows<S>(d, vec, launch);
      FASTCOMMS_CUDA_LAUNCH_CHECK();
    }
  });
}

void fp8_dequantize_rows(const void* q, Fp8Wire wire, const float* scales, int64_t rows, int64_t d,
                         void* out, Fp8Value out_dtype, cudaStream_t stream) {
  over_rows("cuda::fp8_dequantize_rows", out_dtype, wire, rows, d, out, q, /*skip_empty_rows=*/true,
            [&]<class V, bool kE4M3, int G, bool kVec>(unsigned blocks) {
              dequantize_kernel<V, kE4M3, G, kVec>
                  <<<blocks, kThreads, 0, stream>>>(static_cast<const uint8_t*>(q), scales, rows, d,
                                                    static_cast<typename V::Storage*>(out));
            });
}

}  // namespace fastcomms::cuda
