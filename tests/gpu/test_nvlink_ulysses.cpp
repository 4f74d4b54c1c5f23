// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// GPU tier: the peer-to-peer Ulysses all-to-all over NVLink, bit-exact against the plan's host
// reference, for world sizes 2, 3 and 4 (ranks share GPUs when there are fewer GPUs than ranks).
// Random geometries (uneven and empty shards, element sizes 1/2/4/8, both modes), both engines,
// copying and zero-copy outputs, each run twice under different poisons so an unwritten byte
// shows; 20 rounds on one window; a mismatched call must be flagged on every rank.
// Prints one summary line per case; exits 77 (SKIPPED) without a GPU. With one GPU every rank
// shares it (IPC within one device, no NVLink): the cases that need a GPU per rank (the memop
// barriers) say SKIPPED, the rest run.
#include <chrono>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>

#include "backends/nvlink/nvlink_transport.hpp"
#include "backends/nvlink/nvlink_ulysses.hpp"
#include "fastcomms/cuda/nvml.hpp"
#include "fastcomms/plan/reference.hpp"
#include "tests/common/gpu_world.hpp"

using namespace fastcomms;

namespace {

struct Geo {
  int mode;
  int64_t b, d, e;
  std::vector<int64_t> seq, heads;
  bool splits;
};

Geo random_geo(int P, std::mt19937_64& rng) {
  auto pick = [&](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  static const int64_t kE[] = {1, 2, 4, 8};
  Geo g;
  g.mode = static_cast<int>(pick(0, 1));
  g.e = kE[pick(0, 3)];
  g.b = pick(1, 3);
  g.d = (16 / g.e) * pick(1, 4);
  g.splits = pick(0, 3) != 0;
  for (int r = 0; r < P; ++r) {
    g.seq.push_back(g.splits ? pick(0, 40) : 0);
    g.heads.push_back(g.splits ? pick(0, 6) : 0);
  }
  g.seq[pick(0, P - 1)] += 1;
  g.heads[pick(0, P - 1)] += 1;
  if (!g.splits) {
    g.seq.assign(P, pick(1, 40));
    g.heads.assign(P, pick(1, 6));
  }
  return g;
}

// The index of the first byte where `got` and `want` differ (their size when none does).
size_t first_difference(const std::vector<std::byte>& got, const std::vector<std::byte>& want) {
  size_t i = 0;
  while (i < got.size() && i < want.size() && got[i] == want[i]) ++i;
  return i;
}

DType dtype_for(int64_t e) {
  return e == 1   ? DType::kUInt8
         : e == 2 ? DType::kBFloat16
         : e == 4 ? DType::kFloat32
                  : DType::kFloat64;
}

std::array<int64_t, 4> in_shape(const Geo& g, int r) {
  int64_t S = 0, N = 0;
  for (auto v : g.seq) S += v;
  for (auto v : g.heads) N += v;
  return g.mode == 0 ? std::array<int64_t, 4>{g.b, g.seq[r], N, g.d}
                     : std::array<int64_t, 4>{g.b, S, g.heads[r], g.d};
}

NvlinkUlyssesOptions group_options(int rank, int P, int device, std::shared_ptr<Store> store,
                                   const char* name) {
  NvlinkUlyssesOptions o;
  o.rank = rank;
  o.size = P;
  o.device = device;
  o.store = std::move(store);
  o.name = name;
  o.timeout = std::chrono::seconds(60);
  return o;
}

// window_race: two copying calls back to back, no host sync between them, while rank 0 reads its
// window slowly (20 ms before its copy-out). The entry barrier must keep rank 1's second call from
// overwriting rank 0's window before that copy-out. Returns the number of mismatching calls seen on
// this rank; with `armed` the entry barrier is skipped (the control, which must tear).
int window_race(int rank, int P, int device, std::shared_ptr<Store> store, uint64_t seed,
                bool armed) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  NvlinkUlysses group(group_options(rank, P, device, store, armed ? "race-armed" : "race"));
  NvlinkUlysses::DebugFaults f;
  f.skip_entry_barrier = armed;
  if (rank == 0) f.delay_before_copy_out_ns = 20'000'000;
  group.set_debug_faults(f);
  cuda::Stream stream;
  const int64_t heads = 2 * P, s_local = 256, d = 128;
  std::vector<int64_t> seq(P, s_local), hs(P, 2);
  const Device dev{DeviceType::kCUDA, device};
  const size_t in_bytes = static_cast<size_t>(s_local * heads * d * 2);
  int bad = 0;
  for (int round = 0; round < 3; ++round) {
    plan::RankBuffers in_a(P), in_b(P);
    std::mt19937_64 drng(seed + 77 * round);
    for (int r = 0; r < P; ++r) {
      in_a[r].resize(in_bytes);
      in_b[r].resize(in_bytes);
      for (auto& byte : in_a[r]) byte = static_cast<std::byte>(drng());
      for (auto& byte : in_b[r]) byte = static_cast<std::byte>(drng());
    }
    const auto want_a = plan::reference_all_to_all_4d(0, 1, d, 2, seq, hs, in_a);
    const auto want_b = plan::reference_all_to_all_4d(0, 1, d, 2, seq, hs, in_b);
    cuda::DeviceBuffer xa(in_bytes), xb(in_bytes), oa(want_a[rank].size()), ob(want_b[rank].size());
    gpu_test::upload(xa.get(), in_a[rank].data(), in_bytes);
    gpu_test::upload(xb.get(), in_b[rank].data(), in_bytes);
    const std::vector<int64_t> xs = {1, s_local, heads, d}, os = {1, s_local * P, 2, d};
    FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
    group.all_to_all_4d(TensorView::contiguous(xa.get(), DType::kBFloat16, xs, dev),
                        TensorView::contiguous(oa.get(), DType::kBFloat16, os, dev), UlyssesArgs{},
                        stream.get(), TransferEngine::kCopyEngine);
    group.all_to_all_4d(TensorView::contiguous(xb.get(), DType::kBFloat16, xs, dev),
                        TensorView::contiguous(ob.get(), DType::kBFloat16, os, dev), UlyssesArgs{},
                        stream.get(), TransferEngine::kCopyEngine);
    std::vector<std::byte> ga(want_a[rank].size()), gb(want_b[rank].size());
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    FASTCOMMS_CUDA_CHECK(cudaMemcpy(ga.data(), oa.get(), ga.size(), cudaMemcpyDeviceToHost));
    FASTCOMMS_CUDA_CHECK(cudaMemcpy(gb.data(), ob.get(), gb.size(), cudaMemcpyDeviceToHost));
    bad += (ga != want_a[rank]) + (gb != want_b[rank]);
  }
  group.check_errors();
  return bad;
}

constexpr int64_t kAll = std::numeric_limits<int64_t>::max();  // clamped to the capacity

int rank_main(int rank, int P, int device, std::shared_ptr<Store> store, uint64_t seed) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  NvlinkUlysses group(group_options(rank, P, device, store, "t"));
  cuda::Stream stream;
  std::mt19937_64 rng(seed);  // same sequence on every rank
  int checked = 0, failures = 0;
  void* user = group.empty_output(8 << 20);  // zero-copy destination, reused
  for (int gi = 0; gi < 60; ++gi) {
    const Geo g = random_geo(P, rng);
    const uint64_t data_seed = rng();
    plan::RankBuffers inputs(P);
    std::mt19937_64 drng(data_seed);
    for (int r = 0; r < P; ++r) {
      const auto s = in_shape(g, r);
      inputs[r].resize(static_cast<size_t>(s[0] * s[1] * s[2] * s[3] * g.e));
      for (auto& byte : inputs[r]) byte = static_cast<std::byte>(drng());
    }
    const auto want = plan::reference_all_to_all_4d(g.mode, g.b, g.d, g.e, g.seq, g.heads, inputs);
    const auto s = in_shape(g, rank);
    const DType dt = dtype_for(g.e);
    // Every fifth geometry moves x and a non-window out off 16-byte alignment by one element.
    const size_t shift = gi % 5 == 4 ? static_cast<size_t>(g.e) : 0;
    cuda::DeviceBuffer xin(inputs[rank].size() + 16);
    auto* x_ptr = static_cast<std::byte*>(xin.get()) + shift;
    gpu_test::upload(x_ptr, inputs[rank].data(), inputs[rank].size());
    TensorView x = TensorView::contiguous(x_ptr, dt, {s[0], s[1], s[2], s[3]},
                                          Device{DeviceType::kCUDA, device});
    UlyssesArgs args;
    args.mode = g.mode;
    if (g.splits) {
      args.seq_splits = g.seq;
      args.head_splits = g.heads;
    }
    const auto os = group.output_shape(x, args);
    const size_t out_bytes = static_cast<size_t>(os[0] * os[1] * os[2] * os[3] * g.e);
    const bool zero_copy = gi % 4 == 1;  // crosses every engine (gi % 3)
    cuda::DeviceBuffer own(out_bytes + 16);
    void* out_ptr = zero_copy ? user : static_cast<std::byte*>(own.get()) + shift;
    TensorView out = TensorView::contiguous(out_ptr, dt, {os[0], os[1], os[2], os[3]},
                                            Device{DeviceType::kCUDA, device});
    const TransferEngine engine = gi % 3 == 0   ? TransferEngine::kSM
                                  : gi % 3 == 1 ? TransferEngine::kCopyEngine
                                                : TransferEngine::kHybrid;
    // SM geometries alternate between the flagged path and the barrier (fused) path.
    const bool flagged = (gi / 3) % 2 == 0;
    group.set_flagged_max_bytes(flagged ? kAll : 0);
    for (unsigned char poison : {0xA5, 0x5A}) {
      FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(out_ptr, poison, out_bytes, stream.get()));
      group.all_to_all_4d(x, out, args, stream.get(), engine);
      std::vector<std::byte> got(out_bytes);
      FASTCOMMS_CUDA_CHECK(
          cudaMemcpyAsync(got.data(), out_ptr, out_bytes, cudaMemcpyDeviceToHost, stream.get()));
      FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      group.check_errors();
      if (got != want[rank]) {
        ++failures;
        const size_t first = first_difference(got, want[rank]);
        std::fprintf(stderr,
                     "rank %d: geometry %d MISMATCH (mode %d e %lld b %lld d %lld engine %s "
                     "zero_copy %d flagged allowed %d poison %02x) first differing byte %zu of "
                     "%zu\n",
                     rank, gi, g.mode, (long long)g.e, (long long)g.b, (long long)g.d,
                     engine == TransferEngine::kSM       ? "sm"
                     : engine == TransferEngine::kHybrid ? "hybrid"
                                                         : "ce",
                     zero_copy, flagged, poison, first, got.size());
      }
      ++checked;
    }
  }
  // 20 rounds on one window with fresh data each round.
  {
    const int64_t heads = 4 * P, s_local = 64, d = 64;
    std::vector<int64_t> seq(P, s_local), hs(P, heads / P);
    for (int round = 0; round < 20; ++round) {
      plan::RankBuffers inputs(P);
      std::mt19937_64 drng(seed + 1000 + round);
      for (int r = 0; r < P; ++r) {
        inputs[r].resize(static_cast<size_t>(s_local * heads * d * 2));
        for (auto& byte : inputs[r]) byte = static_cast<std::byte>(drng());
      }
      const auto want = plan::reference_all_to_all_4d(0, 1, d, 2, seq, hs, inputs);
      cuda::DeviceBuffer xin(inputs[rank].size()), obuf(want[rank].size());
      gpu_test::upload(xin.get(), inputs[rank].data(), inputs[rank].size());
      const Device dev{DeviceType::kCUDA, device};
      TensorView x =
          TensorView::contiguous(xin.get(), DType::kBFloat16, {1, s_local, heads, d}, dev);
      TensorView out =
          TensorView::contiguous(obuf.get(), DType::kBFloat16, {1, s_local * P, heads / P, d}, dev);
      FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(obuf.get(), 0xEE, obuf.size(), stream.get()));
      const TransferEngine engines[] = {TransferEngine::kSM, TransferEngine::kCopyEngine,
                                        TransferEngine::kHybrid, TransferEngine::kAuto};
      group.set_flagged_max_bytes(round % 8 < 4 ? kAll : 0);
      group.all_to_all_4d(x, out, UlyssesArgs{}, stream.get(), engines[round % 4]);
      std::vector<std::byte> got(want[rank].size());
      FASTCOMMS_CUDA_CHECK(cudaMemcpyAsync(got.data(), obuf.get(), got.size(),
                                           cudaMemcpyDeviceToHost, stream.get()));
      FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      group.check_errors();
      if (got != want[rank]) {
        ++failures;
        std::fprintf(stderr, "rank %d: round %d MISMATCH\n", rank, round);
      }
      ++checked;
    }
  }
  // CUDA graph: capture one zero-copy call, replay it with fresh inputs; the device epoch must
  // advance once per replay and every replay must be bit-exact.
  int graph_checked = 0;
  {
    const int64_t heads = 2 * P, s_local = 48, d = 64;
    std::vector<int64_t> seq(P, s_local), hs(P, 2);
    const Device dev{DeviceType::kCUDA, device};
    const size_t in_bytes = static_cast<size_t>(s_local * heads * d * 2);
    cuda::DeviceBuffer xin(in_bytes);
    TensorView x = TensorView::contiguous(xin.get(), DType::kBFloat16, {1, s_local, heads, d}, dev);
    TensorView out = TensorView::contiguous(user, DType::kBFloat16, {1, s_local * P, 2, d}, dev);
    // SM flagged, SM fused (barriers), copy engines
    const std::pair<TransferEngine, bool> runs[] = {{TransferEngine::kSM, true},
                                                    {TransferEngine::kSM, false},
                                                    {TransferEngine::kCopyEngine, false}};
    for (const auto& [engine, flagged] : runs) {
      group.set_flagged_max_bytes(flagged ? kAll : 0);
      FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      FASTCOMMS_CUDA_CHECK(cudaStreamBeginCapture(stream.get(), cudaStreamCaptureModeThreadLocal));
      group.all_to_all_4d(x, out, UlyssesArgs{}, stream.get(), engine);
      FASTCOMMS_CUDA_CHECK(cudaStreamEndCapture(stream.get(), &graph));
      FASTCOMMS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const uint64_t e0 = group.device_epoch();
      const int replays = 5;
      for (int rep = 0; rep < replays; ++rep) {
        plan::RankBuffers inputs(P);
        std::mt19937_64 drng(seed + 5000 + rep + 100 * static_cast<int>(engine) + 7 * flagged);
        for (int r = 0; r < P; ++r) {
          inputs[r].resize(in_bytes);
          for (auto& byte : inputs[r]) byte = static_cast<std::byte>(drng());
        }
        const auto want = plan::reference_all_to_all_4d(0, 1, d, 2, seq, hs, inputs);
        gpu_test::upload(xin.get(), inputs[rank].data(), in_bytes);
        FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(user, 0x3C, want[rank].size(), stream.get()));
        FASTCOMMS_CUDA_CHECK(cudaGraphLaunch(exec, stream.get()));
        std::vector<std::byte> got(want[rank].size());
        FASTCOMMS_CUDA_CHECK(
            cudaMemcpyAsync(got.data(), user, got.size(), cudaMemcpyDeviceToHost, stream.get()));
        FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
        group.check_errors();
        if (got != want[rank]) {
          ++failures;
          std::fprintf(stderr, "rank %d: graph replay %d MISMATCH\n", rank, rep);
        }
        ++graph_checked;
      }
      const uint64_t e1 = group.device_epoch();
      if (e1 != e0 + replays) {
        ++failures;
        std::fprintf(stderr, "rank %d: device epoch went %llu -> %llu over %d replays\n", rank,
                     (unsigned long long)e0, (unsigned long long)e1, replays);
      }
      FASTCOMMS_CUDA_CHECK(cudaGraphExecDestroy(exec));
      FASTCOMMS_CUDA_CHECK(cudaGraphDestroy(graph));
    }
  }
  // Mismatched calls must be flagged on every rank: rank 0 believes in other head splits (on the
  // flagged path, then on the barrier path), then the same call with rank 0 alone on the barrier
  // path (NOTE [one call, two paths]: told at once, not by the timeout).
  int mismatch_flagged = 0;
  for (int kind = 0; kind < 3; ++kind) {
    const bool flagged = kind == 0 || (kind == 2 && rank != 0);
    group.set_flagged_max_bytes(flagged ? kAll : 0);
    std::vector<int64_t> seq(P, 8), hs(P, 2);
    if (rank == 0 && kind < 2) {
      hs[0] = 3;
      hs[P - 1] = 1;
    }
    const Device dev{DeviceType::kCUDA, device};
    int64_t N = 2 * P;
    cuda::DeviceBuffer xin(8 * N * 32 * 4), obuf(8 * P * 3 * 32 * 4 + 4096);
    TensorView x = TensorView::contiguous(xin.get(), DType::kFloat32, {1, 8, N, 32}, dev);
    UlyssesArgs args;
    args.seq_splits = seq;
    args.head_splits = hs;
    const auto os = group.output_shape(x, args);
    TensorView out =
        TensorView::contiguous(obuf.get(), DType::kFloat32, {os[0], os[1], os[2], os[3]}, dev);
    const auto t0 = std::chrono::steady_clock::now();
    group.all_to_all_4d(x, out, args, stream.get(), TransferEngine::kSM);
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    bool told = false;
    try {
      group.check_errors();
    } catch (const Error& e) {
      told = std::strstr(e.what(), "ranks disagree") != nullptr;
    }
    mismatch_flagged += told && secs < 5.0;
    if (!told || secs >= 5.0) {
      ++failures;
      std::fprintf(stderr,
                   "rank %d: mismatched call %d (this rank on the %s path) flagged: %d after "
                   "%.2f s (must be flagged, well within the 60 s timeout)\n",
                   rank, kind, flagged ? "flagged" : "barrier", told, secs);
    }
  }
  group.set_flagged_max_bytes(kAll);
  std::printf(
      "rank %d/%d (GPU %d): %d checks, %d graph replays checked, %d failures, mismatch "
      "flagged: %s, host epoch %llu, device epoch %llu, group memory %.1f MiB\n",
      rank, P, device, checked, graph_checked, failures, mismatch_flagged == 3 ? "yes" : "NO",
      static_cast<unsigned long long>(group.epoch()),
      static_cast<unsigned long long>(group.device_epoch()), group.memory_bytes() / 1048576.0);
  return failures == 0 ? 0 : 1;
}

}  // namespace

