// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/plan/ulysses_plan.hpp"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "fastcomms/error.hpp"

namespace fastcomms::plan {
namespace {

std::string join(const std::vector<int64_t>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

bool mul_overflows(int64_t a, int64_t b, int64_t* out) { return __builtin_mul_overflow(a, b, out); }

// Validated global geometry of one call, shared by the plan and the shape query: a plan with every
// field up to in_shape filled in, no sizes and no descriptors yet.
UlyssesPlan resolve(const UlyssesRequest& req) {
  const int P = req.world_size;
  const int r = req.rank;
  std::string prefix;
  {
    std::ostringstream os;
    os << "[rank " << r << "/" << P << (req.comm_name.empty() ? "" : " ") << req.comm_name << "] "
       << req.op_name << ": ";
    prefix = os.str();
  }
  FASTCOMMS_CHECK(P >= 1, kInvalidArgument, prefix, "world_size must be >= 1, got ", P);
  FASTCOMMS_CHECK(r >= 0 && r < P, kInvalidArgument, prefix, "rank must be in [0, ", P, "), got ",
                  r);
  FASTCOMMS_CHECK(req.mode == 0 || req.mode == 1, kInvalidArgument, prefix,
                  "mode must be 0 or 1, got ", req.mode);
  const int64_t e = req.element_size;
  FASTCOMMS_CHECK(e == 1 || e == 2 || e == 4 || e == 8, kInvalidArgument, prefix,
                  "element size must be 1, 2, 4 or 8 bytes, got ", e);
  for (int i = 0; i < 4; ++i) {
    FASTCOMMS_CHECK(req.shape[i] >= 0, kInvalidArgument, prefix, "x.size(", i,
                    ") must be >= 0, got ", req.shape[i]);
  }
  FASTCOMMS_CHECK(req.seq_splits.has_value() == req.head_splits.has_value(), kInvalidArgument,
                  prefix, "seq_splits and head_splits must be given together, got ",
                  req.seq_splits ? "seq_splits" : "head_splits", " only");

  UlyssesPlan g;
  g.world_size = P;
  g.rank = r;
  g.mode = req.mode;
  g.path = req.path;
  g.in_shape = req.shape;
  g.b = req.shape[0];
  g.d = req.shape[3];
  g.element_size = e;
  const int64_t s_in = req.shape[1];
  const int64_t R = req.kv_replicas;
  FASTCOMMS_CHECK(R >= 1, kInvalidArgument, prefix, "kv_replicas must be >= 1, got ", R);
  g.kv_replicas = R;
  // Mode 0 reads h source heads that stand for h * R virtual ones (NOTE [kv replicas]).
  int64_t n_in = req.shape[2];
  if (req.mode == 0) {
    FASTCOMMS_CHECK(!mul_overflows(n_in, R, &n_in), kInvalidArgument, prefix,
                    "virtual head count x.size(2) * kv_replicas = ", req.shape[2], " * ", R,
                    " overflows 64 bits");
  }
  if (req.seq_splits) {
    const auto check_splits = [&](const std::vector<int64_t>& v, const char* name) {
      FASTCOMMS_CHECK(static_cast<int64_t>(v.size()) == P, kInvalidArgument, prefix, name,
                      " must have world_size=", P, " entries, got ", v.size());
      int64_t sum = 0;
      for (int i = 0; i < P; ++i) {
        FASTCOMMS_CHECK(v[i] >= 0, kInvalidArgument, prefix, name, "[", i, "] must be >= 0, got ",
                        v[i]);
        FASTCOMMS_CHECK(!__builtin_add_overflow(sum, v[i], &sum), kInvalidArgument, prefix, name,
                        " sum overflows 64 bits: ", join(v));
      }
      return sum;
    };
    g.seq_splits = *req.seq_splits;
    g.head_splits = *req.head_splits;
    g.seq_total = check_splits(g.seq_splits, "seq_splits");
    g.heads_total = check_splits(g.head_splits, "head_splits");
    if (req.mode == 0) {
      FASTCOMMS_CHECK(g.heads_total == n_in, kInvalidArgument, prefix, "head_splits sums to ",
                      g.heads_total, ", x.size(2) is ", req.shape[2],
                      R > 1 ? detail::cat(" (times kv_replicas=", R, ": ", n_in, " virtual heads)")
                            : std::string{});
      FASTCOMMS_CHECK(g.seq_splits[r] == s_in, kInvalidArgument, prefix, "seq_splits[", r, "] is ",
                      g.seq_splits[r], ", x.size(1) is ", s_in,
                      " (mode 0 takes this rank's sequence shard)");
    } else {
      FASTCOMMS_CHECK(g.seq_total == s_in, kInvalidArgument, prefix, "seq_splits sums to ",
                      g.seq_total, ", x.size(1) is ", s_in);
      FASTCOMMS_CHECK(g.head_splits[r] == n_in, kInvalidArgument, prefix, "head_splits[", r,
                      "] is ", g.head_splits[r], ", x.size(2) is ", n_in,
                      " (mode 1 takes this rank's head shard)");
    }
  } else if (req.mode == 0) {
    FASTCOMMS_CHECK(
        n_in % P == 0, kInvalidArgument, prefix, "mode 0 scatters heads: x.size(2)",
        R > 1 ? detail::cat(" * kv_replicas = ", req.shape[2], " * ", R, " = ") : std::string{"="},
        n_in, " is not divisible by world_size=", P,
        R > 1 ? "; choose kv_replicas so that the virtual heads split evenly"
              : "; pass seq_splits and head_splits for uneven shards");
    FASTCOMMS_CHECK(!mul_overflows(s_in, P, &g.seq_total), kInvalidArgument, prefix,
                    "global sequence length x.size(1) * world_size = ", s_in, " * ", P,
                    " overflows 64 bits");
    g.heads_total = n_in;
    g.seq_splits.assign(P, s_in);
    g.head_splits.assign(P, n_in / P);
  } else {
    FASTCOMMS_CHECK(s_in % P == 0, kInvalidArgument, prefix,
                    "mode 1 scatters the sequence: x.size(1)=", s_in,
                    " is not divisible by world_size=", P,
                    "; pass seq_splits and head_splits for uneven shards");
    FASTCOMMS_CHECK(!mul_overflows(n_in, P, &g.heads_total), kInvalidArgument, prefix,
                    "global head count x.size(2) * world_size = ", n_in, " * ", P,
                    " overflows 64 bits");
    g.seq_total = s_in;
    g.seq_splits.assign(P, s_in / P);
    g.head_splits.assign(P, n_in);
  }

  if (R > 1) {
    FASTCOMMS_CHECK(g.heads_total % R == 0, kInvalidArgument, prefix, "kv_replicas=", R,
                    " must divide the global (virtual) head count, got ", g.heads_total);
  }
  const int64_t src_heads = g.heads_total / R;  // heads of a mode-0 x

  // Every offset and size below is bounded by the global tensor's byte count, so checking that
  // one product is enough to rule out overflow everywhere.
  int64_t total = g.b;
  const bool overflow = mul_overflows(total, g.seq_total, &total) ||
                        mul_overflows(total, g.heads_total, &total) ||
                        mul_overflows(total, g.d, &total) || mul_overflows(total, e, &total);
  FASTCOMMS_CHECK(!overflow, kInvalidArgument, prefix,
                  "the global tensor's byte count overflows 64 bits: b=", g.b,
                  " * s_global=", g.seq_total, " * n_global=", g.heads_total, " * d=", g.d,
                  " * element_size=", e);
  FASTCOMMS_CHECK(total > 0, kInvalidArgument, prefix, "every shard is empty: b=", g.b,
                  ", s_global=", g.seq_total, ", n_global=", g.heads_total, ", d=", g.d,
                  "; nothing to exchange");
  if (req.path == Path::kPeerToPeer) {
    FASTCOMMS_CHECK((g.d * e) % 16 == 0, kInvalidArgument, prefix,
                    "the peer-to-peer path needs d * element_size to be a multiple of 16 bytes, "
                    "got d=",
                    g.d, " * ", e, " = ", g.d * e,
                    " bytes; use the collective transport for this shape");
  }

  g.seq_offsets.assign(P, 0);
  g.head_offsets.assign(P, 0);
  for (int i = 1; i < P; ++i) {
    g.seq_offsets[i] = g.seq_offsets[i - 1] + g.seq_splits[i - 1];
    g.head_offsets[i] = g.head_offsets[i - 1] + g.head_splits[i - 1];
  }
  if (R > 1) {  // NOTE [kv replicas]: no rank receives one source head twice
    for (int q = 0; q < P; ++q) {
      if (g.head_splits[q] == 0) continue;
      const int64_t first = g.head_offsets[q] / R,
                    last = (g.head_offsets[q] + g.head_splits[q] - 1) / R;
      FASTCOMMS_CHECK(last - first + 1 == g.head_splits[q], kInvalidArgument, prefix,
                      "kv_replicas=", R, " gives rank ", q, " virtual heads [", g.head_offsets[q],
                      ", ", g.head_offsets[q] + g.head_splits[q], "), which repeat source head ",
                      first,
                      "; expected every rank's virtual heads to be distinct source heads (for ",
                      src_heads, " KV heads on ", P, " ranks: kv_replicas = ", P, " / ", src_heads,
                      " with one virtual head per rank)");
    }
  }
  return g;
}

// See NOTE [copy descriptor invariants] in the header.
CopyDesc normalize(CopyDesc c) {
  if (c.width <= 0 || c.height <= 0 || c.depth <= 0) return CopyDesc{};
  bool changed = true;
  while (changed) {
    changed = false;
    if (c.height == 1 && c.depth > 1) {  // slices become rows
      c.height = c.depth;
      c.src_pitch = c.src_slice_pitch;
      c.dst_pitch = c.dst_slice_pitch;
      c.depth = 1;
      changed = true;
    }
    if (c.depth > 1 && c.src_slice_pitch == c.src_pitch * c.height &&
        c.dst_slice_pitch == c.dst_pitch * c.height) {  // evenly spaced slices fold into rows
      c.height *= c.depth;
      c.depth = 1;
      changed = true;
    }
    if (c.height > 1 && c.src_pitch == c.width && c.dst_pitch == c.width) {  // contiguous rows
      c.width *= c.height;
      c.height = 1;
      changed = true;
    }
  }
  if (c.height == 1) c.src_pitch = c.dst_pitch = c.width;
  if (c.depth == 1) {
    c.src_slice_pitch = c.src_pitch * c.height;
    c.dst_slice_pitch = c.dst_pitch * c.height;
  }
  return c;
}

// One side of a copy: slices of `rows` rows `pitch` bytes apart (so rows * pitch bytes between
// slices), the first byte at `offset`.
struct Side {
  int64_t offset, pitch, rows;
};

// The copy of `height` rows of `width` bytes in each of `depth` slices from `src` to `dst`.
CopyDesc copy_rows(Side src, Side dst, int64_t width, int64_t height, int64_t depth) {
  return {.src_offset = src.offset,
          .src_pitch = src.pitch,
          .src_slice_pitch = src.rows * src.pitch,
          .dst_offset = dst.offset,
          .dst_pitch = dst.pitch,
          .dst_slice_pitch = dst.rows * dst.pitch,
          .width = width,
          .height = height,
          .depth = depth};
}

uint64_t hash_mix(uint64_t h, int64_t v) {
  // FNV-1a over the 8 bytes of v.
  for (int i = 0; i < 8; ++i) {
    h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xffu;
    h *= 0x100000001b3ull;
  }
  return h;
}

}  // namespace

int64_t CopyDesc::src_extent() const noexcept {
  if (empty()) return 0;
  return src_offset + (depth - 1) * src_slice_pitch + (height - 1) * src_pitch + width;
}

int64_t CopyDesc::dst_extent() const noexcept {
  if (empty()) return 0;
  return dst_offset + (depth - 1) * dst_slice_pitch + (height - 1) * dst_pitch + width;
}

std::array<int64_t, 4> ulysses_output_shape(const UlyssesRequest& req) {
  const UlyssesPlan g = resolve(req);
  if (req.mode == 0) return {g.b, g.seq_total, g.head_splits[req.rank], g.d};
  return {g.b, g.seq_splits[req.rank], g.heads_total, g.d};
}

UlyssesPlan make_ulysses_plan(const UlyssesRequest& req) {
  UlyssesPlan p = resolve(req);
  const int P = req.world_size;
  const int r = req.rank;
  const int64_t E = p.d * p.element_size;  // bytes per (token, head) row
  const int64_t S = p.seq_total;
  const int64_t N = p.heads_total;

  p.out_shape = req.mode == 0 ? std::array<int64_t, 4>{p.b, S, p.head_splits[r], p.d}
                              : std::array<int64_t, 4>{p.b, p.seq_splits[r], N, p.d};
  p.in_bytes = p.b * req.shape[1] * req.shape[2] * E;
  p.out_bytes = p.b * p.out_shape[1] * p.out_shape[2] * E;
  for (int q = 0; q < P; ++q) {
    const int64_t out_q =
        req.mode == 0 ? p.b * S * p.head_splits[q] * E : p.b * p.seq_splits[q] * N * E;
    p.max_out_bytes = std::max(p.max_out_bytes, out_q);
  }
  uint64_t h = 0xcbf29ce484222325ull;
  for (int64_t v : {int64_t{P}, int64_t{req.mode}, p.b, p.d, p.element_size, p.kv_replicas})
    h = hash_mix(h, v);
  for (int64_t v : p.seq_splits) h = hash_mix(h, v);
  for (int64_t v : p.head_splits) h = hash_mix(h, v);
  p.geometry_key = h;

  const int64_t s_r = p.seq_splits[r], h_r = p.head_splits[r];
  // Mode 0 reads x's rows of Nx = N / R source heads; virtual head v is source head v / R.
  const int64_t Nx = req.mode == 0 ? N / p.kv_replicas : N;
  const auto src_head = [&](int q) {
    return req.mode == 0 ? p.head_offsets[q] / p.kv_replicas : p.head_offsets[q];
  };
  if (req.path == Path::kPeerToPeer) {
    p.puts.resize(P);
    for (int q = 0; q < P; ++q) {
      CopyDesc c;
      if (req.mode == 0) {
        // x_r[:, :, H_q:H_q+h_q, :] -> out_q[:, S_r:S_r+s_r, :, :], out_q is (b, S, h_q, d);
        // with kv replicas x_r's heads start at source head H_q / R (NOTE [kv replicas]).
        const int64_t h_q = p.head_splits[q];
        c = copy_rows({src_head(q) * E, Nx * E, s_r}, {p.seq_offsets[r] * h_q * E, h_q * E, S},
                      h_q * E, s_r, p.b);
      } else {
        // x_r[:, S_q:S_q+s_q, :, :] -> out_q[:, :, H_r:H_r+h_r, :], out_q is (b, s_q, N, d).
        const int64_t s_q = p.seq_splits[q];
        c = copy_rows({p.seq_offsets[q] * h_r * E, h_r * E, S}, {p.head_offsets[r] * E, N * E, s_q},
                      h_r * E, s_q, p.b);
      }
      p.puts[q] = normalize(c);
    }
    return p;
  }

  // Collective path. A chunk is always laid out as (b, s, h, d) for the (s, h) block it carries,
  // so packing is one pitched copy and unpacking another.
  p.pack.resize(P);
  p.unpack.resize(P);
  p.send_counts.resize(P);
  p.send_displs.resize(P);
  p.recv_counts.resize(P);
  p.recv_displs.resize(P);
  int64_t send_off = 0, recv_off = 0;  // elements
  for (int q = 0; q < P; ++q) {
    const int64_t s_q = p.seq_splits[q], h_q = p.head_splits[q];
    const int64_t send_count =
        req.mode == 0 ? p.b * s_r * h_q * p.d : p.b * s_q * h_r * p.d;  // chunk r -> q
    const int64_t recv_count =
        req.mode == 0 ? p.b * s_q * h_r * p.d : p.b * s_r * h_q * p.d;  // chunk q -> r
    p.send_counts[q] = send_count;
    p.send_displs[q] = send_off;
    p.recv_counts[q] = recv_count;
    p.recv_displs[q] = recv_off;
    CopyDesc pk, up;
    if (req.mode == 0) {
      // pack: x_r[:, :, H_q:H_q+h_q, :] -> chunk (b, s_r, h_q, d)
      pk = copy_rows({src_head(q) * E, Nx * E, s_r}, {send_off * p.element_size, h_q * E, s_r},
                     h_q * E, s_r, p.b);
      // unpack: chunk (b, s_q, h_r, d) -> out[:, S_q:S_q+s_q, :, :], out is (b, S, h_r, d)
      up = copy_rows({recv_off * p.element_size, s_q * h_r * E, p.b},
                     {p.seq_offsets[q] * h_r * E, S * h_r * E, p.b}, s_q * h_r * E, p.b, 1);
    } else {
      // pack: x_r[:, S_q:S_q+s_q, :, :] -> chunk (b, s_q, h_r, d)
      pk = copy_rows({p.seq_offsets[q] * h_r * E, S * h_r * E, p.b},
                     {send_off * p.element_size, s_q * h_r * E, p.b}, s_q * h_r * E, p.b, 1);
      // unpack: chunk (b, s_r, h_q, d) -> out[:, :, H_q:H_q+h_q, :], out is (b, s_r, N, d)
      up = copy_rows({recv_off * p.element_size, h_q * E, s_r}, {p.head_offsets[q] * E, N * E, s_r},
                     h_q * E, s_r, p.b);
    }
    p.pack[q] = normalize(pk);
    p.unpack[q] = normalize(up);
    send_off += send_count;
    recv_off += recv_count;
  }
  p.send_elems = send_off;
  p.recv_elems = recv_off;
  return p;
}

std::vector<CopyDesc> split_desc(const CopyDesc& c, int parts) {
  std::vector<CopyDesc> out;
  if (c.empty()) return out;
  parts = std::max(parts, 1);
  const auto ranges = [&](int64_t n, int64_t align) {
    // Up to `parts` ranges of [0, n) whose starts are multiples of `align`.
    std::vector<std::pair<int64_t, int64_t>> r;
    const int64_t units = (n + align - 1) / align;
    const int64_t k = std::min<int64_t>(parts, units);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t b = units * i / k * align, e = std::min(n, units * (i + 1) / k * align);
      if (e > b) r.emplace_back(b, e - b);
    }
    return r;
  };
  if (c.depth >= parts) {
    for (auto [b, n] : ranges(c.depth, 1)) {
      CopyDesc d = c;
      d.src_offset += b * c.src_slice_pitch;
      d.dst_offset += b * c.dst_slice_pitch;
      d.depth = n;
      out.push_back(d);
    }
  } else if (c.height > 1) {
    for (auto [b, n] : ranges(c.height, 1)) {
      CopyDesc d = c;
      d.src_offset += b * c.src_pitch;
      d.dst_offset += b * c.dst_pitch;
      d.height = n;
      if (d.depth == 1) {
        d.src_slice_pitch = d.src_pitch * d.height;
        d.dst_slice_pitch = d.dst_pitch * d.height;
      }
      out.push_back(d);
    }
  } else {  // one row per slice and depth < parts: split the flat run (16-byte aligned cuts)
    for (int64_t z = 0; z < c.depth; ++z) {
      for (auto [b, n] : ranges(c.width, 16)) {
        CopyDesc d = c;
        d.src_offset += z * c.src_slice_pitch + b;
        d.dst_offset += z * c.dst_slice_pitch + b;
        d.width = n;
        d.depth = 1;
        d.src_pitch = d.dst_pitch = n;
        d.src_slice_pitch = d.dst_slice_pitch = n;
        out.push_back(d);
      }
    }
  }
  return out;
}

void copy_host(const CopyDesc& c, const void* src, void* dst) {
  if (c.empty()) return;
  const auto* s = static_cast<const unsigned char*>(src) + c.src_offset;
  auto* t = static_cast<unsigned char*>(dst) + c.dst_offset;
  for (int64_t z = 0; z < c.depth; ++z) {
    for (int64_t y = 0; y < c.height; ++y) {
      std::memcpy(t + z * c.dst_slice_pitch + y * c.dst_pitch,
                  s + z * c.src_slice_pitch + y * c.src_pitch, static_cast<size_t>(c.width));
    }
  }
}

std::string to_string(const CopyDesc& c) {
  std::ostringstream os;
  if (c.empty()) return "(empty)";
  os << c.bytes() << " B: " << c.depth << " x " << c.height << " x " << c.width << " B, src @"
     << c.src_offset << " pitch " << c.src_pitch << " slice " << c.src_slice_pitch << ", dst @"
     << c.dst_offset << " pitch " << c.dst_pitch << " slice " << c.dst_slice_pitch;
  return os.str();
}

}  // namespace fastcomms::plan
