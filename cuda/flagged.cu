// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The flagged small-message push (NOTE [flagged push] in include/fastcomms/cuda/barrier.hpp).
#include <algorithm>

#include "detail/copy_units.cuh"
#include "detail/sync.cuh"
#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/copy.hpp"

namespace fastcomms::cuda {
namespace {

using namespace detail;

struct FlaggedBatch {
  CopyJob jobs[kJobsPerLaunch];  // sends first, then receives
  int peer[kJobsPerLaunch];
  int sends;
  int count;
};
static_assert(sizeof(FlaggedBatch) + sizeof(FlaggedPushArgs) <= 4000, "kernel parameter space");

__device__ __forceinline__ int64_t words_of(const plan::CopyDesc& c) {
  return c.width / 8 * c.height * c.depth;
}

// Byte offset of 8-byte word `w` of a descriptor, on its source or destination side.
__device__ __forceinline__ int64_t word_offset(const plan::CopyDesc& c, int64_t w, bool dst) {
  const int64_t per_row = c.width / 8;
  const int64_t row = w / per_row, col = (w - row * per_row) * 8;
  const int64_t z = row / c.height, y = row - z * c.height;
  return dst ? c.dst_offset + z * c.dst_slice_pitch + y * c.dst_pitch + col
             : c.src_offset + z * c.src_slice_pitch + y * c.src_pitch + col;
}

__device__ __forceinline__ uint2 load8(const unsigned char* p, bool aligned) {
  if (aligned) return *reinterpret_cast<const uint2*>(p);
  uint2 v;
  unsigned char* b = reinterpret_cast<unsigned char*>(&v);
  for (int i = 0; i < 8; ++i) b[i] = p[i];
  return v;
}

__device__ __forceinline__ void store8(unsigned char* p, uint2 v, bool aligned) {
  if (aligned) {
    *reinterpret_cast<uint2*>(p) = v;
    return;
  }
  const unsigned char* b = reinterpret_cast<const unsigned char*>(&v);
  for (int i = 0; i < 8; ++i) p[i] = b[i];
}

// Spins until both flags of line `p` read `flag`. False when this rank gave up: the skip word
// was set (an error elsewhere in this call) or the wait outlived the timeout (then this thread
// sets the error and the skip word, so the others stop too).
__device__ bool wait_line(const uint4* p, uint32_t flag, const FlaggedPushArgs& a, uint4& v) {
  uint64_t start = 0;
  for (int spins = 0;; ++spins) {
    v = ld_line(p);
    if (v.y == flag && v.w == flag) return true;
    if ((spins & 1023) == 1023) {
      if (*reinterpret_cast<volatile int*>(a.skip)) return false;
      if (a.timeout_ns) {
        const uint64_t now = now_ns();
        if (start == 0) {
          start = now;
        } else if (now - start > a.timeout_ns) {
          atomicExch(a.error, kBarrierTimeout);
          atomicExch(a.skip, 1);
          return false;
        }
      }
    }
  }
}

__device__ __forceinline__ bool aligned8(const void* base, const plan::CopyDesc& c, bool dst) {
  const uint64_t bits = reinterpret_cast<uintptr_t>(base) |
                        static_cast<uint64_t>(dst ? c.dst_offset : c.src_offset) |
                        static_cast<uint64_t>(dst ? c.dst_pitch : c.src_pitch) |
                        static_cast<uint64_t>(dst ? c.dst_slice_pitch : c.src_slice_pitch);
  return (bits & 7) == 0;
}

__global__ void __launch_bounds__(kThreads)
    flagged_push_kernel(FlaggedPushArgs a, FlaggedBatch batch) {
  const uint64_t e = call_epoch_of(a.epoch);
  const uint32_t flag = static_cast<uint32_t>(e);
  const int64_t half = static_cast<int64_t>(e & 1);
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  __shared__ int ok;
  __shared__ int last;
  if (threadIdx.x == 0) ok = *reinterpret_cast<volatile int*>(a.skip) == 0;
  __syncthreads();
  const bool receive = ok;

  // Sends: the header and every 8-byte word of each put, each as one flagged line.
  for (int j = 0; j < batch.sends; ++j) {
    const CopyJob& job = batch.jobs[j];
    const int q = batch.peer[j];
    if (q == a.rank) {  // the local share goes straight into the output
      if (receive) {
        const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
        copy_job(job, warp, static_cast<int64_t>(gridDim.x) * kWarps);
      }
      continue;
    }
    uint4* slot = a.peers[q] + (half * a.size + a.rank) * a.slot_lines;
    if (tid == 0)
      st_line(slot, static_cast<uint32_t>(a.key), static_cast<uint32_t>(a.key >> 32), flag);
    const int64_t words = words_of(job.desc);
    const auto* src = static_cast<const unsigned char*>(job.src);
    const bool al = aligned8(job.src, job.desc, false);
    for (int64_t w = tid; w < words; w += threads) {
      const uint2 v = load8(src + word_offset(job.desc, w, false), al);
      st_line(slot + 1 + w, v.x, v.y, flag);
    }
  }

  // Receives: each peer's header, then its words into the output.
  for (int j = batch.sends; j < batch.count && receive; ++j) {
    const CopyJob& job = batch.jobs[j];
    const uint4* slot = a.local + (half * a.size + batch.peer[j]) * a.slot_lines;
    __syncthreads();
    if (threadIdx.x == 0) {
      uint4 h;
      if (!wait_line(slot, flag, a, h)) {
        ok = 0;
      } else if ((static_cast<uint64_t>(h.z) << 32 | h.x) != a.key) {
        atomicExch(a.error, kBarrierMismatch);
        atomicExch(a.skip, 1);
        ok = 0;
      }
    }
    __syncthreads();
    if (!ok) break;
    const int64_t words = words_of(job.desc);
    auto* dst = static_cast<unsigned char*>(job.dst);
    const bool al = aligned8(job.dst, job.desc, true);
    for (int64_t w = tid; w < words; w += threads) {
      uint4 v;
      if (!wait_line(slot + 1 + w, flag, a, v)) break;
      store8(dst + word_offset(job.desc, w, true), make_uint2(v.x, v.z), al);
    }
  }

  // The last block to finish advances the device epoch (every block read it before counting).
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(a.done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (last && threadIdx.x == 0) {
    *a.done = 0;
    *a.epoch = e;
  }
}

}  // namespace

void flagged_push_async(const FlaggedPushArgs& args, const CopyJob* sends, const int* send_peer,
                        int send_count, const CopyJob* recvs, const int* recv_peer, int recv_count,
                        cudaStream_t stream) {
  FASTCOMMS_CHECK(send_count + recv_count <= kJobsPerLaunch && args.epoch && args.done &&
                      args.local && args.peers && args.skip && args.error && args.slot_lines > 1,
                  kInternal, "flagged_push_async: ", send_count + recv_count, " jobs (at most ",
                  kJobsPerLaunch, "), every pointer set");
  FlaggedBatch batch{};
  batch.sends = send_count;
  batch.count = send_count + recv_count;
  int64_t lines = 0, recv_lines = 0;
  for (int i = 0; i < batch.count; ++i) {
    const bool send = i < send_count;
    const CopyJob& j = send ? sends[i] : recvs[i - send_count];
    const int peer = send ? send_peer[i] : recv_peer[i - send_count];
    FASTCOMMS_CHECK(j.desc.width % 8 == 0 && j.desc.bytes() / 8 < args.slot_lines, kInternal,
                    "flagged_push_async: a put of ", j.desc.bytes(), " bytes (rows of ",
                    j.desc.width, ") does not fit ", args.slot_lines - 1, " flagged lines");
    batch.jobs[i] = j;
    batch.peer[i] = peer;
    (send ? lines : recv_lines) += j.desc.bytes() / 8;
  }
  const int sms = sm_count() > 0 ? sm_count() : 1;
  int cap = args.max_blocks > 0 ? std::min(args.max_blocks, sms) : sms;
  if (args.gpu_grids > 1) {  // NOTE [shared GPU residency]
    static const int per_sm = blocks_per_sm(reinterpret_cast<const void*>(flagged_push_kernel));
    cap = std::min(cap, resident_share(per_sm, sms, args.gpu_grids));
  }
  const int64_t blocks =
      std::clamp<int64_t>((std::max(lines, recv_lines) + kThreads - 1) / kThreads, 1, cap);
  flagged_push_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(args, batch);
  FASTCOMMS_CUDA_LAUNCH_CHECK();
}

}  // namespace fastcomms::cuda