// ce_ordering: zero-copy calls on the copy engines, each copy-engine stream held back 20 ms. A
// peer's exit barrier announces that its payload has landed, so the output read right after the
// call must be complete. Returns the number of mismatching calls on this rank; with `armed` the
// exit barrier is not ordered after the copy engines (the control, which must tear).
int ce_ordering(int rank, int P, int device, std::shared_ptr<Store> store, uint64_t seed,
                bool armed) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  NvlinkUlysses group(group_options(rank, P, device, store, armed ? "ce-armed" : "ce"));
  NvlinkUlysses::DebugFaults f;
  f.delay_ce_ns = 20'000'000;
  f.skip_ce_join = armed;
  group.set_debug_faults(f);
  cuda::Stream stream;
  const int64_t heads = 2 * P, s_local = 256, d = 128;
  std::vector<int64_t> seq(P, s_local), hs(P, 2);
  const Device dev{DeviceType::kCUDA, device};
  const size_t in_bytes = static_cast<size_t>(s_local * heads * d * 2);
  const size_t out_bytes = in_bytes;  // even shards: the output holds as many bytes
  void* zc = group.empty_output(static_cast<int64_t>(out_bytes));
  int bad = 0;
  for (int round = 0; round < 3; ++round) {
    plan::RankBuffers in(P);
    std::mt19937_64 drng(seed + 31 * round);
    for (int r = 0; r < P; ++r) {
      in[r].resize(in_bytes);
      for (auto& byte : in[r]) byte = static_cast<std::byte>(drng());
    }
    const auto want = plan::reference_all_to_all_4d(0, 1, d, 2, seq, hs, in);
    cuda::DeviceBuffer x(in_bytes);
    gpu_test::upload(x.get(), in[rank].data(), in_bytes);
    FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
    // Poisoned in stream order before the call: peers write only after its entry barrier.
    FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(zc, 0xA5, out_bytes, stream.get()));
    group.all_to_all_4d(
        TensorView::contiguous(x.get(), DType::kBFloat16, {1, s_local, heads, d}, dev),
        TensorView::contiguous(zc, DType::kBFloat16, {1, s_local * P, 2, d}, dev), UlyssesArgs{},
        stream.get(), TransferEngine::kCopyEngine);
    std::vector<std::byte> got(want[rank].size());
    // Read on the call's stream only (a read on the legacy stream would wait for every stream).
    FASTCOMMS_CUDA_CHECK(
        cudaMemcpyAsync(got.data(), zc, got.size(), cudaMemcpyDeviceToHost, stream.get()));
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    bad += got != want[rank];
    FASTCOMMS_CUDA_CHECK(
        cudaDeviceSynchronize());  // the held-back copies land before the next round
    store->set_string(detail::cat("ce_round/", armed, "/", round, "/", rank), "1");
    for (int q = 0; q < P; ++q)
      store->wait({detail::cat("ce_round/", armed, "/", round, "/", q)}, std::chrono::seconds(60));
  }
  group.check_errors();
  return bad;
}

