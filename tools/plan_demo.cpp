// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Host demo of the Ulysses layout contract: plans an all-to-all for every rank of a simulated
// world, replays the descriptors with memcpy, and checks the result against the reference.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <sstream>
#include <string>

#include "fastcomms/error.hpp"
#include "fastcomms/plan/reference.hpp"
#include "fastcomms/plan/simulate.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"

using namespace fastcomms;
using namespace fastcomms::plan;

namespace {

const char* kUsage =
    "usage: fastcomms-plan-demo [--world P] [--shape b,s,h,d] [--mode 0|1] [--dtype NAME]\n"
    "                           [--seq-splits a,b,..] [--head-splits a,b,..]\n"
    "                           [--path p2p|collective|both] [--verbose]\n"
    "  --shape       mode 0's input on each rank: (b, s_local, h_global, d) (default "
    "1,1024,40,128)\n"
    "  --dtype       float16 bfloat16 float32 float64 float8_e4m3fn float8_e5m2 int8 uint8 int32\n"
    "  --seq-splits/--head-splits  uneven shards, both or neither (they override s and h)\n";

std::vector<int64_t> parse_list(const std::string& text, const char* flag) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    char* end = nullptr;
    const long long v = std::strtoll(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0') {
      throw Error(ErrorCode::kInvalidArgument,
                  detail::cat(flag, ": '", item, "' is not an integer (in '", text, "')"));
    }
    out.push_back(v);
  }
  return out;
}

int64_t dtype_size(const std::string& name) {
  static const std::pair<const char*, int64_t> kTable[] = {
      {"float16", 2},     {"bfloat16", 2}, {"float32", 4}, {"float64", 8}, {"float8_e4m3fn", 1},
      {"float8_e5m2", 1}, {"int8", 1},     {"uint8", 1},   {"int32", 4},   {"bf16", 2},
      {"fp16", 2},        {"fp32", 4},     {"fp8", 1}};
  for (const auto& [n, s] : kTable)
    if (name == n) return s;
  throw Error(ErrorCode::kInvalidArgument, "--dtype: unknown dtype '" + name + "'");
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, units[u]);
  return buf;
}

