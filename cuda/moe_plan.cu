// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The MoE routing-plan kernels (fastcomms/cuda/moe_plan.hpp; NOTE [moe plan kernels] in
// include/fastcomms/plan/moe_plan.hpp). One block of kThreads each; the sort is a stable counting
// sort whose order within a key is the flat order of the elements (torch's stable argsort).
#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/moe_plan.hpp"

namespace fastcomms::cuda {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr unsigned kAll = 0xffffffffu;
constexpr int64_t kH = plan::kMoeHeader;

// The shared memory of a sort over K keys: a histogram, the running start of each key, each
// warp's count of each key in the current tile, each warp's count of keyed elements, the total
// and the running arrival count. Kernels put their own arrays after end().
struct Sorter {
  int K;
  int* hist;
  int* run;
  int* wcnt;
  int* wk;
  int* total;
  int* arrival;
  __device__ Sorter(int* sm, int k)
      : K(k),
        hist(sm),
        run(sm + k),
        wcnt(sm + 2 * k),
        wk(sm + 2 * k + kWarps * k),
        total(wk + kWarps),
        arrival(total + 1) {}
  [[nodiscard]] __device__ int* end() const { return arrival + 1; }
  static size_t bytes(int64_t k) {
    return sizeof(int) * static_cast<size_t>(2 * k + kWarps * k + kWarps + 2);
  }
};

// out = the exclusive prefix sum of in (K values), *total = their sum; warp 0 only (the caller
// syncs the block after it).
__device__ void scan_keys(const int* in, int* out, int K, int* total) {
  if (threadIdx.x >= 32) return;
  const int lane = static_cast<int>(threadIdx.x);
  const int per = (K + 31) / 32;
  const int b = min(K, lane * per);
  const int e = min(K, b + per);
  int s = 0;
  for (int i = b; i < e; ++i) s += in[i];
  int inc = s;
  for (int o = 1; o < 32; o <<= 1) {
    const int v = __shfl_up_sync(kAll, inc, o);
    if (lane >= o) inc += v;
  }
  int ex = inc - s;
  for (int i = b; i < e; ++i) {
    const int v = in[i];
    out[i] = ex;
    ex += v;
  }
  if (lane == 31) *total = inc;
}

// The stable counting sort of n elements by key_of(i) in [0, K) (-1: not sorted). For each keyed
// element, emit(i, key, place, arrival): place = the start of its key + the keyed elements of
// that key before it; arrival = the keyed elements before it. Afterwards s.hist holds the counts
// and *s.total their sum. Every thread of the block calls it.
template <class Key, class Emit>
__device__ void stable_sort(const Sorter& s, int64_t n, Key key_of, Emit emit) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  for (int e = tid; e < s.K; e += kThreads) s.hist[e] = 0;
  for (int e = tid; e < kWarps * s.K; e += kThreads) s.wcnt[e] = 0;
  if (tid == 0) *s.arrival = 0;
  __syncthreads();
  for (int64_t i = tid; i < n; i += kThreads) {
    const int e = key_of(i);
    if (e >= 0) atomicAdd(&s.hist[e], 1);
  }
  __syncthreads();
  scan_keys(s.hist, s.run, s.K, s.total);
  __syncthreads();
  const unsigned lt = (1u << lane) - 1u;
  for (int64_t t0 = 0; t0 < n; t0 += kThreads) {
    const int64_t i = t0 + tid;
    const int e = i < n ? key_of(i) : -1;
    const unsigned peers = __match_any_sync(kAll, e);
    const unsigned keyed = __ballot_sync(kAll, e >= 0);
    const int rank = __popc(peers & lt);
    if (e >= 0 && rank == 0) s.wcnt[warp * s.K + e] = __popc(peers);
    if (lane == 0) s.wk[warp] = __popc(keyed);
    __syncthreads();
    if (e >= 0) {
      int pre = 0;
      int apre = 0;
      for (int w = 0; w < warp; ++w) {
        pre += s.wcnt[w * s.K + e];
        apre += s.wk[w];
      }
      emit(i, e, static_cast<int64_t>(s.run[e] + pre + rank),
           static_cast<int64_t>(*s.arrival + apre + __popc(keyed & lt)));
    }
    __syncthreads();
    if (e >= 0 && rank == 0) {
      atomicAdd(&s.run[e], __popc(peers));  // a leader per key in each warp
      s.wcnt[warp * s.K + e] = 0;
    }
    if (tid == 0) {
      int a = 0;
      for (int w = 0; w < kWarps; ++w) a += s.wk[w];
      *s.arrival += a;
    }
    __syncthreads();
  }
}

