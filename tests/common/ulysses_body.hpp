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
#include "fastcomms/plan/simulate.hpp"
#include "fastcomms/ulysses/transport.hpp"

namespace fastcomms::test {

/// One random call of a world (its geometry as plan/'s WorldSpec), with every rank's input and
/// the reference outputs.
struct UlyssesCase {
  plan::WorldSpec spec;
  DType dt = DType::kUInt8;
  plan::RankBuffers inputs, want;
  UlyssesArgs args(bool async_op) const {
    UlyssesArgs a;
    a.mode = spec.mode;
    a.async_op = async_op;
    if (spec.pass_splits) {
      a.seq_splits = spec.seq_splits;
      a.head_splits = spec.head_splits;
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
    plan::WorldSpec& w = c.spec;
    w.world_size = P;
    w.mode = static_cast<int>(pick(0, 1));
    c.dt = types[pick(0, 5)];
    w.element_size = static_cast<int64_t>(dtype_size(c.dt));
    w.b = pick(1, 3);
    w.d = align16 ? (16 / w.element_size) * pick(1, 4) : pick(1, 9);
    w.pass_splits = pick(0, 2) != 0;
    for (int r = 0; r < P; ++r) {
      w.seq_splits.push_back(w.pass_splits ? pick(0, 6) : 0);
      w.head_splits.push_back(w.pass_splits ? pick(0, 4) : 0);
    }
    if (!w.pass_splits) {
      w.seq_splits.assign(P, pick(1, 6));
      w.head_splits.assign(P, pick(1, 4));
    }
    w.seq_splits[pick(0, P - 1)] += 1;
    w.head_splits[pick(0, P - 1)] += 1;
    if (!w.pass_splits) {  // even shards must stay even
      w.seq_splits.assign(P, w.seq_splits[0] + 1);
      w.head_splits.assign(P, w.head_splits[0] + 1);
    }
    for (int r = 0; r < P; ++r) {
      const auto s = w.input_shape(r);
      c.inputs.emplace_back(static_cast<size_t>(s[0] * s[1] * s[2] * s[3] * w.element_size));
      for (auto& byte : c.inputs.back()) byte = static_cast<std::byte>(rng());
    }
    c.want = plan::reference_all_to_all_4d(w.mode, w.b, w.d, w.element_size, w.seq_splits,
                                           w.head_splits, c.inputs);
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
    const auto s = c.spec.input_shape(rank);
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
                    c.spec.mode, std::string(dtype_name(c.dt)).c_str(), poison,
                    got != c.want[rank] ? "output differs from the reference" : "input modified");
      }
    }
    mem.release(ob);
    mem.release(xb);
  }
  return failed;
}

}  // namespace fastcomms::test
