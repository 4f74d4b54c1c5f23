// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/plan/simulate.hpp"

#include <cstring>
#include <sstream>

#include "fastcomms/error.hpp"

namespace fastcomms::plan {
namespace {

// Adds one to counts[] for every destination byte `c` writes; reports an out-of-bounds access.
std::string cover(const CopyDesc& c, int64_t src_size, std::vector<unsigned char>& counts,
                  const std::string& what) {
  if (c.empty()) return {};
  if (std::string bad = check_desc_invariants(c); !bad.empty()) return what + ": " + bad;
  if (c.src_offset < 0 || c.src_extent() > src_size) {
    return detail::cat(what, ": reads [", c.src_offset, ", ", c.src_extent(), ") of a ", src_size,
                       "-byte source");
  }
  const auto dst_size = static_cast<int64_t>(counts.size());
  if (c.dst_offset < 0 || c.dst_extent() > dst_size) {
    return detail::cat(what, ": writes [", c.dst_offset, ", ", c.dst_extent(), ") of a ", dst_size,
                       "-byte destination");
  }
  for (int64_t z = 0; z < c.depth; ++z)
    for (int64_t y = 0; y < c.height; ++y) {
      const int64_t base = c.dst_offset + z * c.dst_slice_pitch + y * c.dst_pitch;
      for (int64_t x = 0; x < c.width; ++x) ++counts[static_cast<size_t>(base + x)];
    }
  return {};
}

std::string exactly_once(const std::vector<unsigned char>& counts, const std::string& what) {
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] != 1) {
      return detail::cat(what, ": byte ", i, " of ", counts.size(), " written ",
                         static_cast<int>(counts[i]), " times");
    }
  }
  return {};
}

}  // namespace

std::array<int64_t, 4> WorldSpec::input_shape(int r) const {
  int64_t S = 0, N = 0;
  for (int64_t v : seq_splits) S += v;
  for (int64_t v : head_splits) N += v;
  if (mode == 0) return {b, seq_splits[r], N / kv_replicas, d};
  return {b, S, head_splits[r], d};
}

UlyssesRequest WorldSpec::request(int r, Path path) const {
  UlyssesRequest q;
  q.world_size = world_size;
  q.rank = r;
  q.mode = mode;
  q.shape = input_shape(r);
  q.element_size = element_size;
  q.kv_replicas = kv_replicas;
  q.path = path;
  if (pass_splits) {
    q.seq_splits = seq_splits;
    q.head_splits = head_splits;
  }
  return q;
}

std::string check_desc_invariants(const CopyDesc& c) {
  if (c.empty()) {
    return c == CopyDesc{} ? std::string{} : "empty descriptor is not all zeros: " + to_string(c);
  }
  std::string bad;
  if (c.width <= 0 || c.height <= 0 || c.depth <= 0)
    bad = "non-positive extent";
  else if (c.src_pitch < c.width || c.dst_pitch < c.width)
    bad = "pitch below width";
  else if (c.src_slice_pitch < c.src_pitch * c.height || c.dst_slice_pitch < c.dst_pitch * c.height)
    bad = "slice pitch below pitch * height";
  else if (c.src_slice_pitch % c.src_pitch != 0 || c.dst_slice_pitch % c.dst_pitch != 0)
    bad = "slice pitch not a multiple of pitch";
  else if (c.depth > 1 && c.src_slice_pitch == c.src_pitch * c.height &&
           c.dst_slice_pitch == c.dst_pitch * c.height)
    bad = "foldable depth left unfolded";
  else if (c.height > 1 && c.src_pitch == c.width && c.dst_pitch == c.width)
    bad = "contiguous rows left unfolded";
  else if (c.height == 1 && c.depth > 1)
    bad = "single-row slices left unfolded";
  return bad.empty() ? bad : bad + ": " + to_string(c);
}

