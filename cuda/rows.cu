// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The MoE device transport's row kernels (fastcomms/cuda/rows.hpp; NOTE [moe row kernels] in
// include/fastcomms/core/rows.hpp). One block per row (blocks stride over rows, so any row count
// fits any grid); the widest access (16, 8, 4, 2 or 1 bytes) that every pointer, pitch and the
// row width allow. The count is read on the device by every block: the host never learns it.
#include "fastcomms/cuda/rows.hpp"

#include <algorithm>

#include "detail/fp8_math.cuh"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;

template <class V>
__global__ void gather_rows_kernel(char* __restrict__ dst, int64_t dst_pitch,
                                   const char* __restrict__ src, int64_t src_pitch,
                                   int64_t src_rows, int64_t units,
                                   const int64_t* __restrict__ index, int64_t n,
                                   const int64_t* __restrict__ count, bool zero_rest) {
  int64_t lim = n;
  if (count != nullptr) lim = max(int64_t{0}, min(n, *count));
  const int64_t end = zero_rest ? n : lim;
  for (int64_t i = blockIdx.x; i < end; i += gridDim.x) {
    const int64_t j = i < lim ? index[i] : -1;
    V* d = reinterpret_cast<V*>(dst + i * dst_pitch);
    if (j < 0 || j >= src_rows) {
      for (int64_t c = threadIdx.x; c < units; c += blockDim.x) d[c] = V{};
    } else {
      const V* s = reinterpret_cast<const V*>(src + j * src_pitch);
      for (int64_t c = threadIdx.x; c < units; c += blockDim.x) d[c] = s[c];
    }
  }
}

template <class V>
void launch_gather(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch,
                   int64_t src_rows, int64_t width, const int64_t* index, int64_t n,
                   const int64_t* count, bool zero_rest, cudaStream_t stream) {
  const int64_t units = width / static_cast<int64_t>(sizeof(V));
  const int threads = static_cast<int>(std::min<int64_t>(kThreads, ((units + 31) / 32) * 32));
  const auto blocks = static_cast<unsigned>(std::min(n, kMaxBlocks));
  gather_rows_kernel<V><<<blocks, std::max(threads, 32), 0, stream>>>(
      static_cast<char*>(dst), dst_pitch, static_cast<const char*>(src), src_pitch, src_rows, units,
      index, n, count, zero_rest);
  FASTCOMMS_CUDA_CHECK(cudaGetLastError());
}

// The widest power-of-two access (<= 16 bytes) that divides every address and length.
int access_bytes(std::initializer_list<uint64_t> values) {
  uint64_t all = 0;
  for (const uint64_t v : values) all |= v;
  for (int b = 16; b > 1; b /= 2) {
    if (all % static_cast<uint64_t>(b) == 0) return b;
  }
  return 1;
}

template <class In, class Out, int N>
__global__ void weighted_sum_kernel(typename Out::Storage* __restrict__ out,
                                    const char* __restrict__ src, int64_t src_pitch,
                                    int64_t src_rows, const int64_t* __restrict__ index,
                                    const float* __restrict__ w, int64_t tokens, int64_t k,
                                    int64_t d) {
  using S = typename In::Storage;
  using O = typename Out::Storage;
  const int64_t vecs = d / N;  // N values per thread step (d % N == 0 here)
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float acc[N];
#pragma unroll
      for (int e = 0; e < N; ++e) acc[e] = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t slot = t * k + j;
        const int64_t r = index != nullptr ? index[slot] : slot;
        const float wj = w[slot];
        S vals[N];
        if (r >= 0 && r < src_rows) {
          const S* row = reinterpret_cast<const S*>(src + r * src_pitch);
          if constexpr (N * sizeof(S) == 16) {
            const uint4 u = reinterpret_cast<const uint4*>(row)[v];
            memcpy(vals, &u, 16);
          } else {
#pragma unroll
            for (int e = 0; e < N; ++e) vals[e] = row[v * N + e];
          }
#pragma unroll
          for (int e = 0; e < N; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(wj, In::load(vals[e])));
        } else {
#pragma unroll
          for (int e = 0; e < N; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(wj, 0.0f));
        }
      }
      O res[N];
#pragma unroll
      for (int e = 0; e < N; ++e) res[e] = Out::store(acc[e]);
      O* o = out + t * d + v * N;
#pragma unroll
      for (int e = 0; e < N; ++e) o[e] = res[e];
    }
  }
}