__device__ __forceinline__ void store_u32(unsigned char* p, uint32_t v) {
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) {
    *reinterpret_cast<uint32_t*>(p) = v;
  } else {
    p[0] = static_cast<unsigned char>(v);
    p[1] = static_cast<unsigned char>(v >> 8);
    p[2] = static_cast<unsigned char>(v >> 16);
    p[3] = static_cast<unsigned char>(v >> 24);
  }
}

__device__ __forceinline__ uint32_t load_u32(const unsigned char* p) {
  if ((reinterpret_cast<uintptr_t>(p) & 3u) == 0) return *reinterpret_cast<const uint32_t*>(p);
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
         (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
}

// A home slot's code: its sort key + 1 (the rank it is sent to, 0: not sent, as an earlier slot
// of its token goes to that rank or it is dropped) and the verdict bits.
constexpr int32_t kBadBit = 1 << 30;  // an expert id out of range
constexpr int32_t kDupBit = 1 << 29;  // an expert an earlier slot of the token names
constexpr int32_t kKeyMask = kDupBit - 1;

constexpr int kGridThreads = 256;
constexpr int64_t kMaxGrid = 2048;

__device__ __forceinline__ int64_t grid_start() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Grid: each slot's owner, local expert and code.
__global__ void home_keys_kernel(plan::MoePlanHome a) {
  const int64_t k = a.k;
  const int64_t E = a.num_experts;
  const int64_t L = a.local_experts;
  const int64_t n = a.tokens * k;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const int64_t v = a.idx[i];
    const bool valid = v >= 0 && v < E;
    const int64_t p = valid ? v / L : -1;
    a.owner[i] = p;
    a.local[i] = valid ? v % L : -1;
    int32_t code = v < -1 || v >= E ? kBadBit : 0;
    bool sent = valid;
    for (int64_t j = i - i % k; j < i; ++j) {
      const int64_t u = a.idx[j];
      if (valid && u == v) code |= kDupBit;
      if (u >= 0 && u < E && u / L == p) sent = false;
    }
    a.keys[i] = code | static_cast<int32_t>(sent ? p + 1 : 0);
  }
}

// One block: the verdict, the packed rows to send, the header.
__global__ void __launch_bounds__(kThreads) home_kernel(plan::MoePlanHome a) {
  extern __shared__ int sm[];
  const Sorter s(sm, static_cast<int>(a.ranks));
  __shared__ unsigned long long first_bad;
  __shared__ unsigned long long dup_key;  // (token << 32) | expert: the first, then the smallest
  __shared__ long long verdict[3];
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t k = a.k;
  const int64_t n = a.tokens * k;
  if (tid == 0) {
    first_bad = ULLONG_MAX;
    dup_key = ULLONG_MAX;
  }
  __syncthreads();
  for (int64_t i = tid; i < n; i += kThreads) {
    const int32_t c = a.keys[i];
    if ((c & kBadBit) != 0) atomicMin(&first_bad, static_cast<unsigned long long>(i));
    if ((c & kDupBit) != 0) {
      atomicMin(&dup_key, (static_cast<unsigned long long>(i / k) << 32) |
                              static_cast<unsigned long long>(a.idx[i]));
    }
  }
  const auto key_of = [&](int64_t i) -> int { return (a.keys[i] & kKeyMask) - 1; };
  const auto emit = [&](int64_t i, int p, int64_t place, int64_t) {
    a.send_tok[place] = i / k;
    a.send_dest[place] = p;
  };
  stable_sort(s, n, key_of, emit);
  for (int64_t r = *s.total + tid; r < a.send_rows; r += kThreads) {
    a.send_tok[r] = 0;
    a.send_dest[r] = 0;
  }
  if (tid == 0) {
    long long status = a.tokens > a.max_tokens ? a.overflow_bit : 0;
    long long bad = 0;
    long long where = -1;
    if (first_bad != ULLONG_MAX) {
      status |= a.bad_expert_bit;
      bad = a.idx[first_bad];
      where = static_cast<long long>(first_bad / k);
    } else if (dup_key != ULLONG_MAX) {
      status |= a.duplicate_bit;
      bad = static_cast<long long>(dup_key & 0xffffffffULL);
      where = static_cast<long long>(dup_key >> 32);
    }
    verdict[0] = status;
    verdict[1] = bad;
    verdict[2] = where;
  }
  __syncthreads();
  for (int64_t p = tid; p < a.ranks; p += kThreads) {
    int64_t* h = a.head + p * kH;
    h[0] = s.hist[p];
    h[1] = verdict[0];
    h[2] = a.tokens;
    h[3] = verdict[1];
    h[4] = verdict[2];
  }
}

