// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The MoE routing-plan kernels (fastcomms/cuda/moe_plan.hpp; NOTE [moe plan kernels] in
// include/fastcomms/plan/moe_plan.hpp). Each step: grid kernels for the work per element, and a
// stable counting sort in three kernels (count per block, scan in one block, place per block)
// whose order within a key is the flat order of the elements (torch's stable argsort). A step's
// sort reads its keys from its scratch (moe_plan_scratch): [4 words][keys: n][per-block counts:
// (K + 1) x B, key-major, the last row the keyed elements][per-key counts: K, then the total].
#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>

#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/moe_plan.hpp"

namespace fastcomms::cuda {
namespace {

constexpr int kThreads = static_cast<int>(plan::kMoeSortTile);  // a sort block: one tile
constexpr int kWarps = kThreads / 32;
constexpr unsigned kAll = 0xffffffffu;
constexpr int64_t kH = plan::kMoeHeader;
constexpr int kGridThreads = 256;
constexpr int64_t kMaxGrid = 2048;

__device__ __forceinline__ int64_t grid_start() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_stride() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
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

// The sort's view of a step's scratch.
struct Sort {
  int K = 0;                            // keys
  int64_t B = 0;                        // blocks (tiles of kThreads elements)
  int32_t* keys = nullptr;              // (n) key of each element, -1: not sorted
  int32_t* counts = nullptr;            // ((K + 1) x B): counts, then (after the scan) starts
  int32_t* hist = nullptr;              // (K + 1): per-key counts, then the total
  unsigned long long* words = nullptr;  // the 4 leading words as 2 x 64 bits
};

Sort sort_of(int32_t* scratch, int64_t n, int64_t K) {
  Sort s;
  s.K = static_cast<int>(K);
  s.B = plan::moe_sort_blocks(n);
  s.words = reinterpret_cast<unsigned long long*>(scratch);
  s.keys = scratch + 4;
  s.counts = s.keys + n;
  s.hist = s.counts + (K + 1) * s.B;
  return s;
}

// An exclusive scan of one value per thread over the block; *total gets the sum. Every thread
// of the block calls it (it syncs).
__device__ int block_scan(int v, int* total) {
  __shared__ int warp_sum[kWarps];
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int warp = static_cast<int>(threadIdx.x >> 5);
  int inc = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(kAll, inc, o);
    if (lane >= o) inc += u;
  }
  if (lane == 31) warp_sum[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    const int w = lane < static_cast<int>(blockDim.x >> 5) ? warp_sum[lane] : 0;
    int winc = w;
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(kAll, winc, o);
      if (lane >= o) winc += u;
    }
    warp_sum[lane] = winc - w;  // exclusive
    if (lane == 31) *total = winc;
  }
  __syncthreads();
  const int ex = warp_sum[warp] + inc - v;
  __syncthreads();  // (warp_sum reused by the next call)
  return ex;
}

// In place: a[i] = the sum of a[j < i], over len values; returns the sum. One block.
__device__ int scan_array(int32_t* a, int64_t len) {
  __shared__ int tot;
  int carry = 0;
  for (int64_t c = 0; c < len; c += blockDim.x) {
    const int64_t i = c + threadIdx.x;
    const int v = i < len ? a[i] : 0;
    const int ex = block_scan(v, &tot);
    if (i < len) a[i] = carry + ex;
    carry += tot;
    __syncthreads();
  }
  return carry;
}

// Phase 1 (grid of B blocks): each block's count of each key in its tile, and of keyed elements.
template <class Step>
__global__ void __launch_bounds__(kThreads) sort_count(Step st) {
  extern __shared__ int sm[];
  const Sort& s = st.sort;
  const int64_t n = st.elements();
  for (int e = static_cast<int>(threadIdx.x); e <= s.K; e += kThreads) sm[e] = 0;
  __syncthreads();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int e = i < n ? s.keys[i] : -1;
  if (e >= 0) atomicAdd(&sm[e], 1);
  const unsigned keyed = __ballot_sync(kAll, e >= 0);
  if ((threadIdx.x & 31) == 0 && keyed != 0) atomicAdd(&sm[s.K], __popc(keyed));
  __syncthreads();
  for (int e2 = static_cast<int>(threadIdx.x); e2 <= s.K; e2 += kThreads) {
    s.counts[e2 * s.B + blockIdx.x] = sm[e2];
  }
}

