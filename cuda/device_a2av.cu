// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The device all-to-all-v (NOTE [device all-to-all-v] in include/fastcomms/cuda/device_a2av.hpp).
#include <algorithm>
#include <climits>

#include "detail/copy_units.cuh"
#include "detail/sync.cuh"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/device_a2av.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::cuda {
namespace {

using namespace detail;

constexpr int kCountThreads = 256;
constexpr int kCopyThreads = 512;
constexpr int kUnroll = 4;
constexpr uint64_t kBadSends = kA2avBadSends;
constexpr uint64_t kBadRecvs = kA2avBadRecvs;
constexpr uint64_t kKeyBits = kA2avKeyBits;

__device__ __forceinline__ uint64_t ld_vol(const uint64_t* p) {
  return *reinterpret_cast<const volatile uint64_t*>(p);
}
__device__ __forceinline__ void st_vol(uint64_t* p, uint64_t v) {
  *reinterpret_cast<volatile uint64_t*>(p) = v;
}

// The first error since the host's last check wins; `ready` goes last (DeviceA2avError).
__device__ void flag(const DeviceA2avArgs& a, int code, int peer, int phase, int64_t expected,
                     int64_t got, int peer2 = -1) {
  if (atomicCAS(&a.error->code, 0, code) != 0) return;
  auto* e = reinterpret_cast<volatile DeviceA2avError*>(a.error);
  e->peer = peer;
  e->peer2 = peer2;
  e->phase = phase;
  e->expected = expected;
  e->got = got;
  __threadfence_system();
  e->ready = 1;
}

__device__ __forceinline__ uint64_t* count_slot(const DeviceA2avArgs& a, int owner, uint64_t e,
                                                int sender) {
  const int64_t half = static_cast<int64_t>(e & 1);
  return reinterpret_cast<uint64_t*>(a.peers[owner]) +
         (half * a.size + sender) * count_slot_words(a.size);
}
__device__ __forceinline__ uint64_t* done_slot(const DeviceA2avArgs& a, int owner, int sender) {
  return reinterpret_cast<uint64_t*>(a.peers[owner]) + count_pad_words(a.size) + sender;
}

// Waits until *p >= e (acquire). False on a timeout (flagged, group marked broken).
__device__ bool wait_for(const DeviceA2avArgs& a, const uint64_t* p, uint64_t e, int peer,
                         int phase) {
  const uint64_t start = now_ns();
  while (ld_acquire_sys(p) < e) {
    if (a.timeout_ns && now_ns() - start > a.timeout_ns) {
      flag(a, kA2avTimeout, peer, phase, static_cast<int64_t>(a.timeout_ms), 0);
      atomicExch(&a.state->broken, 1);
      *reinterpret_cast<volatile int*>(&a.error->timed_out) = 1;
      return false;
    }
  }
  return true;
}

// Checks `counts` (size of them) into `prefix`; false (flagged) on a negative count or a sum
// past `rows`.
__device__ bool check_counts(const DeviceA2avArgs& a, const int64_t* counts, int64_t rows,
                             bool send, int64_t* prefix) {
  int64_t sum = 0;
  bool ok = true;
  for (int q = 0; q < a.size; ++q) {
    const int64_t c = counts[q];
    prefix[q] = sum;
    if (c < 0) {
      if (ok) flag(a, send ? kA2avNegativeSend : kA2avNegativeRecv, q, 0, 0, c);
      ok = false;
      continue;
    }
    sum = c > LLONG_MAX - sum ? LLONG_MAX : sum + c;  // saturating: the message says how much
  }
  if (ok && sum > rows) {
    flag(a, send ? kA2avSendOverflow : kA2avRecvOverflow, a.rank, 0, rows, sum);
    ok = false;
  }
  return ok;
}

// Kernel 1 of NOTE [device all-to-all-v]: publish this rank's counts, gather everyone's, plan.
__global__ void __launch_bounds__(kCountThreads) counts_kernel(DeviceA2avArgs a) {
  extern __shared__ int64_t sh[];
  int64_t* sprefix = sh;                // [size] this rank's send offsets (rows)
  int64_t* oprefix = sh + a.size;       // [size] this rank's output offsets (rows)
  int64_t* overflow = sh + 2 * a.size;  // [size] 1 where rank q's staging would overflow
  __shared__ uint64_t e_sh;
  __shared__ int send_ok, recv_ok, copy, broken;
  const int P = a.size, r = a.rank;
  if (threadIdx.x == 0) {
    e_sh = ld_vol(&a.state->epoch) + 1;
    a.state->call = e_sh;
    broken = *reinterpret_cast<volatile int*>(&a.state->broken);
    send_ok = check_counts(a, a.send_counts, a.input_rows, true, sprefix) && !broken;
    recv_ok = check_counts(a, a.recv_counts, a.output_rows, false, oprefix) && !broken;
    copy = !broken;
  }
  __syncthreads();
  const uint64_t e = e_sh;
  // Publish: counts (zeros where rejected), key, then the flag with release semantics.
  const uint64_t key =
      static_cast<uint64_t>(a.row_bytes) | (send_ok ? 0 : kBadSends) | (recv_ok ? 0 : kBadRecvs);
  for (int q = threadIdx.x; q < P; q += blockDim.x) {
    uint64_t* slot = count_slot(a, q, e, r);
    for (int j = 0; j < P; ++j) {
      st_vol(slot + 2 + j, send_ok ? static_cast<uint64_t>(a.send_counts[j]) : 0);
      st_vol(slot + 2 + P + j, recv_ok ? static_cast<uint64_t>(a.recv_counts[j]) : 0);
    }
    st_vol(slot + 1, key);
    __threadfence_system();
    st_release_sys(slot, e);
  }
  // Gather: every peer's slot of this call (a broken group waits for nobody).
  if (!broken) {
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      if (p != r && !wait_for(a, count_slot(a, r, e, p), e, p, 1)) atomicExch(&copy, 0);
    }
  }
  __syncthreads();
  auto key_of = [&](int p) { return ld_vol(count_slot(a, r, e, p) + 1); };  // a peer's key
  // Every rank reads the same slots, so every verdict below is the same everywhere.
  if (copy) {
    for (int p = threadIdx.x; p < P; p += blockDim.x) {
      const uint64_t k = key_of(p);
      const int64_t rb = static_cast<int64_t>(k & ~kKeyBits);
      if (rb != a.row_bytes) {
        flag(a, kA2avRowMismatch, p, 1, a.row_bytes, rb);
        atomicExch(&copy, 0);
      }
      if (p == r) continue;  // this rank flagged its own vectors above, with the numbers
      if (k & kBadSends) flag(a, kA2avPeerBadCounts, p, 1, 0, 0);
      if (k & kBadRecvs) flag(a, kA2avPeerBadCounts, p, 2, 0, 0);
    }
  }
  __syncthreads();
  const int64_t rb = a.row_bytes;
  const int64_t cap_rows = rb > 0 ? a.staging_bytes / rb : LLONG_MAX;
  const A2avCounts c{count_slot(a, r, e, 0), P};
  // Per receiver q: the pairs that disagree, and whether q's staging would overflow (then it
  // gets nothing from anyone).
  for (int q = threadIdx.x; q < P; q += blockDim.x) {
    const int64_t total = a2av_incoming_rows(c, q);
    if (copy && !(c.key(q) & kBadRecvs)) {
      for (int p = 0; p < P; ++p) {
        if (!(c.key(p) & kBadSends) && c.expected(q, p) != c.sent(p, q))
          flag(a, kA2avCountMismatch, q, 1, c.expected(q, p), c.sent(p, q), p);
      }
    }
    overflow[q] = copy && total > cap_rows;
    if (overflow[q]) {
      const int64_t bytes = rb > 0 && total > LLONG_MAX / rb ? LLONG_MAX : total * rb;
      flag(a, kA2avStagingOverflow, q, 1, a.staging_bytes, bytes);
    }
  }
  __syncthreads();
  A2avSelf me;
  me.rank = r;
  me.row_bytes = rb;
  me.output_rows = a.output_rows;
  me.send_prefix = sprefix;
  me.out_prefix = oprefix;
  me.recv_counts = a.recv_counts;
  me.recv_ok = recv_ok;
  me.copy = copy;
  for (int q = threadIdx.x; q < P; q += blockDim.x)
    a.plan[q] = a2av_peer_plan(c, me, q, overflow[q], overflow[r]);
  if (threadIdx.x == 0) a.state->copy = copy;
}