__global__ void __launch_bounds__(kThreads) send_kernel(plan::MoePlanSend a) {
  extern __shared__ int sm[];
  const Sorter s(sm, static_cast<int>(a.ranks));
  __shared__ int ok_s;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t P = a.ranks;
  const int64_t k = a.k;
  const int64_t n = a.tokens * k;
  if (tid == 0) {
    int ok = 1;
    int64_t r = 0;
    for (int64_t p = 0; p < P; ++p) {
      if (a.got[p * kH + 1] != 0) {
        if (ok != 0) r = p;
        ok = 0;
      }
    }
    if (a.flags[0] == 0 && ok == 0) {
      const int64_t* g = a.got + r * kH;
      a.flags[0] = g[1];
      a.flags[1] = r;
      a.flags[2] = g[2];
      a.flags[3] = g[3];
      a.flags[4] = g[4];
    }
    long long rows = 0;
    if (ok != 0) {
      for (int64_t p = 0; p < P; ++p) rows += a.head[p * kH];
    }
    ok_s = ok;
    *a.send_total = rows;
  }
  __syncthreads();
  const bool ok = ok_s != 0;
  for (int64_t p = tid; p < P; p += kThreads) {
    a.send_splits[p] = ok ? a.head[p * kH] : 0;
    a.recv_splits[p] = ok ? a.got[p * kH] : 0;
  }
  for (int64_t i = tid; i < n; i += kThreads) a.slot_src[i] = -1;
  // the returning rows: by owner rank, then flat slot
  const auto key_of = [&](int64_t i) -> int { return ok ? static_cast<int>(a.owner[i]) : -1; };
  const auto emit = [&](int64_t i, int, int64_t place, int64_t) { a.slot_src[i] = place; };
  stable_sort(s, n, key_of, emit);
  for (int64_t p = tid; p < P; p += kThreads) a.back_splits[p] = s.hist[p];
  if (!ok) {  // (the keys above read owner per element, the thread that writes it here)
    for (int64_t i = tid; i < n; i += kThreads) a.owner[i] = -1;
  }
}

// Grid: each travelling row's metadata (NOTE [moe device transport]), after send_kernel.
__global__ void meta_kernel(plan::MoePlanSend a) {
  const int64_t k = a.k;
  const int64_t width = 2 + 2 * k;
  const int64_t rows = *a.send_total;
  for (int64_t q = grid_start(); q < rows * width; q += grid_stride()) {
    const int64_t r = q / width;
    const int64_t f = q % width;
    const int64_t t = a.send_tok[r];
    uint32_t bits = 0;
    if (f == 0) {
      bits = static_cast<uint32_t>(static_cast<int32_t>(t));
    } else if (f == 1) {
      bits = a.scales != nullptr ? __float_as_uint(a.scales[t]) : 0u;
    } else if (f < 2 + k) {
      const int64_t slot = t * k + (f - 2);
      const int64_t loc = a.owner[slot] == a.send_dest[r] ? a.local[slot] : -1;
      bits = static_cast<uint32_t>(static_cast<int32_t>(loc));
    } else {
      const int64_t slot = t * k + (f - 2 - k);
      bits = __float_as_uint(a.weights != nullptr ? a.weights[slot] : 1.0f);
    }
    store_u32(a.meta + r * a.meta_pitch + 4 * f, bits);
  }
}

// Grid: each received pair's key (its local expert, -1 for none) for the pairs of the rows
// received (the sum of the splits, which each block adds up).
__global__ void expert_keys_kernel(plan::MoePlanExpert a) {
  __shared__ long long warp_sum[kGridThreads / 32];
  long long t = 0;
  for (int64_t p = threadIdx.x; p < a.ranks; p += blockDim.x) t += a.recv_splits[p];
  for (int o = 16; o > 0; o >>= 1) t += __shfl_down_sync(kAll, t, o);
  if ((threadIdx.x & 31) == 0) warp_sum[threadIdx.x / 32] = t;
  __syncthreads();
  long long rows = 0;
  for (int w = 0; w < kGridThreads / 32; ++w) rows += warp_sum[w];
  const int64_t k = a.k;
  const int64_t n = min(static_cast<int64_t>(rows), a.recv_rows) * k;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const auto v =
        static_cast<int32_t>(load_u32(a.meta + (i / k) * a.meta_pitch + 4 * (2 + i % k)));
    a.keys[i] = v >= 0 && v < a.local_experts ? v : -1;
  }
}