// Phase 2 (one block): the counts scanned into starts (keys in order, each key's blocks in
// order; the keyed row on its own), the per-key counts; then the step's own finish.
template <class Step>
__global__ void __launch_bounds__(kThreads) sort_scan(Step st) {
  const Sort& s = st.sort;
  const int total = scan_array(s.counts, static_cast<int64_t>(s.K) * s.B);
  scan_array(s.counts + static_cast<int64_t>(s.K) * s.B, s.B);
  for (int e = static_cast<int>(threadIdx.x); e < s.K; e += kThreads) {
    const int start = s.B > 0 ? s.counts[e * s.B] : 0;
    const int next = e + 1 < s.K && s.B > 0 ? s.counts[(e + 1) * s.B] : total;
    s.hist[e] = next - start;
  }
  if (threadIdx.x == 0) s.hist[s.K] = total;
  __syncthreads();
  st.finish(s.hist, total);
}

// Phase 3 (grid of B blocks): each keyed element's place (its key's start for this block + the
// equal keys before it in the tile) and arrival (the keyed elements before it), to the step.
template <class Step>
__global__ void __launch_bounds__(kThreads) sort_place(Step st) {
  extern __shared__ int sm[];
  const Sort& s = st.sort;
  int* wcnt = sm;                 // (kWarps x K) each warp's count of each key
  int* wk = wcnt + kWarps * s.K;  // (kWarps) each warp's keyed elements
  int* extra = wk + kWarps;       // the step's
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid & 31;
  const int warp = tid >> 5;
  for (int e = tid; e < kWarps * s.K; e += kThreads) wcnt[e] = 0;
  st.block_init(extra);
  __syncthreads();
  const int64_t n = st.elements();
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + tid;
  const int e = i < n ? s.keys[i] : -1;
  const unsigned peers = __match_any_sync(kAll, e);
  const unsigned keyed = __ballot_sync(kAll, e >= 0);
  const unsigned lt = (1u << lane) - 1u;
  const int rank = __popc(peers & lt);
  if (e >= 0 && rank == 0) wcnt[warp * s.K + e] = __popc(peers);
  if (lane == 0) wk[warp] = __popc(keyed);
  __syncthreads();
  if (e >= 0) {
    int pre = 0;
    int apre = 0;
    for (int w = 0; w < warp; ++w) {
      pre += wcnt[w * s.K + e];
      apre += wk[w];
    }
    const int64_t place = s.counts[e * s.B + blockIdx.x] + pre + rank;
    const int64_t arrival =
        s.counts[static_cast<int64_t>(s.K) * s.B + blockIdx.x] + apre + __popc(keyed & lt);
    st.emit(i, e, place, arrival, extra);
  }
  __syncthreads();
  st.block_finish(extra);
}

template <class Kernel>
void allow_smem(Kernel kernel, size_t smem) {
  if (smem > 48 * 1024) {
    FASTCOMMS_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                              static_cast<int>(smem)));
  }
}

// The three kernels of a step's sort.
template <class Step>
void run_sort(const Step& st, size_t extra_ints, cudaStream_t stream) {
  const Sort& s = st.sort;
  if (s.B > 0) {
    sort_count<Step><<<static_cast<unsigned>(s.B), kThreads, sizeof(int) * (s.K + 1), stream>>>(st);
    FASTCOMMS_CUDA_CHECK(cudaGetLastError());
  }
  sort_scan<Step><<<1, kThreads, 0, stream>>>(st);
  FASTCOMMS_CUDA_CHECK(cudaGetLastError());
  if (s.B > 0) {
    const size_t smem = sizeof(int) * (static_cast<size_t>(kWarps) * s.K + kWarps + extra_ints);
    allow_smem(sort_place<Step>, smem);
    sort_place<Step><<<static_cast<unsigned>(s.B), kThreads, smem, stream>>>(st);
    FASTCOMMS_CUDA_CHECK(cudaGetLastError());
  }
}