// ce_stress: `calls` copy-engine calls on random geometries scaled up to MiB, copying (some
// misaligned) and zero copy, fresh data and a fresh poison each, with the given barrier kind
// ("memop" or "kernel"); every output compared with the plan's host reference. Returns the
// mismatching calls on this rank.
int ce_stress(int rank, int P, int device, std::shared_ptr<Store> store, uint64_t seed,
              const char* barrier, int calls) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  NvlinkUlysses group(group_options(rank, P, device, store, "ce-stress"));
  group.tune("barrier", barrier);
  cuda::Stream stream;
  const int64_t cap = int64_t{48} << 20;
  void* user = group.empty_output(cap);
  std::mt19937_64 rng(seed);  // same sequence on every rank
  int bad = 0;
  for (int i = 0; i < calls; ++i) {
    Geo g = random_geo(P, rng);
    static const int64_t kScale[] = {1, 8, 32, 96};
    const int64_t scale = kScale[rng() % 4];
    for (auto& v : g.seq) v *= scale;
    g.splits = true;
    const uint64_t data_seed = rng();
    const auto poison = static_cast<unsigned char>(rng());
    plan::RankBuffers inputs(P);
    std::mt19937_64 drng(data_seed);
    for (int r = 0; r < P; ++r) {
      const auto sh = in_shape(g, r);
      inputs[r].resize(static_cast<size_t>(sh[0] * sh[1] * sh[2] * sh[3] * g.e));
      for (auto& byte : inputs[r]) byte = static_cast<std::byte>(drng());
    }
    const auto want = plan::reference_all_to_all_4d(g.mode, g.b, g.d, g.e, g.seq, g.heads, inputs);
    int64_t max_out = 0;
    for (const auto& w : want) max_out = std::max<int64_t>(max_out, static_cast<int64_t>(w.size()));
    const auto sh = in_shape(g, rank);
    const Device dev{DeviceType::kCUDA, device};
    const size_t shift = i % 5 == 4 ? static_cast<size_t>(g.e) : 0;
    cuda::DeviceBuffer xin(inputs[rank].size() + 16), own(want[rank].size() + 16);
    auto* x_ptr = static_cast<std::byte*>(xin.get()) + shift;
    gpu_test::upload(x_ptr, inputs[rank].data(), inputs[rank].size());
    UlyssesArgs args;
    args.mode = g.mode;
    args.seq_splits = g.seq;
    args.head_splits = g.heads;
    TensorView x = TensorView::contiguous(x_ptr, dtype_for(g.e), {sh[0], sh[1], sh[2], sh[3]}, dev);
    const auto os = group.output_shape(x, args);
    const bool zero_copy = i % 2 == 1 && max_out <= cap;  // decided alike on every rank
    void* out_ptr = zero_copy ? user : static_cast<std::byte*>(own.get()) + shift;
    const size_t out_bytes = want[rank].size();
    FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(out_ptr, poison, out_bytes, stream.get()));
    group.all_to_all_4d(
        x, TensorView::contiguous(out_ptr, dtype_for(g.e), {os[0], os[1], os[2], os[3]}, dev), args,
        stream.get(), TransferEngine::kCopyEngine);
    std::vector<std::byte> got(out_bytes);
    FASTCOMMS_CUDA_CHECK(
        cudaMemcpyAsync(got.data(), out_ptr, out_bytes, cudaMemcpyDeviceToHost, stream.get()));
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    group.check_errors();
    if (got != want[rank]) {
      ++bad;
      const size_t first = first_difference(got, want[rank]);
      std::printf(
          "ce_stress (%s) rank %d: call %d MISMATCH (mode %d b %lld d %lld e %lld scale "
          "%lld zero_copy %d shift %zu) first differing byte %zu of %zu\n",
          barrier, rank, i, g.mode, (long long)g.b, (long long)g.d, (long long)g.e,
          (long long)scale, zero_copy, shift, first, got.size());
    }
  }
  std::printf("ce_stress (%s barriers, flush %d) world %d rank %d: %d of %d calls mismatched\n",
              barrier, group.memops_flush(), P, rank, bad, calls);
  return bad;
}