SimResult simulate_world(const WorldSpec& spec, Path path, const RankBuffers& inputs,
                         unsigned char poison) {
  const int P = spec.world_size;
  SimResult res;
  res.plans.reserve(P);
  for (int r = 0; r < P; ++r) res.plans.push_back(make_ulysses_plan(spec.request(r, path)));
  res.outputs.resize(P);
  for (int r = 0; r < P; ++r) {
    res.outputs[r].assign(static_cast<size_t>(res.plans[r].out_bytes), std::byte{poison});
    if (static_cast<int64_t>(inputs[r].size()) != res.plans[r].in_bytes) {
      res.error = detail::cat("rank ", r, ": input holds ", inputs[r].size(), " bytes, plan says ",
                              res.plans[r].in_bytes);
      return res;
    }
    if (res.plans[r].geometry_key != res.plans[0].geometry_key) {
      res.error = detail::cat("rank ", r, ": geometry key differs from rank 0's");
      return res;
    }
  }
  const int64_t e = spec.element_size;

  if (path == Path::kPeerToPeer) {
    std::vector<std::vector<unsigned char>> counts(P);
    for (int q = 0; q < P; ++q) counts[q].assign(res.outputs[q].size(), 0);
    for (int r = 0; r < P; ++r) {
      for (int q = 0; q < P; ++q) {
        const CopyDesc& c = res.plans[r].puts[q];
        res.error = cover(c, res.plans[r].in_bytes, counts[q], detail::cat("put ", r, "->", q));
        if (!res.error.empty()) return res;
        copy_host(c, inputs[r].data(), res.outputs[q].data());
      }
    }
    for (int q = 0; q < P; ++q) {
      res.error = exactly_once(counts[q], detail::cat("rank ", q, " output"));
      if (!res.error.empty()) return res;
    }
    return res;
  }

  // Collective: pack, exchange by the split sizes, unpack.
  RankBuffers send(P);
  for (int r = 0; r < P; ++r) {
    const UlyssesPlan& pl = res.plans[r];
    send[r].assign(static_cast<size_t>(pl.send_elems * e), std::byte{poison});
    std::vector<unsigned char> counts(send[r].size(), 0);
    for (int q = 0; q < P; ++q) {
      const CopyDesc& c = pl.pack[q];
      res.error = cover(c, pl.in_bytes, counts, detail::cat("pack ", r, "->", q));
      if (!res.error.empty()) return res;
      if (c.bytes() != pl.send_counts[q] * e ||
          (!c.empty() && c.dst_offset != pl.send_displs[q] * e)) {
        res.error = detail::cat("pack ", r, "->", q, " does not fill its chunk: ", to_string(c));
        return res;
      }
      copy_host(c, inputs[r].data(), send[r].data());
    }
    res.error = exactly_once(counts, detail::cat("rank ", r, " send buffer"));
    if (!res.error.empty()) return res;
  }
  for (int r = 0; r < P; ++r) {
    const UlyssesPlan& pl = res.plans[r];
    std::vector<std::byte> recv(static_cast<size_t>(pl.recv_elems * e), std::byte{poison});
    for (int p = 0; p < P; ++p) {
      const UlyssesPlan& pp = res.plans[p];
      if (pp.send_counts[r] != pl.recv_counts[p]) {
        res.error = detail::cat("rank ", p, " sends ", pp.send_counts[r], " elements to rank ", r,
                                ", which expects ", pl.recv_counts[p]);
        return res;
      }
      if (pl.recv_counts[p] == 0) continue;
      std::memcpy(recv.data() + pl.recv_displs[p] * e, send[p].data() + pp.send_displs[r] * e,
                  static_cast<size_t>(pl.recv_counts[p] * e));
    }
    std::vector<unsigned char> counts(res.outputs[r].size(), 0);
    for (int p = 0; p < P; ++p) {
      const CopyDesc& c = pl.unpack[p];
      res.error =
          cover(c, static_cast<int64_t>(recv.size()), counts, detail::cat("unpack ", p, "->", r));
      if (!res.error.empty()) return res;
      copy_host(c, recv.data(), res.outputs[r].data());
    }
    res.error = exactly_once(counts, detail::cat("rank ", r, " output"));
    if (!res.error.empty()) return res;
  }
  return res;
}

}  // namespace fastcomms::plan