// A grid kernel over at most `work` elements (nothing to launch for none).
template <class Kernel, class Args>
void launch_grid(Kernel kernel, const Args& a, int64_t work, cudaStream_t stream) {
  if (work <= 0) return;
  const int64_t blocks = std::min((work + kGridThreads - 1) / kGridThreads, kMaxGrid);
  kernel<<<static_cast<unsigned>(blocks), kGridThreads, 0, stream>>>(a);
  FASTCOMMS_CUDA_CHECK(cudaGetLastError());
}

// -- home: the verdict, the packed rows to send, the header ------------------------------------
struct HomeStep {
  plan::MoePlanHome a;
  Sort sort;
  __device__ int64_t elements() const { return a.tokens * a.k; }
  // words[0]: the first slot out of range; words[1]: (token << 32) | expert of the first token
  // naming an expert twice, its smallest such expert
  __device__ void finish(const int32_t* hist, int) const {
    const unsigned long long first_bad = sort.words[0];
    const unsigned long long dup = sort.words[1];
    long long status = a.tokens > a.max_tokens ? a.overflow_bit : 0;
    long long bad = 0;
    long long where = -1;
    if (first_bad != ULLONG_MAX) {
      status |= a.bad_expert_bit;
      bad = a.idx[first_bad];
      where = static_cast<long long>(first_bad / a.k);
    } else if (dup != ULLONG_MAX) {
      status |= a.duplicate_bit;
      bad = static_cast<long long>(dup & 0xffffffffULL);
      where = static_cast<long long>(dup >> 32);
    }
    for (int64_t p = threadIdx.x; p < a.ranks; p += blockDim.x) {
      int64_t* h = a.head + p * kH;
      h[0] = hist[p];
      h[1] = status;
      h[2] = a.tokens;
      h[3] = bad;
      h[4] = where;
    }
  }
  __device__ void block_init(int*) const {}
  __device__ void emit(int64_t i, int p, int64_t place, int64_t, int*) const {
    a.send_tok[place] = i / a.k;
    a.send_dest[place] = p;
  }
  // the send rows past those in use (within this block's stretch): zeros, as torch's plan
  __device__ void block_finish(int*) const {
    const int64_t total = sort.hist[sort.K];
    const int64_t lo = max(total, static_cast<int64_t>(blockIdx.x) * kThreads);
    const int64_t hi = min(a.send_rows, static_cast<int64_t>(blockIdx.x + 1) * kThreads);
    for (int64_t r = lo + threadIdx.x; r < hi; r += kThreads) {
      a.send_tok[r] = 0;
      a.send_dest[r] = 0;
    }
  }
};

// Grid: each slot's owner, local expert, key (the rank it is sent to; -1: dropped, or an earlier
// slot of its token goes to that rank) and its part of the verdict.
__global__ void home_keys_kernel(HomeStep st) {
  const plan::MoePlanHome& a = st.a;
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
    if (v < -1 || v >= E) atomicMin(&st.sort.words[0], static_cast<unsigned long long>(i));
    bool dup = false;
    bool sent = valid;
    for (int64_t j = i - i % k; j < i; ++j) {
      const int64_t u = a.idx[j];
      dup = dup || (valid && u == v);
      if (u >= 0 && u < E && u / L == p) sent = false;
    }
    if (dup) {
      atomicMin(&st.sort.words[1], (static_cast<unsigned long long>(i / k) << 32) |
                                       static_cast<unsigned long long>(v));
    }
    st.sort.keys[i] = sent ? static_cast<int32_t>(p) : -1;
  }
}