// memop_faults: the copy-engine path's SM-free barriers (NOTE [memop barrier]) under faults, on
// a group with a 1 s timeout. (1) rank 0 runs other head splits: every rank must be told "ranks
// disagree" within 0.9 s (the watchdog reads the differing token; the timeout alone would come
// later and say otherwise); (2) a correct call after it is bit-exact (a new generation on every
// rank); (3) the last rank arrives 2.5 s late: the others must be told of the timeout, their
// streams done, and the late rank must fail on the poison left for it instead of passing on
// stale tokens; (4) a correct call is bit-exact again. Returns the failures on this rank.
int memop_faults(int rank, int P, int device, std::shared_ptr<Store> store, uint64_t seed) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  NvlinkUlyssesOptions o = group_options(rank, P, device, store, "memop-faults");
  o.timeout = std::chrono::seconds(1);
  NvlinkUlysses group(o);
  group.tune("barrier", "memop");
  if (std::string(group.ce_barrier()) != "memop") {
    std::printf("memop_faults rank %d: the copy-engine path uses %s barriers here\n", rank,
                group.ce_barrier());
    return 1;
  }
  cuda::Stream stream;
  const Device dev{DeviceType::kCUDA, device};
  const int64_t s_local = 64, d = 64, heads = 2 * P;
  // Zero copy into one buffer of the same size on every rank, so that ranks that disagree on
  // the geometry never disagree on growing the group window.
  const size_t cap = static_cast<size_t>(4 * s_local * heads * d * 2);
  void* zc = group.empty_output(static_cast<int64_t>(cap));
  int failures = 0;
  // One call; `bad_splits` makes rank 0 believe in other head splits. Returns the error text
  // (empty when none) and the seconds until the stream was done; checks the data when clean.
  auto call = [&](bool bad_splits, int round, double* secs) -> std::string {
    std::vector<int64_t> seq(P, s_local), hs(P, 2);
    if (bad_splits && rank == 0) hs[0] = 3, hs[P - 1] = 1;
    plan::RankBuffers in(P);
    std::mt19937_64 drng(seed + 77 * round);
    const size_t in_bytes = static_cast<size_t>(s_local * heads * d * 2);
    for (int r = 0; r < P; ++r) {
      in[r].resize(in_bytes);
      for (auto& byte : in[r]) byte = static_cast<std::byte>(drng());
    }
    cuda::DeviceBuffer x(in_bytes);
    gpu_test::upload(x.get(), in[rank].data(), in_bytes);
    UlyssesArgs args;
    args.seq_splits = seq;
    args.head_splits = hs;
    TensorView xv = TensorView::contiguous(x.get(), DType::kBFloat16, {1, s_local, heads, d}, dev);
    const auto os = group.output_shape(xv, args);
    const size_t out_bytes = static_cast<size_t>(os[0] * os[1] * os[2] * os[3] * 2);
    FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(zc, 0xA5, out_bytes, stream.get()));
    const auto t0 = std::chrono::steady_clock::now();
    group.all_to_all_4d(
        xv, TensorView::contiguous(zc, DType::kBFloat16, {os[0], os[1], os[2], os[3]}, dev), args,
        stream.get(), TransferEngine::kCopyEngine);
    std::vector<std::byte> got(out_bytes);
    FASTCOMMS_CUDA_CHECK(
        cudaMemcpyAsync(got.data(), zc, out_bytes, cudaMemcpyDeviceToHost, stream.get()));
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream.get()));
    *secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    try {
      group.check_errors();
    } catch (const Error& e) {
      return e.what();
    }
    if (!bad_splits && got != plan::reference_all_to_all_4d(0, 1, d, 2, seq, hs, in)[rank])
      return "MISMATCHING DATA";
    return "";
  };
  auto sync_ranks = [&](const char* tag) {
    store->set_string(detail::cat("memop_faults/", tag, "/", rank), "1");
    for (int q = 0; q < P; ++q)
      store->wait({detail::cat("memop_faults/", tag, "/", q)}, std::chrono::seconds(60));
  };
  double secs = 0;
  std::string e = call(true, 1, &secs);
  if (e.find("ranks disagree") == std::string::npos || secs > 0.9) {
    ++failures;
    std::printf("memop_faults rank %d: mismatch told as '%s' after %.2f s\n", rank, e.c_str(),
                secs);
  }
  sync_ranks("mismatch");
  e = call(false, 2, &secs);
  if (!e.empty()) {
    ++failures;
    std::printf("memop_faults rank %d: the call after the mismatch: '%s'\n", rank, e.c_str());
  }
  sync_ranks("recovered");
  const bool late = rank == P - 1;
  if (late) std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  e = call(false, 3, &secs);
  const bool told = late ? e.find("ranks disagree") != std::string::npos
                         : e.find("did not reach") != std::string::npos;
  if (!told || secs > (late ? 0.9 : 2.0)) {
    ++failures;
    std::printf("memop_faults rank %d (%s): told '%s' after %.2f s\n", rank,
                late ? "late" : "on time", e.c_str(), secs);
  }
  sync_ranks("timeout");
  e = call(false, 4, &secs);
  if (!e.empty()) {
    ++failures;
    std::printf("memop_faults rank %d: the call after the timeout: '%s'\n", rank, e.c_str());
  }
  std::printf("memop_faults rank %d: %d failures\n", rank, failures);
  return failures;
}

