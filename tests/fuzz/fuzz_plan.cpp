// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// libFuzzer target over the plan's inputs. The plan may reject an input (fastcomms::Error); it
// must never crash, and an accepted plan must never mis-size a descriptor: every descriptor keeps
// NOTE [copy descriptor invariants], stays inside its buffers, and the bytes add up. Small
// accepted geometries are also replayed against the reference.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>

#include "fastcomms/error.hpp"
#include "fastcomms/plan/reference.hpp"
#include "fastcomms/plan/simulate.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"

using namespace fastcomms;
using namespace fastcomms::plan;

namespace {

[[noreturn]] void fail(const std::string& what, const UlyssesPlan& p) {
  std::fprintf(stderr, "fuzz_plan: %s (world %d rank %d mode %d)\n", what.c_str(), p.world_size,
               p.rank, p.mode);
  std::abort();
}

int64_t pick_dim(FuzzedDataProvider& in) {
  switch (in.ConsumeIntegralInRange<int>(0, 3)) {
    case 0:
      return in.ConsumeIntegral<int64_t>();  // anything, negative and huge included
    case 1:
      return in.ConsumeIntegralInRange<int64_t>(0, 1 << 20);
    default:
      return in.ConsumeIntegralInRange<int64_t>(0, 12);
  }
}

void check(const UlyssesPlan& p) {
  const int P = p.world_size;
  const int64_t E = p.d * p.element_size;
  auto out_bytes_of = [&](int q) {
    return p.mode == 0 ? p.b * p.seq_total * p.head_splits[q] * E
                       : p.b * p.seq_splits[q] * p.heads_total * E;
  };
  if (out_bytes_of(p.rank) != p.out_bytes) fail("out_bytes disagrees with the splits", p);
  auto desc_ok = [&](const CopyDesc& c, int64_t src_size, int64_t dst_size, const char* what) {
    if (std::string bad = check_desc_invariants(c); !bad.empty()) fail(what + (": " + bad), p);
    if (c.empty()) return;
    if (c.src_offset < 0 || c.src_extent() > src_size) fail(std::string(what) + " reads out", p);
    if (c.dst_offset < 0 || c.dst_extent() > dst_size) fail(std::string(what) + " writes out", p);
  };
  // NOTE [kv replicas]: mode 0 sends each source byte to R destinations.
  const int64_t sent = p.mode == 0 ? p.in_bytes * p.kv_replicas : p.in_bytes;
  if (p.path == Path::kPeerToPeer) {
    if (static_cast<int>(p.puts.size()) != P) fail("puts.size() != world_size", p);
    int64_t total = 0;
    for (int q = 0; q < P; ++q) {
      desc_ok(p.puts[q], p.in_bytes, out_bytes_of(q), "put");
      total += p.puts[q].bytes();
    }
    if (total != sent) fail("puts do not move the whole input", p);
    return;
  }
  if (static_cast<int>(p.pack.size()) != P || static_cast<int>(p.unpack.size()) != P)
    fail("pack/unpack size != world_size", p);
  int64_t packed = 0, unpacked = 0;
  for (int q = 0; q < P; ++q) {
    desc_ok(p.pack[q], p.in_bytes, p.send_elems * p.element_size, "pack");
    desc_ok(p.unpack[q], p.recv_elems * p.element_size, p.out_bytes, "unpack");
    if (p.pack[q].bytes() != p.send_counts[q] * p.element_size) fail("pack != send count", p);
    if (p.unpack[q].bytes() != p.recv_counts[q] * p.element_size) fail("unpack != recv count", p);
    packed += p.pack[q].bytes();
    unpacked += p.unpack[q].bytes();
  }
  if (packed != sent || unpacked != p.out_bytes) fail("chunks do not add up", p);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  UlyssesRequest req;
  req.world_size = in.ConsumeIntegralInRange<int>(-1, 17);
  req.rank = in.ConsumeIntegralInRange<int>(-1, 17);
  req.mode = in.ConsumeIntegralInRange<int>(-1, 2);
  req.element_size = in.ConsumeIntegralInRange<int64_t>(0, 9);
  req.path = in.ConsumeBool() ? Path::kPeerToPeer : Path::kCollective;
  for (auto& s : req.shape) s = pick_dim(in);
  if (in.ConsumeBool()) req.kv_replicas = in.ConsumeIntegralInRange<int64_t>(-1, 9);
  if (in.ConsumeBool()) {
    const int n = in.ConsumeIntegralInRange<int>(0, 17);
    std::vector<int64_t> seq(n), heads(n);
    for (auto& v : seq) v = pick_dim(in);
    for (auto& v : heads) v = pick_dim(in);
    // Often make the splits agree with the shape so that deep paths are reached.
    if (in.ConsumeBool() && n == req.world_size && req.rank >= 0 && req.rank < n) {
      int64_t S = 0, N = 0;
      for (auto v : seq) (void)__builtin_add_overflow(S, v, &S);
      for (auto v : heads) (void)__builtin_add_overflow(N, v, &N);
      req.shape[1] = req.mode == 0 ? seq[req.rank] : S;
      req.shape[2] =
          req.mode == 0 ? (req.kv_replicas > 0 ? N / req.kv_replicas : N) : heads[req.rank];
    }
    const int which = in.ConsumeIntegralInRange<int>(0, 9);
    if (which != 0) req.seq_splits = seq;
    if (which != 1) req.head_splits = heads;
  }
  UlyssesPlan p;
  try {
    p = make_ulysses_plan(req);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kInvalidArgument) std::abort();
    return 0;
  }
  check(p);
  // Replay the whole world when it is small enough.
  const int64_t global = p.b * p.seq_total * p.heads_total * p.d * p.element_size;
  if (global <= (1 << 16)) {
    WorldSpec spec;
    spec.world_size = p.world_size;
    spec.mode = p.mode;
    spec.b = p.b;
    spec.d = p.d;
    spec.element_size = p.element_size;
    spec.seq_splits = p.seq_splits;
    spec.head_splits = p.head_splits;
    spec.pass_splits = req.seq_splits.has_value();
    spec.kv_replicas = p.kv_replicas;
    RankBuffers inputs(p.world_size);
    unsigned char v = 1;
    for (int r = 0; r < p.world_size; ++r) {
      const auto s = spec.input_shape(r);
      inputs[r].resize(static_cast<size_t>(s[0] * s[1] * s[2] * s[3] * p.element_size));
      for (auto& byte : inputs[r]) byte = static_cast<std::byte>(v = v * 31 + 7);
    }
    SimResult res = simulate_world(spec, p.path, inputs, 0xee);
    if (!res.error.empty()) fail(res.error, p);
    if (res.outputs !=
        reference_all_to_all_4d(p.mode, p.b, p.d, p.element_size, p.seq_splits, p.head_splits,
                                p.mode == 0 && p.kv_replicas > 1
                                    ? repeat_interleave_heads(inputs, p.heads_total / p.kv_replicas,
                                                              p.d, p.element_size, p.kv_replicas)
                                    : inputs))
      fail("replay differs from the reference", p);
  }
  return 0;
}
