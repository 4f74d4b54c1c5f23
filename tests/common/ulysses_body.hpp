// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

// The one test body every Ulysses transport passes (the CPU collective path in the host tests,
// the CUDA collective and NVLink paths in the GPU tests): random geometries (uneven and empty
// shards, every element size), the output poisoned with two patterns before each call so an
// unwritten byte shows, each rank's result compared byte for byte with the plan's host reference,
// and the input checked unchanged. Memory access is passed in, so this header needs no CUDA.

#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "fastcomms/plan/reference.hpp"
#include "fastcomms/ulysses/transport.hpp"

namespace fastcomms::test {

/// One random call of a world, with every rank's input and the reference outputs.
struct UlyssesCase {
  int mode = 0;
  DType dt = DType::kUInt8;
  int64_t b = 1, d = 1;
  std::vector<int64_t> seq, heads;
  bool pass_splits = false;
  plan::RankBuffers inputs, want;
  std::array<int64_t, 4> in_shape(int r) const {
    int64_t S = 0, N = 0;
    for (auto v : seq) S += v;
    for (auto v : heads) N += v;
    return mode == 0 ? std::array<int64_t, 4>{b, seq[r], N, d}
                     : std::array<int64_t, 4>{b, S, heads[r], d};
  }
  UlyssesArgs args(bool async_op) const {
    UlyssesArgs a;
    a.mode = mode;
    a.async_op = async_op;
    if (pass_splits) {
      a.seq_splits = seq;
      a.head_splits = heads;
    }
    return a;
  }
};

/// `count` random cases for a world of P. `align16`: rows (d elements) are whole 16-byte vectors,
/// the peer-to-peer path's rule.
inline std::vector<UlyssesCase> random_cases(int P, int count, std::mt19937_64& rng, bool align16) {
  const DType types[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat64,
                         DType::kUInt8,   DType::kInt32,    DType::kFloat8E5M2};
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  std::vector<UlyssesCase> out;
  while (static_cast<int>(out.size()) < count) {
    UlyssesCase c;
    c.mode = static_cast<int>(pick(0, 1));
    c.dt = types[pick(0, 5)];
    const auto e = static_cast<int64_t>(dtype_size(c.dt));
    c.b = pick(1, 3);
    c.d = align16 ? (16 / e) * pick(1, 4) : pick(1, 9);
    c.pass_splits = pick(0, 2) != 0;
    for (int r = 0; r < P; ++r) {
      c.seq.push_back(c.pass_splits ? pick(0, 6) : 0);
      c.heads.push_back(c.pass_splits ? pick(0, 4) : 0);
    }
    if (!c.pass_splits) {
      c.seq.assign(P, pick(1, 6));
      c.heads.assign(P, pick(1, 4));
    }
    c.seq[pick(0, P - 1)] += 1;
    c.heads[pick(0, P - 1)] += 1;
    if (!c.pass_splits) {  // even shards must stay even
      c.seq.assign(P, c.seq[0] + 1);
      c.heads.assign(P, c.heads[0] + 1);
    }
    for (int r = 0; r < P; ++r) {
      const auto s = c.in_shape(r);
      c.inputs.emplace_back(static_cast<size_t>(s[0] * s[1] * s[2] * s[3] * e));
      for (auto& byte : c.inputs.back()) byte = static_cast<std::byte>(rng());
    }
    c.want = plan::reference_all_to_all_4d(c.mode, c.b, c.d, e, c.seq, c.heads, c.inputs);
    out.push_back(std::move(c));
  }
  return out;
}

/// How the body reaches the transport's memory.
struct BodyMemory {
  Device device;           ///< Where tensors live.
  void* stream = nullptr;  ///< The stream calls are enqueued on (CUDA).
  std::function<void*(size_t)> alloc;
  std::function<void(void*)> release;
  std::function<void(void*, const void*, size_t)> upload;    ///< dst on the device
  std::function<void(void*, const void*, size_t)> download;  ///< dst on the host
  std::function<void(void*, int, size_t)> fill;
  std::function<void()> sync;  ///< Waits for everything enqueued on `stream`.
};

/// Host memory (CPU transports).
inline BodyMemory host_memory() {
  BodyMemory m;
  m.alloc = [](size_t n) { return static_cast<void*>(new std::byte[n]); };
  m.release = [](void* p) { delete[] static_cast<std::byte*>(p); };
  m.upload = m.download = [](void* d, const void* s, size_t n) { std::memcpy(d, s, n); };
  m.fill = [](void* p, int v, size_t n) { std::memset(p, v, n); };
  m.sync = [] {};
  return m;
}

/// Runs every case through `t` on this rank; returns the number of failed checks (each printed
/// with `name`). Odd cases are issued async (the CPU path returns before the exchange ends).
inline int run_ulysses_body(UlyssesTransport& t, const std::vector<UlyssesCase>& cases, int rank,
                            const BodyMemory& mem, const std::string& name) {
  int failed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const UlyssesCase& c = cases[i];
    const auto s = c.in_shape(rank);
    const std::vector<std::byte>& in = c.inputs[rank];
    void* xb = mem.alloc(std::max<size_t>(in.size(), 1));
    mem.upload(xb, in.data(), in.size());
    const TensorView x = TensorView::contiguous(xb, c.dt, {s[0], s[1], s[2], s[3]}, mem.device);
    const UlyssesArgs args = c.args(i % 2 == 1);
    const auto os = t.output_shape(x, args);
    const size_t out_bytes = c.want[rank].size();
    void* ob = mem.alloc(std::max<size_t>(out_bytes, 1));
    const TensorView out =
        TensorView::contiguous(ob, c.dt, {os[0], os[1], os[2], os[3]}, mem.device);
    for (int poison : {0xA5, 0x5A}) {
      mem.fill(ob, poison, out_bytes);
      t.all_to_all_4d(x, out, args, mem.stream)->wait();
      mem.sync();
      std::vector<std::byte> got(out_bytes), back(in.size());
      mem.download(got.data(), ob, out_bytes);
      mem.download(back.data(), xb, in.size());
      if (got != c.want[rank] || back != in) {
        ++failed;
        std::printf("%s: rank %d case %zu (mode %d, %s, poison 0x%X): %s\n", name.c_str(), rank, i,
                    c.mode, std::string(dtype_name(c.dt)).c_str(), poison,
                    got != c.want[rank] ? "output differs from the reference" : "input modified");
      }
    }
    mem.release(ob);
    mem.release(xb);
  }
  return failed;
}

}  // namespace fastcomms::test