// Runs an adversarial worker on world 2, then its armed control: the worker (returning the calls
// it saw torn out of `calls`) must pass and the control must tear. Returns 1 on failure.
// lane_wiring: NOTE [two lanes on one GPU]. A group of one rank keeps the whole GPU for its
// spinning grids until its async lane exists, then both engines take half. Returns 0 when so.
int lane_wiring(int device, std::shared_ptr<Store> store) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  TransportInit ti;
  ti.device = Device{DeviceType::kCUDA, device};
  ti.store = std::move(store);
  ti.name = "wiring";
  NvlinkTransport t(ti, /*owned=*/true);
  const int before = t.engine().gpu_grids();
  auto lane = std::dynamic_pointer_cast<NvlinkTransport>(t.async_lane());
  const int sync_after = t.engine().gpu_grids(), async_after = lane->engine().gpu_grids();
  std::printf("lane_wiring: spinning grids %d before the async lane, %d and %d after\n", before,
              sync_after, async_after);
  lane->destroy();
  t.destroy();
  return before == 1 && sync_after == 2 && async_after == 2 ? 0 : 1;
}

// two_lanes: NOTE [two lanes on one GPU]. World 2, one rank per GPU: every rank issues a flagged
// call of 1 MiB per peer (a grid of one block per SM without the cap) on the group's sync lane
// and one on its async lane, on two streams with no order between them: rank 0 sync first, rank
// 1 async first, 20 ms apart, so each GPU has one lane's grid spinning before the other's is
// launched. Both calls must finish, right. `armed` caps the grids as with one lane
// (DebugFaults::one_lane_cap): each GPU's first grid then holds every SM while it waits for the
// peer's grid of the same lane, which cannot start beside the peer's other grid, until the 5 s
// timeout fails a call. Returns 1 when a call failed or read wrong.
int two_lanes(int rank, int P, int device, std::shared_ptr<Store> store, uint64_t seed,
              bool armed) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  TransportInit ti;
  ti.rank = rank;
  ti.size = P;
  ti.device = Device{DeviceType::kCUDA, device};
  ti.store = std::move(store);
  ti.name = armed ? "lanes-armed" : "lanes";
  ti.timeout = std::chrono::seconds(armed ? 5 : 60);
  NvlinkTransport t(ti, /*owned=*/true);
  auto lane = std::dynamic_pointer_cast<NvlinkTransport>(t.async_lane());
  NvlinkUlysses* engines[2] = {&t.engine(), &lane->engine()};
  for (NvlinkUlysses* e : engines) {
    e->set_flagged_max_bytes(kAll);
    NvlinkUlysses::DebugFaults f;
    f.one_lane_cap = armed;
    e->set_debug_faults(f);
  }
  constexpr int64_t kB = 1, kS = 512, kH = 16, kD = 128, kE = 2;  // 2 MiB of bf16 per rank
  const std::vector<int64_t> seq(static_cast<size_t>(P), kS), heads(static_cast<size_t>(P), kH / P);
  cuda::Stream streams[2];
  std::vector<cuda::DeviceBuffer> xs, outs;
  std::vector<std::vector<std::byte>> want(2);
  std::vector<size_t> out_bytes(2);
  for (int l = 0; l < 2; ++l) {
    plan::RankBuffers inputs(static_cast<size_t>(P));
    for (int r = 0; r < P; ++r) {
      std::mt19937_64 drng(seed + 1000 * static_cast<uint64_t>(l) + static_cast<uint64_t>(r));
      inputs[r].resize(static_cast<size_t>(kB * kS * kH * kD * kE));
      for (auto& byte : inputs[r]) byte = static_cast<std::byte>(drng());
    }
    want[l] = plan::reference_all_to_all_4d(0, kB, kD, kE, seq, heads, inputs)[rank];
    out_bytes[l] = want[l].size();
    xs.emplace_back(inputs[rank].size());
    gpu_test::upload(xs.back().get(), inputs[rank].data(), inputs[rank].size());
    outs.emplace_back(out_bytes[l]);
    FASTCOMMS_CUDA_CHECK(cudaMemset(outs.back().get(), 0xA5, out_bytes[l]));
  }
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
  const Device dev{DeviceType::kCUDA, device};
  for (int k = 0; k < 2; ++k) {
    const int l = rank == 0 ? k : 1 - k;  // rank 0: sync lane first; the others: async first
    const TensorView x =
        TensorView::contiguous(xs[l].get(), DType::kBFloat16, {kB, kS, kH, kD}, dev);
    const TensorView out =
        TensorView::contiguous(outs[l].get(), DType::kBFloat16, {kB, kS * P, kH / P, kD}, dev);
    engines[l]->all_to_all_4d(x, out, UlyssesArgs{}, streams[l].get(), TransferEngine::kSM);
    if (k == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  int bad = 0;
  for (int l = 0; l < 2; ++l) {
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(streams[l].get()));
    try {
      engines[l]->check_errors();
      std::vector<std::byte> got(out_bytes[l]);
      FASTCOMMS_CUDA_CHECK(
          cudaMemcpy(got.data(), outs[l].get(), got.size(), cudaMemcpyDeviceToHost));
      if (got != want[l]) {
        ++bad;
        std::printf("two_lanes%s rank %d %s lane: output differs from the reference\n",
                    armed ? " (armed control)" : "", rank, l == 0 ? "sync" : "async");
      }
    } catch (const Error& e) {
      ++bad;
      std::printf("two_lanes%s rank %d %s lane: %s\n", armed ? " (armed control)" : "", rank,
                  l == 0 ? "sync" : "async", e.what());
    }
  }
  lane->destroy();
  t.destroy();
  return bad ? 1 : 0;
}