template <class In, class Out>
void launch_sum(void* out, const void* src, int64_t src_pitch, int64_t src_rows,
                const int64_t* index, const float* w, int64_t tokens, int64_t k, int64_t d,
                cudaStream_t stream) {
  using S = typename In::Storage;
  constexpr int kVec = 16 / static_cast<int>(sizeof(S));
  const bool vec = d % kVec == 0 && access_bytes({reinterpret_cast<uint64_t>(src),
                                                  static_cast<uint64_t>(src_pitch)}) == 16;
  const auto blocks = static_cast<unsigned>(std::min(tokens, kMaxBlocks));
  auto* o = static_cast<typename Out::Storage*>(out);
  const auto* s = static_cast<const char*>(src);
  if (vec) {
    const int64_t vecs = d / kVec;
    const int threads = static_cast<int>(std::min<int64_t>(kThreads, ((vecs + 31) / 32) * 32));
    weighted_sum_kernel<In, Out, kVec><<<blocks, std::max(threads, 32), 0, stream>>>(
        o, s, src_pitch, src_rows, index, w, tokens, k, d);
  } else {
    const int threads = static_cast<int>(std::min<int64_t>(kThreads, ((d + 31) / 32) * 32));
    weighted_sum_kernel<In, Out, 1><<<blocks, std::max(threads, 32), 0, stream>>>(
        o, s, src_pitch, src_rows, index, w, tokens, k, d);
  }
  FASTCOMMS_CUDA_CHECK(cudaGetLastError());
}

template <class In>
void sum_to(void* out, RowValue out_type, const void* src, int64_t src_pitch, int64_t src_rows,
            const int64_t* index, const float* w, int64_t tokens, int64_t k, int64_t d,
            cudaStream_t stream) {
  switch (out_type) {
    case RowValue::kFloat16:
      return launch_sum<In, detail::F16Value>(out, src, src_pitch, src_rows, index, w, tokens, k, d,
                                              stream);
    case RowValue::kBFloat16:
      return launch_sum<In, detail::BF16Value>(out, src, src_pitch, src_rows, index, w, tokens, k,
                                               d, stream);
    case RowValue::kFloat32:
      return launch_sum<In, detail::F32Value>(out, src, src_pitch, src_rows, index, w, tokens, k, d,
                                              stream);
  }
  throw Error(ErrorCode::kInvalidArgument, "weighted_sum_rows: unknown output type");
}

// gather_dequant_rows: one block per row, N FP8 bytes in and N values out per thread step.
template <class Out, bool kE4M3, int N>
__global__ void gather_dequant_kernel(typename Out::Storage* __restrict__ out, int64_t d,
                                      const uint8_t* __restrict__ src, int64_t src_pitch,
                                      int64_t src_rows, const float* __restrict__ scales,
                                      const int64_t* __restrict__ index, int64_t n,
                                      const int64_t* __restrict__ count) {
  using O = typename Out::Storage;
  int64_t lim = n;
  if (count != nullptr) lim = max(int64_t{0}, min(n, *count));
  const int64_t vecs = d / N;
  for (int64_t i = blockIdx.x; i < lim; i += gridDim.x) {
    const int64_t j = index[i];
    O* o = out + i * d;
    if (j < 0 || j >= src_rows) {
      for (int64_t c = threadIdx.x; c < d; c += blockDim.x) o[c] = Out::store(0.0f);
      continue;
    }
    const float scale = scales[i];
    const uint8_t* s = src + j * src_pitch;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      uint8_t b[N];
      if constexpr (N == 8) {
        const uint2 w = reinterpret_cast<const uint2*>(s)[v];
        memcpy(b, &w, 8);
      } else if constexpr (N == 4) {
        const uint32_t w = reinterpret_cast<const uint32_t*>(s)[v];
        memcpy(b, &w, 4);
      } else {
#pragma unroll
        for (int e = 0; e < N; ++e) b[e] = s[v * N + e];
      }
      O e[N];
#pragma unroll
      for (int q = 0; q < N; ++q) e[q] = Out::store(detail::fp8_dequant<kE4M3>(b[q], scale));
      if constexpr (N * sizeof(O) == 16) {
        uint4 u;
        memcpy(&u, e, 16);
        reinterpret_cast<uint4*>(o)[v] = u;
      } else {
#pragma unroll
        for (int q = 0; q < N; ++q) o[v * N + q] = e[q];
      }
    }
  }
}

template <class Out, bool kE4M3>
void launch_gather_dequant(void* out, const void* src, int64_t src_pitch, int64_t src_rows,
                           const float* scales, const int64_t* index, int64_t n,
                           const int64_t* count, int64_t d, cudaStream_t stream) {
  using O = typename Out::Storage;
  constexpr int kVec = 16 / static_cast<int>(sizeof(O));  // values per 16 output bytes
  const bool vec =
      d % kVec == 0 &&
      access_bytes({reinterpret_cast<uint64_t>(src), static_cast<uint64_t>(src_pitch)}) >= kVec &&
      access_bytes({reinterpret_cast<uint64_t>(out)}) == 16;
  const auto blocks = static_cast<unsigned>(std::min(n, kMaxBlocks));
  auto* o = static_cast<O*>(out);
  const auto* s = static_cast<const uint8_t*>(src);
  const int64_t steps = vec ? d / kVec : d;
  const int threads = static_cast<int>(std::min<int64_t>(kThreads, ((steps + 31) / 32) * 32));
  if (vec) {
    gather_dequant_kernel<Out, kE4M3, kVec><<<blocks, std::max(threads, 32), 0, stream>>>(
        o, d, s, src_pitch, src_rows, scales, index, n, count);
  } else {
    gather_dequant_kernel<Out, kE4M3, 1><<<blocks, std::max(threads, 32), 0, stream>>>(
        o, d, s, src_pitch, src_rows, scales, index, n, count);
  }
  FASTCOMMS_CUDA_CHECK(cudaGetLastError());
}

