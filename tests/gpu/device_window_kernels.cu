// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// CUDA kernels of tests/python/test_device_window_gpu.py: every device-window call from CUDA
// C++, through the installed header only (fastcomms/device/window.hpp). Built as a plain shared
// library with C entry points (the test loads it with ctypes), so no torch extension has to be
// compiled on the GPU machine. Each entry point takes device pointers as integers and a stream,
// and launches; results land in device memory the test reads back.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "fastcomms/device/transport.hpp"
#include "fastcomms/device/window.hpp"

using fastcomms::device::CmpOp;
using fastcomms::device::CoopScope;
using fastcomms::device::DeviceWindow;
using fastcomms::device::RegisteredBuffer;
using fastcomms::device::SignalOp;

namespace {

__device__ unsigned unit_of(CoopScope s) {
  const unsigned t = threadIdx.x;
  const unsigned per_block = s == CoopScope::BLOCK  ? 1u
                             : s == CoopScope::WARP ? blockDim.x / 32
                                                    : blockDim.x;
  const unsigned in_block = s == CoopScope::BLOCK ? 0u : s == CoopScope::WARP ? t / 32 : t;
  return blockIdx.x * per_block + in_block;
}

// Every unit (a thread, a warp or a block, by scope) puts its chunk of `src` into every rank's
// window (itself included) at rank * total + unit * chunk, with signal 0 and counter 0; then each
// unit waits for all of the round's signals (sum over senders) and its counter, and the grid
// copies the whole window to `out` right after the acquire. `expect` is the running total of
// signals (and of counter 0) after this round: the pad is never reset between rounds.
__global__ void exchange_kernel(const DeviceWindow* wp, const RegisteredBuffer* src, char* out,
                                uint64_t chunk, int scope_i, uint64_t expect, int* rc) {
  DeviceWindow w = *wp;
  const CoopScope scope = static_cast<CoopScope>(scope_i);
  const unsigned units = gridDim.x * (scope == CoopScope::BLOCK  ? 1u
                                      : scope == CoopScope::WARP ? blockDim.x / 32
                                                                 : blockDim.x);
  const unsigned u = unit_of(scope);
  const uint64_t total = units * chunk;
  int bad = 0;
  for (int q = 0; q < w.num_ranks(); ++q) {
    const int d = (w.rank() + q) % w.num_ranks();  // a different first peer on every rank
    bad |= w.put(w.rank() * total + u * chunk, *src, u * chunk, d, chunk, 0, 0, scope);
  }
  bad |= w.wait_signal(0, CmpOp::GE, expect, scope);
  bad |= w.wait_counter(0, CmpOp::GE, expect, scope);
  if (bad) atomicOr(rc, 1);
  const uint64_t bytes = w.num_ranks() * total;
  const char* base = static_cast<const char*>(w.base());
  for (uint64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < bytes; i += gridDim.x * blockDim.x)
    out[i] = base[i];
}

__global__ void barrier_kernel(const DeviceWindow* wp, int scope_i, int barrier_id, int* rc) {
  DeviceWindow w = *wp;
  if (w.barrier(barrier_id, static_cast<CoopScope>(scope_i)) != 0) atomicOr(rc, 2);
}

// One block, one scope: metadata, refusals, signal SET/ADD with every compare op, read and
// reset of signals and counters, stores through get_nvlink_address. Results into out[] (uint64).
// Called once per scope (round 1, 2, 3), launched with 1, 32 and 128 threads for THREAD, WARP
// and BLOCK (a THREAD call is one thread's).
__global__ void calls_kernel(const DeviceWindow* wp, const RegisteredBuffer* src, uint64_t* out,
                             int scope_i, uint64_t round) {
  DeviceWindow w = *wp;
  const CoopScope s = static_cast<CoopScope>(scope_i);
  const bool lead = threadIdx.x == 0;
  const int n = w.num_ranks(), r = w.rank();
  if (lead) {
    out[0] = w.rank();
    out[1] = w.num_ranks();
    out[2] = reinterpret_cast<uint64_t>(w.base());
    out[3] = w.size();
    out[4] = reinterpret_cast<uint64_t>(w.get_multimem_address(0));
    for (int q = 0; q < n; ++q) out[8 + q] = reinterpret_cast<uint64_t>(w.get_nvlink_address(q));
    out[5] = reinterpret_cast<uint64_t>(w.get_nvlink_address(n));  // out of range: nullptr
  }
  // refusals: every one returns -1 (kDeviceInvalid) and writes nothing
  int refused = 0;
  refused += w.put(0, *src, 0, n, 8, -1, -1, s) == -1;             // no such rank
  refused += w.put(w.size() - 4, *src, 0, r, 8, -1, -1, s) == -1;  // past the window
  refused += w.put(0, *src, src->size, r, 8, -1, -1, s) == -1;     // past the source
  refused += w.signal(r, 1 << 20, SignalOp::ADD, 1, s) == -1;      // no such signal id
  refused += w.signal(-1, 1, SignalOp::ADD, 1, s) == -1;           // no such peer
  refused += w.wait_signal(1, static_cast<CmpOp>(9), 0, s) == -1;  // no such compare op
  refused += w.wait_signal_from(n, 1, CmpOp::GE, 0, s) == -1;      // no such peer
  refused += w.wait_counter(1 << 20, CmpOp::GE, 0, s) == -1;       // no such counter
  refused += w.barrier(1 << 20, s) == -1;                          // no such barrier
  if (lead) out[6] = refused;
  // SET: rank r sets signal 1 at every peer to (r + 1) * 10; ADD: signal 2 += r + 1, twice
  int rc = 0;
  for (int q = 0; q < n; ++q) {
    rc |= w.signal(q, 1, SignalOp::SET, (r + 1) * 10ull, s);
    rc |= w.signal(q, 2, SignalOp::ADD, r + 1ull, s);
    rc |= w.signal(q, 2, SignalOp::ADD, r + 1ull, s);
  }
  uint64_t set_sum = 0, add_sum = 0;
  for (int q = 0; q < n; ++q) set_sum += (q + 1) * 10ull, add_sum += 2ull * (q + 1);
  rc |= w.wait_signal(1, CmpOp::EQ, set_sum, s);
  rc |= w.wait_signal(2, CmpOp::GE, add_sum, s);
  for (int q = 0; q < n; ++q) {
    const uint64_t v = (q + 1) * 10ull;
    rc |= w.wait_signal_from(q, 1, CmpOp::EQ, v, s);
    rc |= w.wait_signal_from(q, 1, CmpOp::NE, v + 1, s);
    rc |= w.wait_signal_from(q, 1, CmpOp::LT, v + 1, s);
    rc |= w.wait_signal_from(q, 1, CmpOp::LE, v, s);
    rc |= w.wait_signal_from(q, 1, CmpOp::GT, v - 1, s);
    rc |= w.wait_signal_from(q, 1, CmpOp::GE, v, s);
  }
  rc |= w.wait_signal(2, CmpOp::LE, add_sum, s);
  rc |= w.wait_signal(2, CmpOp::GT, add_sum - 1, s);
  rc |= w.wait_signal(2, CmpOp::LT, add_sum + 1, s);
  rc |= w.wait_signal(2, CmpOp::NE, 0, s);
  if (lead) {
    out[7] = rc;
    out[20] = w.read_signal(1);
    out[21] = w.read_signal(2);
    out[22] = w.read_signal(1 << 20);  // out of range: 0
  }
  // stores through the mapped address, then a signal; the peer reads them after its wait
  rc |= w.barrier(0, s);  // every rank is done reading signals 1 and 2 before resets
  w.reset_signal(1, s);
  w.reset_signal(2, s);
  if (lead) {
    out[23] = w.read_signal(1);
    out[24] = w.read_signal(2);
  }
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  uint64_t* peer = static_cast<uint64_t*>(w.get_nvlink_address(next));
  for (unsigned i = threadIdx.x; i < 256; i += blockDim.x) peer[i] = 1000000ull * r + i + 7 * round;
  rc |= w.fence();
  rc |= w.signal(next, 3, SignalOp::ADD, 1, s);
  rc |= w.wait_signal_from(prev, 3, CmpOp::GE, round, s);
  const uint64_t* mine = static_cast<const uint64_t*>(w.base());
  int wrong = 0;
  for (unsigned i = threadIdx.x; i < 256; i += blockDim.x)
    wrong += mine[i] != 1000000ull * prev + i + 7 * round;
  if (wrong) atomicAdd(reinterpret_cast<unsigned long long*>(out + 25), wrong);
  // counters: a put with a counter bumps it; reset brings it back to 0
  rc |= w.barrier(0, s);
  w.reset_counter(1, s);
  rc |= w.put(2048, *src, 0, next, 64, -1, 1, s);
  rc |= w.wait_counter(1, CmpOp::EQ, 1, s);
  if (lead) out[26] = w.read_counter(1);
  w.reset_counter(1, s);
  if (lead) out[27] = w.read_counter(1);
  rc |= w.flush(s);
  rc |= w.barrier(0, s);
  if (rc && lead) out[7] |= 2;
  if (rc) atomicOr(reinterpret_cast<unsigned long long*>(out + 7), 4ull);
}

// Contention: every thread of every block ADDs 1 to signal 4 at `peer`, `reps` times; then every
// rank waits for EQ of the exact total it should receive (from all senders), and counter 2 for
// the puts of 16 bytes each thread made with it.
__global__ void contention_kernel(const DeviceWindow* wp, const RegisteredBuffer* src, int peer,
                                  int reps, uint64_t expect_signals, uint64_t expect_counter,
                                  int* rc) {
  DeviceWindow w = *wp;
  int bad = 0;
  const uint64_t off = (blockIdx.x * blockDim.x + threadIdx.x) * 16ull % (w.size() - 16);
  for (int i = 0; i < reps; ++i) {
    bad |= w.signal(peer, 4, SignalOp::ADD, 1);
    bad |= w.put(off, *src, 0, w.rank(), 16, -1, 2);
  }
  if (blockIdx.x == 0) {
    bad |= w.wait_signal(4, CmpOp::EQ, expect_signals, CoopScope::BLOCK);
    bad |= w.wait_counter(2, CmpOp::EQ, expect_counter, CoopScope::BLOCK);
  }
  if (bad) atomicOr(rc, 1);
}

// The ordering check (and its armed control): rank `sender` puts `bytes` from `src` into rank
// `receiver`'s window with signal 5, by one block; the receiver tells the sender it is polling
// (signal 6) first, then waits for signal 5 and counts the bytes that differ from the source's
// pattern (byte i == (i * 7 + seed) & 0xff), scanning from the end (the last bytes land last).
__global__ void ordering_kernel(const DeviceWindow* wp, const RegisteredBuffer* src, int sender,
                                int receiver, uint64_t bytes, uint64_t round, int seed,
                                unsigned long long* wrong, int* rc) {
  DeviceWindow w = *wp;
  int bad = 0;
  if (w.rank() == sender) {
    bad |= w.wait_signal_from(receiver, 6, CmpOp::GE, round, CoopScope::BLOCK);
    bad |= w.put(0, *src, 0, receiver, bytes, 5, -1, CoopScope::BLOCK);
  } else if (w.rank() == receiver) {
    bad |= w.signal(sender, 6, SignalOp::ADD, 1, CoopScope::BLOCK);
    bad |= w.wait_signal_from(sender, 5, CmpOp::GE, round, CoopScope::BLOCK);
    const unsigned char* p = static_cast<const unsigned char*>(w.base());
    unsigned long long n = 0;
    for (uint64_t i = threadIdx.x; i < bytes; i += blockDim.x) {
      const uint64_t j = bytes - 1 - i;
      n += p[j] != static_cast<unsigned char>((j * 7 + seed) & 0xff);
    }
    if (n) atomicAdd(wrong, n);
  }
  if (bad) atomicOr(rc, 1);
}

// A wait for a signal that never comes: returns kDeviceTimeout after the window's timeout and
// leaves the error the host's check_errors() raises.
__global__ void timeout_kernel(const DeviceWindow* wp, int peer, int scope_i, int* rc) {
  DeviceWindow w = *wp;
  const int r = w.wait_signal_from(peer, 0, CmpOp::GE, 1ull << 60, static_cast<CoopScope>(scope_i));
  if (threadIdx.x == 0) *rc = r;
}

// The device transport (as tk_transport in device_window_triton_kernels.py): ranks pair up
// (0-1, 2-3, ...), the even one sends then receives, the odd one the other way round; then a
// pairwise barrier, a caller's signal and its wait, the properties and a refused self-send.
__global__ void transport_kernel(const DeviceWindow* wp, const char* src, char* dst,
                                 uint64_t nbytes, int* rc) {
  using namespace fastcomms::device;
  DeviceWindow w = *wp;
  const int r = transport_my_rank(w), n = transport_n_ranks(w);
  const int peer = r % 2 == 0 ? r + 1 : r - 1;
  int bad = 0;
  if (peer < n) {
    if (r % 2 == 0) {
      bad |= transport_send(w, peer, src, nbytes);
      bad |= transport_recv(w, peer, dst, nbytes);
    } else {
      bad |= transport_recv(w, peer, dst, nbytes);
      bad |= transport_send(w, peer, src, nbytes);
    }
    bad |= transport_barrier(w, peer, 0);
    bad |= transport_signal(w, peer, 0, 1, 1);
    bad |= transport_wait_signal(w, peer, 0, 3, 1);  // 3: GE in the transport's numbering
    if (transport_get_type(w, peer) != 1) bad |= 8;
  }
  if (transport_get_type(w, r) != 0) bad |= 16;
  if (transport_num_nvl_peers(w) != n - 1) bad |= 32;
  if (transport_send(w, r, src, nbytes) != -1) bad |= 64;  // a self-send is refused
  if (bad && threadIdx.x == 0) atomicOr(rc, bad);
}

}  // namespace