// -- send: every rank's verdict, the splits, the returning slots' places, the metadata ---------
struct SendStep {
  plan::MoePlanSend a;
  Sort sort;
  __device__ int64_t elements() const { return a.tokens * a.k; }
  __device__ void finish(const int32_t* hist, int) const {
    for (int64_t p = threadIdx.x; p < a.ranks; p += blockDim.x) a.back_splits[p] = hist[p];
  }
  __device__ void block_init(int*) const {}
  __device__ void emit(int64_t i, int, int64_t place, int64_t, int*) const {
    a.slot_src[i] = place;
  }
  __device__ void block_finish(int*) const {}
};

// One block: whether every rank accepted (words[0]), the first refusal into flags, the splits.
__global__ void send_verdict_kernel(SendStep st) {
  const plan::MoePlanSend& a = st.a;
  const int64_t P = a.ranks;
  __shared__ int ok_s;
  if (threadIdx.x == 0) {
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
    *a.send_total = rows;
    st.sort.words[0] = static_cast<unsigned long long>(ok);
    ok_s = ok;
  }
  __syncthreads();
  for (int64_t p = threadIdx.x; p < P; p += blockDim.x) {
    a.send_splits[p] = ok_s != 0 ? a.head[p * kH] : 0;
    a.recv_splits[p] = ok_s != 0 ? a.got[p * kH] : 0;
  }
}

// Grid: each slot's key (its owner rank, by which the slots return; -1 for none or when a rank
// refused, when the owners are cleared too) and no returning row yet.
__global__ void send_keys_kernel(SendStep st) {
  const plan::MoePlanSend& a = st.a;
  const bool ok = st.sort.words[0] != 0;
  const int64_t n = a.tokens * a.k;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    st.sort.keys[i] = ok ? static_cast<int32_t>(a.owner[i]) : -1;
    if (!ok) a.owner[i] = -1;
    a.slot_src[i] = -1;
  }
}