int run(int argc, char** argv) {
  int P = 4, mode = 0;
  std::vector<int64_t> shape = {1, 1024, 40, 128};
  std::string dtype = "bfloat16", path_name = "both";
  std::optional<std::vector<int64_t>> seq, heads;
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(ErrorCode::kInvalidArgument, a + " needs a value");
      return argv[++i];
    };
    if (a == "--world" || a == "--nproc")
      P = static_cast<int>(parse_list(value(), "--world").at(0));
    else if (a == "--shape")
      shape = parse_list(value(), "--shape");
    else if (a == "--mode")
      mode = static_cast<int>(parse_list(value(), "--mode").at(0));
    else if (a == "--dtype")
      dtype = value();
    else if (a == "--seq-splits")
      seq = parse_list(value(), "--seq-splits");
    else if (a == "--head-splits")
      heads = parse_list(value(), "--head-splits");
    else if (a == "--path")
      path_name = value();
    else if (a == "--verbose" || a == "-v")
      verbose = true;
    else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      throw Error(ErrorCode::kInvalidArgument, "unknown argument '" + a + "'\n" + kUsage);
    }
  }
  if (shape.size() != 4)
    throw Error(ErrorCode::kInvalidArgument,
                detail::cat("--shape needs 4 values b,s,h,d, got ", shape.size()));
  if (P < 1 || P > 1024)
    throw Error(ErrorCode::kInvalidArgument, detail::cat("--world must be in [1, 1024], got ", P));
  if (path_name != "p2p" && path_name != "collective" && path_name != "both")
    throw Error(ErrorCode::kInvalidArgument, "--path must be p2p, collective or both");
  if (seq.has_value() != heads.has_value())
    throw Error(ErrorCode::kInvalidArgument, "--seq-splits and --head-splits go together");

  WorldSpec spec;
  spec.world_size = P;
  spec.mode = mode;
  spec.b = shape[0];
  spec.d = shape[3];
  spec.element_size = dtype_size(dtype);
  if (seq) {
    spec.seq_splits = *seq;
    spec.head_splits = *heads;
    if (static_cast<int>(seq->size()) != P || static_cast<int>(heads->size()) != P)
      throw Error(ErrorCode::kInvalidArgument,
                  detail::cat("--seq-splits and --head-splits need ", P, " entries each"));
  } else {
    if (shape[2] % P != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  detail::cat("h=", shape[2], " is not divisible by --world ", P,
                              "; give --seq-splits and --head-splits"));
    spec.seq_splits.assign(P, shape[1]);
    spec.head_splits.assign(P, shape[2] / P);
    spec.pass_splits = false;
  }
  for (int r = 0; r < P; ++r) make_ulysses_plan(spec.request(r, Path::kCollective));  // validate

  std::printf("Ulysses all-to-all, mode %d, %d ranks, %s (%lld B/element)\n", mode, P,
              dtype.c_str(), static_cast<long long>(spec.element_size));
  RankBuffers in(P);
  std::mt19937_64 rng(std::random_device{}());
  int64_t total_in = 0;
  for (int r = 0; r < P; ++r) {
    const auto s = spec.input_shape(r);
    in[r].resize(static_cast<size_t>(s[0] * s[1] * s[2] * s[3] * spec.element_size));
    for (auto& byte : in[r]) byte = static_cast<std::byte>(rng());
    total_in += static_cast<int64_t>(in[r].size());
  }
  const auto t0 = std::chrono::steady_clock::now();
  const RankBuffers want = reference_all_to_all_4d(mode, spec.b, spec.d, spec.element_size,
                                                   spec.seq_splits, spec.head_splits, in);
  const double ref_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();

  bool all_ok = true;
  for (Path path : {Path::kPeerToPeer, Path::kCollective}) {
    const bool p2p = path == Path::kPeerToPeer;
    if ((p2p && path_name == "collective") || (!p2p && path_name == "p2p")) continue;
    const char* name = p2p ? "peer-to-peer" : "collective";
    if (p2p && (spec.d * spec.element_size) % 16 != 0) {
      std::printf("\n[%s] skipped: d * element_size = %lld is not a multiple of 16 bytes\n", name,
                  static_cast<long long>(spec.d * spec.element_size));
      continue;
    }
    const unsigned char poison = static_cast<unsigned char>(rng());
    const auto t1 = std::chrono::steady_clock::now();
    SimResult res = simulate_world(spec, path, in, poison);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t1).count();
    const UlyssesPlan& p0 = res.plans[0];
    std::printf(
        "\n[%s] rank 0's input %s, output %s; bytes going from rank (row) to peer "
        "(column):\n",
        name,
        [&] {
          std::string s = "(";
          for (int i = 0; i < 4; ++i) s += detail::cat(i ? ", " : "", p0.in_shape[i]);
          return s + ")";
        }()
            .c_str(),
        [&] {
          std::string s = "(";
          for (int i = 0; i < 4; ++i) s += detail::cat(i ? ", " : "", p0.out_shape[i]);
          return s + ")";
        }()
            .c_str());
    const int shown = std::min(P, 16);
    std::printf("%8s", "");
    for (int q = 0; q < shown; ++q) std::printf(" %12s", detail::cat("peer ", q).c_str());
    std::printf("\n");
    for (int r = 0; r < shown; ++r) {
      std::printf("%8s", detail::cat("rank ", r).c_str());
      for (int q = 0; q < shown; ++q) {
        const UlyssesPlan& p = res.plans[r];
        const int64_t bytes = p2p ? p.puts[q].bytes() : p.send_counts[q] * p.element_size;
        std::printf(" %12s", human_bytes(static_cast<double>(bytes)).c_str());
      }
      std::printf("\n");
    }
    if (shown < P) std::printf("  (first %d of %d ranks shown)\n", shown, P);
    if (verbose) {
      for (int q = 0; q < P; ++q) {
        if (p2p)
          std::printf("  rank 0 put -> %d: %s\n", q, to_string(p0.puts[q]).c_str());
        else
          std::printf("  rank 0 pack -> %d: %s\n  rank 0 unpack <- %d: %s\n", q,
                      to_string(p0.pack[q]).c_str(), q, to_string(p0.unpack[q]).c_str());
      }
    }
    const bool ok = res.error.empty() && res.outputs == want;
    all_ok = all_ok && ok;
    std::printf("check: %s — %d ranks, %s moved, replay %.1f ms, reference %.1f ms%s%s\n",
                ok ? "OK, bit-exact against permute + all_to_all_single + permute" : "MISMATCH", P,
                human_bytes(static_cast<double>(total_in)).c_str(), ms, ref_ms,
                res.error.empty() ? "" : ": ", res.error.c_str());
  }
  return all_ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const Error& e) {
    std::fprintf(stderr, "fastcomms-plan-demo: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fastcomms-plan-demo: %s\n", e.what());
    return 2;
  }
}