extern "C" {

int fc_dw_transport(uint64_t win, uint64_t src, uint64_t dst, uint64_t nbytes, int threads,
                    uint64_t rc, uint64_t stream) {
  transport_kernel<<<1, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const DeviceWindow*>(win), reinterpret_cast<const char*>(src),
      reinterpret_cast<char*>(dst), nbytes, reinterpret_cast<int*>(rc));
  return static_cast<int>(cudaGetLastError());
}

int fc_dw_timeout(uint64_t win, int peer, int scope, int threads, uint64_t rc, uint64_t stream) {
  timeout_kernel<<<1, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const DeviceWindow*>(win), peer, scope, reinterpret_cast<int*>(rc));
  return static_cast<int>(cudaGetLastError());
}

int fc_dw_exchange(uint64_t win, uint64_t src, uint64_t out, uint64_t chunk, int scope,
                   uint64_t expect, int blocks, int threads, uint64_t rc, uint64_t stream) {
  exchange_kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const DeviceWindow*>(win), reinterpret_cast<const RegisteredBuffer*>(src),
      reinterpret_cast<char*>(out), chunk, scope, expect, reinterpret_cast<int*>(rc));
  return static_cast<int>(cudaGetLastError());
}

int fc_dw_barrier(uint64_t win, int scope, int barrier_id, int threads, uint64_t rc,
                  uint64_t stream) {
  barrier_kernel<<<1, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const DeviceWindow*>(win), scope, barrier_id, reinterpret_cast<int*>(rc));
  return static_cast<int>(cudaGetLastError());
}