// Grid: each travelling row's metadata (NOTE [moe device transport]).
__global__ void meta_kernel(SendStep st) {
  const plan::MoePlanSend& a = st.a;
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

// -- expert: the grouped order from the received metadata ---------------------------------------
// The rows received: the splits' sum (each block adds them up), at most R. Every thread calls it.
__device__ int64_t received_rows(const plan::MoePlanExpert& a) {
  __shared__ long long part[kWarps];
  __shared__ long long sum;
  long long t = 0;
  for (int64_t p = threadIdx.x; p < a.ranks; p += blockDim.x) t += a.recv_splits[p];
  for (int o = 16; o > 0; o >>= 1) t += __shfl_down_sync(kAll, t, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = t;
  __syncthreads();
  if (threadIdx.x == 0) {
    long long all = 0;
    for (unsigned w = 0; w < (blockDim.x + 31) / 32; ++w) all += part[w];
    sum = all;
  }
  __syncthreads();
  return min(static_cast<int64_t>(sum), a.recv_rows);
}

struct ExpertStep {
  plan::MoePlanExpert a;
  Sort sort;
  // (every thread of a block calls it: it syncs)
  __device__ int64_t elements() const { return received_rows(a) * a.k; }
  __device__ void finish(const int32_t* hist, int total) const {
    for (int64_t e = threadIdx.x; e < a.local_experts; e += blockDim.x) a.counts[e] = hist[e];
    for (int64_t p = threadIdx.x; p < a.ranks; p += blockDim.x) a.rows_from[p] = 0;
    if (threadIdx.x == 0) *a.row_total = total;
  }
  // extra: splits (P), their exclusive prefix (P), the keyed pairs of this block per source rank
  __device__ void block_init(int* extra) const {
    const int P = static_cast<int>(a.ranks);
    int* splits = extra;
    int* start = extra + P;
    int* from = extra + 2 * P;
    __shared__ int total;
    for (int p = static_cast<int>(threadIdx.x); p < P; p += kThreads) {
      splits[p] = static_cast<int>(a.recv_splits[p]);
      from[p] = 0;
    }
    __syncthreads();
    for (int c = 0; c < P; c += kThreads) {
      const int p = c + static_cast<int>(threadIdx.x);
      const int v = p < P ? splits[p] : 0;
      const int ex = block_scan(v, &total);
      if (p < P) start[p] = ex + (c > 0 ? start[c - 1] + splits[c - 1] : 0);
      __syncthreads();
    }
  }
  // torch's searchsorted(cumsum(splits), r, right=True), clamped: the rank whose rows hold r
  __device__ int src_rank(int64_t r, const int* extra) const {
    const int P = static_cast<int>(a.ranks);
    const int* splits = extra;
    const int* start = extra + P;
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
  }
  __device__ void emit(int64_t i, int, int64_t g, int64_t arrival, int* extra) const {
    const int64_t r = i / a.k;
    const int p = src_rank(r, extra);
    atomicAdd(&extra[2 * a.ranks + p], 1);
    if (g < a.capacity) {
      a.row_tok[g] = r;
      a.row_slot[g] = i % a.k;
      a.src[2 * g] = p;
    }
    if (arrival < a.capacity) a.back_rows[arrival] = g;
  }
  __device__ void block_finish(int* extra) const {
    const int* from = extra + 2 * a.ranks;
    for (int64_t p = threadIdx.x; p < a.ranks; p += kThreads) {
      if (from[p] != 0) {
        atomicAdd(reinterpret_cast<unsigned long long*>(a.rows_from + p),
                  static_cast<unsigned long long>(from[p]));
      }
    }
  }
};

// Grid: each received pair's key (its local expert, -1 for none), for the rows received.
__global__ void __launch_bounds__(kThreads) expert_keys_kernel(ExpertStep st) {
  const plan::MoePlanExpert& a = st.a;
  const int64_t n = st.elements();
  const int64_t k = a.k;
  for (int64_t i = grid_start(); i < n; i += grid_stride()) {
    const auto v =
        static_cast<int32_t>(load_u32(a.meta + (i / k) * a.meta_pitch + 4 * (2 + i % k)));
    st.sort.keys[i] = v >= 0 && v < a.local_experts ? v : -1;
  }
}

// Grid: each grouped row's weight, source position and scale; past the rows in use, the zeros
// (and -1 sources) torch's plan gives.
__global__ void expert_fill_kernel(ExpertStep st) {
  const plan::MoePlanExpert& a = st.a;
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

}  // namespace

void moe_plan_home(const plan::MoePlanHome& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.k;
  HomeStep st{a, sort_of(a.scratch, n, a.ranks)};
  // the verdict's two words start at "none"
  FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(st.sort.words, 0xff, 2 * sizeof(uint64_t), stream));
  launch_grid(home_keys_kernel, st, n, stream);
  run_sort(st, 0, stream);
}

void moe_plan_send(const plan::MoePlanSend& a, cudaStream_t stream) {
  const int64_t n = a.tokens * a.k;
  SendStep st{a, sort_of(a.scratch, n, a.ranks)};
  send_verdict_kernel<<<1, kGridThreads, 0, stream>>>(st);
  FASTCOMMS_CUDA_CHECK(cudaGetLastError());
  launch_grid(send_keys_kernel, st, n, stream);
  run_sort(st, 0, stream);
  launch_grid(meta_kernel, st, a.send_rows * (2 + 2 * a.k), stream);
}

void moe_plan_expert(const plan::MoePlanExpert& a, cudaStream_t stream) {
  const int64_t n = a.recv_rows * a.k;
  ExpertStep st{a, sort_of(a.scratch, n, a.local_experts)};
  if (n > 0) {
    expert_keys_kernel<<<static_cast<unsigned>(std::min((n + kThreads - 1) / kThreads, kMaxGrid)),
                         kThreads, 0, stream>>>(st);
    FASTCOMMS_CUDA_CHECK(cudaGetLastError());
  }
  run_sort(st, static_cast<size_t>(3 * a.ranks), stream);
  launch_grid(expert_fill_kernel, st, a.capacity, stream);
}

}  // namespace fastcomms::cuda