// legacy_ordering: NOTE [legacy stream ordering] (fastcomms/cuda/runtime.hpp). 1 MiB of pageable
// host memory uploaded while another stream's 64 MiB pinned upload keeps the copy engines busy,
// then read at once by an SM copy on a non-blocking stream. Through gpu_test::upload every read
// must see the new bytes; `armed` uploads with a plain cudaMemcpy, whose read must see old bytes
// (measured on one H200, driver 580: 98-100 of 100 reads at 1 MiB; none at 64 KiB or 16 MiB).
// Returns the number of reads that saw old bytes.
int legacy_ordering(int device, bool armed, int trials) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  constexpr size_t kBytes = size_t{1} << 20, kBusy = size_t{64} << 20;
  cuda::DeviceBuffer dst(kBytes), out(kBytes), busy_dst(kBusy);
  cuda::PinnedBuffer busy_src(kBusy);
  cuda::Stream reader, busy;
  std::vector<uint32_t> host(kBytes / 4), got(kBytes / 4);
  int stale = 0;
  for (int t = 0; t < trials; ++t) {
    FASTCOMMS_CUDA_CHECK(cudaMemset(dst.get(), 0, kBytes));
    FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
    for (size_t i = 0; i < host.size(); ++i)
      host[i] = 0x9E3779B9u * static_cast<uint32_t>(t + 1) + static_cast<uint32_t>(i) + 1;
    FASTCOMMS_CUDA_CHECK(
        cudaMemcpyAsync(busy_dst.get(), busy_src.get(), kBusy, cudaMemcpyHostToDevice, busy.get()));
    if (armed)
      FASTCOMMS_CUDA_CHECK(cudaMemcpy(dst.get(), host.data(), kBytes, cudaMemcpyHostToDevice));
    else
      gpu_test::upload(dst.get(), host.data(), kBytes);
    cuda::CopyJob job{dst.get(), out.get(), {}};
    job.desc.width = static_cast<int64_t>(kBytes);
    job.desc.src_pitch = job.desc.dst_pitch = job.desc.width;
    job.desc.src_slice_pitch = job.desc.dst_slice_pitch = job.desc.width;
    job.desc.height = job.desc.depth = 1;
    cuda::copy_sm_async(&job, 1, 0, reader.get());
    FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
    FASTCOMMS_CUDA_CHECK(cudaMemcpy(got.data(), out.get(), kBytes, cudaMemcpyDeviceToHost));
    stale += got != host;
  }
  return stale;
}