__global__ void __launch_bounds__(kThreads) expert_kernel(plan::MoePlanExpert a) {
  extern __shared__ int sm[];
  const int P = static_cast<int>(a.ranks);
  const Sorter s(sm, static_cast<int>(a.local_experts));
  int* splits = s.end();
  int* start = splits + P;  // exclusive prefix of splits
  int* from = start + P;    // keyed pairs per source rank
  __shared__ int received;
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t k = a.k;
  const int64_t L = a.local_experts;
  for (int p = tid; p < P; p += kThreads) {
    splits[p] = static_cast<int>(a.recv_splits[p]);
    from[p] = 0;
  }
  __syncthreads();
  scan_keys(splits, start, P, &received);
  __syncthreads();
  const int64_t rows = min(static_cast<int64_t>(received), a.recv_rows);
  // torch's searchsorted(cumsum(splits), r, right=True), clamped: the rank whose rows hold r
  const auto src_rank = [&](int64_t r) -> int {
    int lo = 0;
    int hi = P;
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (start[mid] + splits[mid] <= r) {
        lo = mid + 1;
      } else {
        hi = mid;
      }
    }
    return min(lo, P - 1);
  };
  const auto key_of = [&](int64_t i) -> int { return a.keys[i]; };
  const auto emit = [&](int64_t i, int, int64_t g, int64_t arrival) {
    const int64_t r = i / k;
    const int p = src_rank(r);
    atomicAdd(&from[p], 1);
    if (g < a.capacity) {
      a.row_tok[g] = r;
      a.row_slot[g] = i % k;
      a.src[2 * g] = p;
    }
    if (arrival < a.capacity) a.back_rows[arrival] = g;
  };
  stable_sort(s, rows * k, key_of, emit);
  for (int64_t e = tid; e < L; e += kThreads) a.counts[e] = s.hist[e];
  for (int p = tid; p < P; p += kThreads) a.rows_from[p] = from[p];
  if (tid == 0) *a.row_total = *s.total;
}

// Grid, after expert_kernel: each grouped row's weight, source position and scale; past the
// rows in use, the zeros (and -1 sources) torch's plan gives.
__global__ void expert_fill_kernel(plan::MoePlanExpert a) {
  const int64_t k = a.k;
  const int64_t total = *a.row_total;
  for (int64_t g = grid_start(); g < a.capacity; g += grid_stride()) {
    a.row_keep[g] = g < total;
    if (g < total) {
      const unsigned char* m = a.meta + a.row_tok[g] * a.meta_pitch;
      a.row_w[g] = __uint_as_float(load_u32(m + 4 * (2 + k + a.row_slot[g])));
      a.src[2 * g + 1] = static_cast<int32_t>(load_u32(m));
      if (a.row_scales != nullptr) a.row_scales[g] = __uint_as_float(load_u32(m + 4));
    } else {
      a.row_tok[g] = 0;
      a.row_slot[g] = 0;
      a.row_w[g] = 0.0f;
      a.src[2 * g] = -1;
      a.src[2 * g + 1] = -1;
      if (a.row_scales != nullptr) a.row_scales[g] = 0.0f;
      a.back_rows[g] = 0;
    }
  }
}

template <class Kernel, class Args>
void launch(Kernel kernel, const Args& a, size_t smem, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    FASTCOMMS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
  }
  kernel<<<1, kThreads, smem, stream>>>(a);
  FASTCOMMS_CUDA_CHECK(cudaGetLastError());
}

// A grid kernel over at most `work` elements (nothing to launch for none).
template <class Kernel, class Args>
void launch_grid(Kernel kernel, const Args& a, int64_t work, cudaStream_t stream) {
  if (work <= 0) return;
  const int64_t blocks = std::min((work + kGridThreads - 1) / kGridThreads, kMaxGrid);
  kernel<<<static_cast<unsigned>(blocks), kGridThreads, 0, stream>>>(a);
  FASTCOMMS_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void moe_plan_home(const plan::MoePlanHome& a, cudaStream_t stream) {
  launch_grid(home_keys_kernel, a, a.tokens * a.k, stream);
  launch(home_kernel, a, Sorter::bytes(a.ranks), stream);
}

void moe_plan_send(const plan::MoePlanSend& a, cudaStream_t stream) {
  launch(send_kernel, a, Sorter::bytes(a.ranks), stream);
  launch_grid(meta_kernel, a, a.send_rows * (2 + 2 * a.k), stream);
}

void moe_plan_expert(const plan::MoePlanExpert& a, cudaStream_t stream) {
  launch_grid(expert_keys_kernel, a, a.recv_rows * a.k, stream);
  launch(expert_kernel, a, Sorter::bytes(a.local_experts) + sizeof(int) * 3 * a.ranks, stream);
  launch_grid(expert_fill_kernel, a, a.capacity, stream);
}

}  // namespace fastcomms::cuda