template <class Out>
void gather_dequant_to(void* out, const void* src, bool e4m3, int64_t src_pitch, int64_t src_rows,
                       const float* scales, const int64_t* index, int64_t n, const int64_t* count,
                       int64_t d, cudaStream_t stream) {
  if (e4m3) {
    launch_gather_dequant<Out, true>(out, src, src_pitch, src_rows, scales, index, n, count, d,
                                     stream);
  } else {
    launch_gather_dequant<Out, false>(out, src, src_pitch, src_rows, scales, index, n, count, d,
                                      stream);
  }
}

}  // namespace

void gather_rows(void* dst, int64_t dst_pitch, const void* src, int64_t src_pitch, int64_t src_rows,
                 int64_t width, const int64_t* index, int64_t n, const int64_t* count,
                 bool zero_rest, cudaStream_t stream) {
  if (n <= 0 || width <= 0) return;
  switch (access_bytes({reinterpret_cast<uint64_t>(dst), reinterpret_cast<uint64_t>(src),
                        static_cast<uint64_t>(dst_pitch), static_cast<uint64_t>(src_pitch),
                        static_cast<uint64_t>(width)})) {
    case 16:
      return launch_gather<uint4>(dst, dst_pitch, src, src_pitch, src_rows, width, index, n, count,
                                  zero_rest, stream);
    case 8:
      return launch_gather<uint2>(dst, dst_pitch, src, src_pitch, src_rows, width, index, n, count,
                                  zero_rest, stream);
    case 4:
      return launch_gather<uint32_t>(dst, dst_pitch, src, src_pitch, src_rows, width, index, n,
                                     count, zero_rest, stream);
    case 2:
      return launch_gather<uint16_t>(dst, dst_pitch, src, src_pitch, src_rows, width, index, n,
                                     count, zero_rest, stream);
    default:
      return launch_gather<uint8_t>(dst, dst_pitch, src, src_pitch, src_rows, width, index, n,
                                    count, zero_rest, stream);
  }
}

void weighted_sum_rows(void* out, RowValue out_type, const void* src, RowValue in_type,
                       int64_t src_pitch, int64_t src_rows, const int64_t* index, const float* w,
                       int64_t tokens, int64_t k, int64_t d, cudaStream_t stream) {
  if (tokens <= 0 || d <= 0) return;
  switch (in_type) {
    case RowValue::kFloat16:
      return sum_to<detail::F16Value>(out, out_type, src, src_pitch, src_rows, index, w, tokens, k,
                                      d, stream);
    case RowValue::kBFloat16:
      return sum_to<detail::BF16Value>(out, out_type, src, src_pitch, src_rows, index, w, tokens, k,
                                       d, stream);
    case RowValue::kFloat32:
      return sum_to<detail::F32Value>(out, out_type, src, src_pitch, src_rows, index, w, tokens, k,
                                      d, stream);
  }
  throw Error(ErrorCode::kInvalidArgument, "weighted_sum_rows: unknown input type");
}

void gather_dequant_rows(void* out, RowValue out_type, const void* src, bool e4m3,
                         int64_t src_pitch, int64_t src_rows, const float* scales,
                         const int64_t* index, int64_t n, const int64_t* count, int64_t d,
                         cudaStream_t stream) {
  if (n <= 0 || d <= 0) return;
  switch (out_type) {
    case RowValue::kFloat16:
      return gather_dequant_to<detail::F16Value>(out, src, e4m3, src_pitch, src_rows, scales, index,
                                                 n, count, d, stream);
    case RowValue::kBFloat16:
      return gather_dequant_to<detail::BF16Value>(out, src, e4m3, src_pitch, src_rows, scales,
                                                  index, n, count, d, stream);
    case RowValue::kFloat32:
      return gather_dequant_to<detail::F32Value>(out, src, e4m3, src_pitch, src_rows, scales, index,
                                                 n, count, d, stream);
  }
  throw Error(ErrorCode::kInvalidArgument, "gather_dequant_rows: unknown output type");
}

}  // namespace fastcomms::cuda