int armed_pair(const char* name, int ndev, int calls,
               const std::function<int(int, int, int, std::shared_ptr<Store>, bool)>& worker) {
  int failed = 0;
  for (bool armed : {false, true}) {
    const int torn =
        gpu_test::run_ranks(2, ndev, [&](int r, int size, int dev, std::shared_ptr<Store> store) {
          const int bad = worker(r, size, dev, store, armed);
          std::printf("%s%s rank %d: %d of %d calls torn\n", name, armed ? " (armed control)" : "",
                      r, bad, calls);
          return bad ? 1 : 0;
        });
    const bool ok = armed ? torn > 0 : torn == 0;
    std::printf("%s%s: %s\n", name, armed ? " armed control" : "",
                ok ? (armed ? "tore as it must (the test can fail)" : "passed")
                   : (armed ? "DID NOT TEAR: the test is blind" : "FAILED"));
    failed += !ok;
  }
  return failed != 0;
}

int main() {
  std::string why;
  const int ndev = gpu_test::device_count_forked(&why);
  if (ndev < 1) {
    std::printf("SKIPPED: test_nvlink_ulysses needs a CUDA device, found %d%s%s\n", ndev,
                why.empty() ? "" : ": ", why.c_str());
    return gpu_test::kSkip;
  }
  int skipped = 0;
  const uint64_t seed = std::getenv("FASTCOMMS_SEED")
                            ? std::strtoull(std::getenv("FASTCOMMS_SEED"), nullptr, 10)
                            : std::random_device{}();
  std::printf("test_nvlink_ulysses: %d GPUs, seed %llu\n", ndev, (unsigned long long)seed);
  // The NVLink probe, pair by pair, in a child (the parent stays CUDA-free for the forks).
  const int probe_failed = gpu_test::run_ranks(1, ndev, [&](int, int, int, std::shared_ptr<Store>) {
    std::vector<int> devs;
    for (int d = 0; d < ndev; ++d) devs.push_back(d);
    std::string why;
    const auto m = cuda::nvlink_matrix(devs, &why);
    if (!m) {
      std::printf("nvlink probe: unknown (%s)\n", why.c_str());
      return 1;
    }
    int bad = 0;
    for (int a = 0; a < ndev; ++a)
      for (int b = 0; b < ndev; ++b) {
        std::printf("nvlink probe: %d-%d %s\n", a, b, m->at({a, b}) ? "NVLink" : "no NVLink");
        int can = 0;
        if (a != b) FASTCOMMS_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, a, b));
        // NVML saying NVLink must agree with CUDA saying peer access works.
        if (a != b && m->at({a, b}) && !can) ++bad;
      }
    return bad;
  });
  std::printf("nvlink probe: %s\n", probe_failed ? "FAILED" : "passed");
  int failed_worlds = 0;
  for (int P : {2, 3, 4}) {
    const int failed =
        gpu_test::run_ranks(P, ndev, [&](int r, int size, int dev, std::shared_ptr<Store> store) {
          return rank_main(r, size, dev, store, seed + P);
        });
    std::printf("world %d: %s\n", P, failed ? "FAILED" : "passed");
    failed_worlds += failed != 0;
  }
  failed_worlds += probe_failed != 0;
  // The shared transport body through the Ulysses layer's "nvlink" transport (the path
  // UlyssesGroup takes), worlds 2 and 3 (ranks share GPUs beyond the device count).
  int body_failed = 0;
  for (int P : {2, 3}) {
    body_failed +=
        gpu_test::run_ranks(P, ndev, [&](int r, int size, int dev, std::shared_ptr<Store> store) {
          FASTCOMMS_CUDA_CHECK(cudaSetDevice(dev));
          TransportInit ti;
          ti.rank = r;
          ti.size = size;
          ti.device = Device{DeviceType::kCUDA, dev};
          ti.store = store;
          ti.name = "body";
          ti.timeout = std::chrono::seconds(60);
          auto t = make_transport("nvlink", ti);
          std::mt19937_64 rng(seed + 1000 + size);  // same cases on every rank
          const auto cases = test::random_cases(size, 30, rng, /*align16=*/true);
          cuda::Stream stream;
          const int bad = test::run_ulysses_body(
              *t, cases, r, gpu_test::device_memory(dev, stream.get()), "nvlink transport");
          t->check_errors();
          t->destroy();
          std::printf("transport body world %d rank %d: %zu cases, %d failed checks\n", size, r,
                      cases.size(), bad);
          return bad;
        });
  }
  std::printf("transport body: %s\n", body_failed ? "FAILED" : "passed");
  failed_worlds += body_failed != 0;
  // legacy_ordering and its armed control, in a child process (the parent stays off CUDA).
  int legacy_failed = 0;
  for (bool armed : {false, true}) {
    constexpr int kTrials = 20;
    const int stale = gpu_test::run_ranks(1, ndev, [&](int, int, int dev, auto) {
      const int n = legacy_ordering(dev, armed, kTrials);
      std::printf("legacy_ordering%s: %d of %d reads saw old bytes\n",
                  armed ? " (armed control)" : "", n, kTrials);
      return n ? 1 : 0;
    });
    const bool ok = armed ? stale > 0 : stale == 0;
    std::printf("legacy_ordering%s: %s\n", armed ? " armed control" : "",
                ok ? (armed ? "read early as it must (the test can fail)" : "passed")
                   : (armed ? "DID NOT READ EARLY: the test is blind" : "FAILED"));
    legacy_failed += !ok;
  }
  failed_worlds += legacy_failed != 0;
  // NOTE [two lanes on one GPU]: the wiring (one rank), then the cross wait and its armed
  // control (world 2, one rank per GPU).
  {
    const int bad = gpu_test::run_ranks(
        1, ndev,
        [&](int, int, int dev, std::shared_ptr<Store> store) { return lane_wiring(dev, store); });
    std::printf("lane_wiring: %s\n", bad ? "FAILED" : "passed");
    failed_worlds += bad != 0;
  }
  if (ndev < 2) {
    std::printf("two_lanes: SKIPPED (needs a GPU per rank, found %d)\n", ndev);
    ++skipped;
  } else {
    failed_worlds +=
        armed_pair("two_lanes", ndev, 2, [&](int r, int size, int dev, auto store, bool armed) {
          return two_lanes(r, size, dev, store, seed + 4242, armed);
        });
  }
  // window_race and ce_ordering, each with its armed control (world 2).
  failed_worlds +=
      armed_pair("window_race", ndev, 6, [&](int r, int size, int dev, auto store, bool armed) {
        return window_race(r, size, dev, store, seed + 99, armed);
      });
  failed_worlds +=
      armed_pair("ce_ordering", ndev, 3, [&](int r, int size, int dev, auto store, bool armed) {
        return ce_ordering(r, size, dev, store, seed + 7, armed);
      });
  // The copy-engine path under stress with either barrier kind: world 2 on two GPUs, world 3
  // with two ranks on one GPU (kernel barriers only: the group refuses memop barriers there).
  for (int P : {2, 3}) {
    for (const char* kind : {"memop", "kernel"}) {
      if (P > ndev && std::string(kind) == "memop") {
        std::printf(
            "ce_stress world %d (memop barriers): SKIPPED (ranks would share a GPU, "
            "which memop barriers refuse)\n",
            P);
        ++skipped;
        continue;
      }
      const int bad =
          gpu_test::run_ranks(P, ndev, [&](int r, int size, int dev, std::shared_ptr<Store> store) {
            return ce_stress(r, size, dev, store, seed + 313 * P, kind, 100) ? 1 : 0;
          });
      std::printf("ce_stress world %d (%s barriers): %s\n", P, kind, bad ? "FAILED" : "passed");
      failed_worlds += bad != 0;
    }
  }
  // NOTE [memop barrier]: with two ranks on one GPU the group refuses memop barriers, on every
  // rank and saying why, and the kernel barriers still work in the same group.
  {
    const int P = ndev + 1;  // one GPU holds two ranks
    const int bad =
        gpu_test::run_ranks(P, ndev, [&](int r, int size, int dev, std::shared_ptr<Store> store) {
          FASTCOMMS_CUDA_CHECK(cudaSetDevice(dev));
          NvlinkUlysses group(group_options(r, size, dev, store, "memop-refused"));
          try {
            group.tune("barrier", "memop");
            std::printf("memop refusal rank %d: ACCEPTED on a shared GPU\n", r);
            return 1;
          } catch (const Error& e) {
            const bool says = e.code() == ErrorCode::kUnsupported &&
                              std::string(e.what()).find("barrier=memop") != std::string::npos;
            if (!says) std::printf("memop refusal rank %d: wrong error: %s\n", r, e.what());
            if (!says) return 1;
          }
          group.tune("barrier", "kernel");
          return 0;
        });
    std::printf("memop refusal world %d (%d GPUs): %s\n", P, ndev, bad ? "FAILED" : "passed");
    failed_worlds += bad != 0;
  }
  // The SM-free barriers under a mismatch and a late rank (world 2: one rank per GPU).
  for (int P : {2}) {
    if (P > ndev) {
      std::printf("memop_faults world %d: SKIPPED (needs a GPU per rank, found %d)\n", P, ndev);
      ++skipped;
      continue;
    }
    const int bad =
        gpu_test::run_ranks(P, ndev, [&](int r, int size, int dev, std::shared_ptr<Store> store) {
          return memop_faults(r, size, dev, store, seed + 555) ? 1 : 0;
        });
    std::printf("memop_faults world %d: %s\n", P, bad ? "FAILED" : "passed");
    failed_worlds += bad != 0;
  }
  std::printf("%d passed, %d failed, %d skipped\n", 16 - failed_worlds - skipped, failed_worlds,
              skipped);
  return failed_worlds ? 1 : 0;
}