template <typename V>
__device__ __forceinline__ void copy_units(V* dst, const V* src, int64_t n, int64_t tid,
                                           int64_t threads) {
  int64_t i = tid;
  for (; i + (kUnroll - 1) * threads < n; i += kUnroll * threads) {
    V v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) v[k] = src[i + k * threads];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dst[i + k * threads] = v[k];
  }
  for (; i < n; i += threads) dst[i] = src[i];
}

// NOTE [indexed push]: `n` units of whole rows, logical row i (from `row0`) read from input row
// index[row0 + i]; an index outside [0, src_rows) gives a zero row.
template <typename V>
__device__ __forceinline__ void copy_indexed(V* dst, const V* input, const int64_t* index,
                                             int64_t src_rows, int64_t row0, int64_t per_row,
                                             int64_t n, int64_t tid, int64_t threads) {
  for (int64_t i = tid; i < n; i += threads) {
    const int64_t r = i / per_row;
    const int64_t j = index[row0 + r];
    dst[i] = j >= 0 && j < src_rows ? input[j * per_row + (i - r * per_row)] : V{};
  }
}

// Kernel 2: rows into peers' staging (and own rows into the output), then the done flags.
template <typename V>
__global__ void __launch_bounds__(kCopyThreads) push_kernel(DeviceA2avArgs a) {
  const int P = a.size, r = a.rank;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t staging = staging_offset(P);
  for (int j = 1; j <= P; ++j) {  // peers first, this rank's own rows last
    const int q = (r + j) % P;
    const DeviceA2avPeerPlan pl = a.plan[q];
    if (pl.send_bytes <= 0) continue;
    char* dst = (q == r ? a.output : a.peers[q] + staging) + pl.send_dst;
    const int64_t units = pl.send_bytes / static_cast<int64_t>(sizeof(V));
    if (a.input_index != nullptr) {
      copy_indexed(reinterpret_cast<V*>(dst), reinterpret_cast<const V*>(a.input), a.input_index,
                   a.input_src_rows, pl.send_src / a.row_bytes,
                   a.row_bytes / static_cast<int64_t>(sizeof(V)), units, tid, threads);
    } else {
      copy_units(reinterpret_cast<V*>(dst), reinterpret_cast<const V*>(a.input + pl.send_src),
                 units, tid, threads);
    }
  }
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // this block's stores before the count (read by the last block)
    last = atomicAdd(&a.state->done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  if (threadIdx.x == 0) a.state->done = 0;
  const uint64_t e = ld_vol(&a.state->call);
  for (int q = threadIdx.x; q < P; q += blockDim.x) {
    if (q == r) continue;
    __threadfence_system();  // every block's stores (through the count) before the flag
    st_release_sys(done_slot(a, q, r), e);
  }
}

// Kernel 3: every peer's done flag of this call, then the epoch advances.
__global__ void __launch_bounds__(kCountThreads) wait_kernel(DeviceA2avArgs a) {
  const uint64_t e = ld_vol(&a.state->call);
  if (!*reinterpret_cast<volatile int*>(&a.state->broken)) {
    for (int p = threadIdx.x; p < a.size; p += blockDim.x)
      if (p != a.rank && !wait_for(a, done_slot(a, a.rank, p), e, p, 2)) a.state->copy = 0;
  }
  __syncthreads();
  if (threadIdx.x == 0) st_vol(&a.state->epoch, e);
}

// Kernel 4: peers' rows from this rank's staging into the output.
template <typename V>
__global__ void __launch_bounds__(kCopyThreads) copy_out_kernel(DeviceA2avArgs a) {
  if (!*reinterpret_cast<volatile int*>(&a.state->copy)) return;
  const int P = a.size, r = a.rank;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const char* staging = a.peers[r] + staging_offset(P);
  for (int j = 1; j < P; ++j) {
    const int p = (r + j) % P;
    const DeviceA2avPeerPlan pl = a.plan[p];
    if (pl.recv_bytes <= 0) continue;
    copy_units(reinterpret_cast<V*>(a.output + pl.recv_dst),
               reinterpret_cast<const V*>(staging + pl.recv_src),
               pl.recv_bytes / static_cast<int64_t>(sizeof(V)), tid, threads);
  }
}

template <typename V>
void launch_copies(const DeviceA2avArgs& a, int max_blocks, cudaStream_t stream) {
  const int sms = sm_count() > 0 ? sm_count() : 1;
  const int cap = max_blocks > 0 ? max_blocks : sms;
  const int64_t per_block = int64_t{kCopyThreads} * kUnroll * static_cast<int64_t>(sizeof(V));
  auto blocks = [&](int64_t bytes) {
    return static_cast<unsigned>(std::clamp<int64_t>((bytes + per_block - 1) / per_block, 1, cap));
  };
  push_kernel<V><<<blocks(a.input_rows * a.row_bytes), kCopyThreads, 0, stream>>>(a);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
  wait_kernel<<<1, kCountThreads, 0, stream>>>(a);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
  copy_out_kernel<V><<<blocks(a.output_rows * a.row_bytes), kCopyThreads, 0, stream>>>(a);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

}  // namespace

void device_a2av_async(const DeviceA2avArgs& a, int max_blocks, cudaStream_t stream) {
  FASTCOMMS_CHECK(a.size >= 1 && a.size <= 1024 && a.peers && a.state && a.plan && a.error &&
                      a.send_counts && a.recv_counts,
                  kInternal, "device_a2av_async: a group of ", a.size,
                  " ranks (at most 1024), every pointer set");
  const size_t shared = sizeof(int64_t) * 3 * static_cast<size_t>(a.size);
  counts_kernel<<<1, kCountThreads, shared, stream>>>(a);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
  switch (a.vector_bytes) {
    case 16:
      return launch_copies<uint4>(a, max_blocks, stream);
    case 8:
      return launch_copies<uint2>(a, max_blocks, stream);
    case 4:
      return launch_copies<uint32_t>(a, max_blocks, stream);
    case 2:
      return launch_copies<uint16_t>(a, max_blocks, stream);
    default:
      return launch_copies<uint8_t>(a, max_blocks, stream);
  }
}

}  // namespace fastcomms::cuda