int fc_dw_calls(uint64_t win, uint64_t src, uint64_t out, int scope, uint64_t round, int threads,
                uint64_t stream) {
  calls_kernel<<<1, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const DeviceWindow*>(win), reinterpret_cast<const RegisteredBuffer*>(src),
      reinterpret_cast<uint64_t*>(out), scope, round);
  return static_cast<int>(cudaGetLastError());
}

int fc_dw_contention(uint64_t win, uint64_t src, int peer, int reps, uint64_t expect_signals,
                     uint64_t expect_counter, int blocks, int threads, uint64_t rc,
                     uint64_t stream) {
  contention_kernel<<<blocks, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const DeviceWindow*>(win), reinterpret_cast<const RegisteredBuffer*>(src),
      peer, reps, expect_signals, expect_counter, reinterpret_cast<int*>(rc));
  return static_cast<int>(cudaGetLastError());
}

int fc_dw_ordering(uint64_t win, uint64_t src, int sender, int receiver, uint64_t bytes,
                   uint64_t round, int seed, int threads, uint64_t wrong, uint64_t rc,
                   uint64_t stream) {
  ordering_kernel<<<1, threads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(
      reinterpret_cast<const DeviceWindow*>(win), reinterpret_cast<const RegisteredBuffer*>(src),
      sender, receiver, bytes, round, seed, reinterpret_cast<unsigned long long*>(wrong),
      reinterpret_cast<int*>(rc));
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
