// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// bench_a2a (a benchmark, not a test): the peer-to-peer Ulysses all-to-all over NVLink against
// the collective path on NCCL (permute kernel + grouped ncclSend/ncclRecv + permute kernel, i.e.
// permute + all_to_all_single + permute with fast permutes) and against the NCCL exchange alone,
// in the same run; bf16, mode 0, 2 ranks, the shapes of DESIGN.md plus two batched ones. Each
// variant: 5 warm-up iterations, then 7 rounds in which every variant in turn times a batch of
// `iters` back-to-back calls (CUDA events; interleaved, so drift hits all alike), median of the
// per-call times. Every variant's output is checked bit for bit against the plan reference first.
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>

#include "backends/nvlink/nvlink_ulysses.hpp"
#include "fastcomms/cuda/copy.hpp"
#include "fastcomms/plan/reference.hpp"
#include "tools/gpu/bench_common.hpp"

using namespace fastcomms;

namespace {

#define NCCL_CHECK(call)                                                    \
  do {                                                                      \
    ncclResult_t r_ = (call);                                               \
    if (r_ != ncclSuccess)                                                  \
      throw Error(ErrorCode::kBackendError,                                 \
                  detail::cat(#call, " failed: ", ncclGetErrorString(r_))); \
  } while (0)

struct Shape {
  int64_t b, s, h, d;
};

const Shape kShapes[] = {{1, 1, 32, 128},     {1, 4, 40, 128},     {1, 16, 40, 128},
                         {1, 51, 40, 128},    {1, 64, 40, 128},    {1, 128, 40, 128},
                         {1, 256, 40, 128},   {1, 1024, 40, 128},  {1, 4096, 40, 128},
                         {1, 37800, 40, 128}, {1, 16380, 40, 384}, {1, 37800, 40, 384},
                         {2, 8192, 32, 128},  {4, 4096, 32, 128}};

int rank_main(int rank, int P, int device, std::shared_ptr<Store> store) {
  FASTCOMMS_CUDA_CHECK(cudaSetDevice(device));
  NvlinkUlyssesOptions o;
  o.rank = rank;
  o.size = P;
  o.device = device;
  o.store = store;
  o.name = "bench";
  o.timeout = std::chrono::seconds(120);
  NvlinkUlysses group(o);
  // The same engine with legacy-IPC windows, for the comparison of NOTE [vmm windows].
  o.name = "bench-ipc";
  o.tuning.window_alloc = "ipc";
  NvlinkUlysses ipc_group(o);
  // NCCL for the baseline (unique id through the store).
  ncclUniqueId id;
  if (rank == 0) {
    NCCL_CHECK(ncclGetUniqueId(&id));
    store->set("nccl_id", std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                               reinterpret_cast<uint8_t*>(&id) + sizeof id));
  } else {
    auto v = store->get("nccl_id", std::chrono::seconds(120));
    std::memcpy(&id, v.data(), sizeof id);
  }
  ncclComm_t nccl;
  NCCL_CHECK(ncclCommInitRank(&nccl, P, id, rank));
  cuda::Stream stream;
  cudaStream_t st = stream.get();
  const Device dev{DeviceType::kCUDA, device};
  cuda::Event t0(true), t1(true), fork;
  std::vector<cuda::Stream> side;
  std::vector<cuda::Event> join;
  for (int k = 0; k < 4; ++k) {
    side.emplace_back(false);
    join.emplace_back(false);
  }

  if (rank == 0) {
    int drv = 0, rt = 0, nv = 0;
    cudaDriverGetVersion(&drv);
    cudaRuntimeGetVersion(&rt);
    ncclGetVersion(&nv);
    cudaDeviceProp prop;
    cudaGetDeviceProperties(&prop, device);
    std::printf(
        "bench_a2a: %d ranks, %s, CUDA driver %d runtime %d, NCCL %d, bf16 mode 0, windows %s\n", P,
        prop.name, drv, rt, nv, group.window_alloc());
    std::printf(
        "%-20s %8s | %8s %8s %8s %8s | %9s %8s | %8s %8s %8s | %7s %7s %8s %8s | %8s %8s | %8s "
        "%8s %6s | %8s %8s | %8s | %7s %7s\n",
        "shape (b,s,h,d)", "MiB/rk", "ce us", "sm us", "ce0 us", "sm0 us", "nccl+perm", "nccl us",
        "flatCE", "flatSM", "flatCE4", "best/p", "sm0/p", "GB/s ce0", "GB/s sm0", "hyb us",
        "hyb0 us", "ce0x4", "ce0ownSM", "ce0/fl", "ce0 ipc", "flatIPC", "ce outCE", "graph0",
        "host0");
  }
  for (const Shape& sh : kShapes) {
    const int64_t n = sh.h, S = sh.s * P;
    if (n % P) continue;
    const int64_t in_elems = sh.b * sh.s * n * sh.d;
    const size_t bytes = static_cast<size_t>(in_elems) * 2;
    // Inputs: random, fresh per shape; the reference for the check (small shapes only).
    std::vector<std::byte> host(bytes);
    std::mt19937_64 rng(1234 + rank * 7 + sh.s);
    for (size_t i = 0; i < bytes; i += 8) {
      const uint64_t w = rng();
      std::memcpy(host.data() + i, &w, std::min<size_t>(8, bytes - i));
    }
    cuda::DeviceBuffer xin(bytes), out(bytes), send(bytes), recv(bytes);
    void* zc = group.empty_output(static_cast<int64_t>(bytes));
    void* zc_ipc = ipc_group.empty_output(static_cast<int64_t>(bytes));
    gpu_test::upload(xin.get(), host.data(), bytes);
    TensorView x = TensorView::contiguous(xin.get(), DType::kBFloat16, {sh.b, sh.s, n, sh.d}, dev);
    TensorView ov =
        TensorView::contiguous(out.get(), DType::kBFloat16, {sh.b, S, n / P, sh.d}, dev);
    TensorView zv = TensorView::contiguous(zc, DType::kBFloat16, {sh.b, S, n / P, sh.d}, dev);
    TensorView zi = TensorView::contiguous(zc_ipc, DType::kBFloat16, {sh.b, S, n / P, sh.d}, dev);
    plan::UlyssesRequest req;
    req.world_size = P;
    req.rank = rank;
    req.shape = {sh.b, sh.s, n, sh.d};
    req.element_size = 2;
    req.path = plan::Path::kCollective;
    const plan::UlyssesPlan cp = plan::make_ulysses_plan(req);
    std::vector<cuda::CopyJob> pack, unpack;
    for (int q = 0; q < P; ++q) {
      pack.push_back({xin.get(), send.get(), cp.pack[q]});
      unpack.push_back({recv.get(), out.get(), cp.unpack[q]});
    }
    auto nccl_exchange = [&] {
      NCCL_CHECK(ncclGroupStart());
      for (int q = 0; q < P; ++q) {
        NCCL_CHECK(ncclSend(static_cast<char*>(send.get()) + cp.send_displs[q] * 2,
                            cp.send_counts[q] * 2, ncclUint8, q, nccl, st));
        NCCL_CHECK(ncclRecv(static_cast<char*>(recv.get()) + cp.recv_displs[q] * 2,
                            cp.recv_counts[q] * 2, ncclUint8, q, nccl, st));
      }
      NCCL_CHECK(ncclGroupEnd());
    };
    auto baseline = [&] {
      cuda::copy_sm_async(pack.data(), P, 0, st);
      nccl_exchange();
      cuda::copy_sm_async(unpack.data(), P, 0, st);
    };
    auto staged = [&](const TensorView& dst, bool barriers_only) {
      NvlinkUlysses::DebugFaults f;
      f.unfused = true;
      f.skip_transfer = barriers_only;
      group.set_debug_faults(f);
      group.all_to_all_4d(x, dst, UlyssesArgs{}, st, TransferEngine::kSM);
      group.set_debug_faults({});
    };
    std::vector<std::function<void()>> variants = {
        [&] { group.all_to_all_4d(x, ov, UlyssesArgs{}, st, TransferEngine::kCopyEngine); },
        [&] { group.all_to_all_4d(x, ov, UlyssesArgs{}, st, TransferEngine::kSM); },
        [&] { group.all_to_all_4d(x, zv, UlyssesArgs{}, st, TransferEngine::kCopyEngine); },
        [&] { group.all_to_all_4d(x, zv, UlyssesArgs{}, st, TransferEngine::kSM); },
        baseline,
        nccl_exchange,
        // The link ceiling: one flat copy of the bytes that cross, into the peer, per engine.
        [&] {
          for (int q = 1; q < P; ++q) {
            const int peer = (rank + q) % P;
            FASTCOMMS_CUDA_CHECK(cudaMemcpyAsync(group.peer_window(zc, peer), xin.get(), bytes / P,
                                                 cudaMemcpyDeviceToDevice, st));
          }
        },
        [&] {
          std::vector<cuda::CopyJob> flat;
          for (int q = 1; q < P; ++q) {
            plan::CopyDesc c;
            c.width = static_cast<int64_t>(bytes / P);
            c.height = c.depth = 1;
            c.src_pitch = c.dst_pitch = c.width;
            c.src_slice_pitch = c.dst_slice_pitch = c.width;
            flat.push_back({xin.get(), group.peer_window(zc, (rank + q) % P), c});
          }
          cuda::copy_sm_async(flat.data(), static_cast<int>(flat.size()), 0, st);
        },
        // The same flat copy split over 4 streams (4 copy engines).
        [&] {
          fork.record(st);
          const size_t part = bytes / P / 4 / 16 * 16;
          for (int k = 0; k < 4; ++k) {
            fork.wait_on(side[k].get());
            const size_t off = part * k, n = k == 3 ? bytes / P - off : part;
            for (int q = 1; q < P; ++q)
              FASTCOMMS_CUDA_CHECK(cudaMemcpyAsync(
                  static_cast<char*>(group.peer_window(zc, (rank + q) % P)) + off,
                  static_cast<char*>(xin.get()) + off, n, cudaMemcpyDeviceToDevice, side[k].get()));
            join[k].record(side[k].get());
            join[k].wait_on(st);
          }
        },
        [&] { group.all_to_all_4d(x, ov, UlyssesArgs{}, st, TransferEngine::kHybrid); },
        [&] { group.all_to_all_4d(x, zv, UlyssesArgs{}, st, TransferEngine::kHybrid); },
        // Stages (SM engine, three kernels per call): zero copy, barriers alone, copying. The
        // differences give the transfer (11 - 12) and the copy-out (13 - 11).
        [&] { staged(zv, false); },
        [&] { staged(zv, true); },
        [&] { staged(ov, false); },
        // The copy-engine path's measured alternatives (NOTE [copy-engine path]): every block's
        // rows split over 4 side streams, and this rank's own share moved by the SM kernel.
        [&] { group.all_to_all_4d(x, zv, UlyssesArgs{}, st, TransferEngine::kCopyEngine); },
        [&] { group.all_to_all_4d(x, zv, UlyssesArgs{}, st, TransferEngine::kCopyEngine); },
        // NOTE [vmm windows]: ce0 and the flat copy into legacy-IPC windows.
        [&] { ipc_group.all_to_all_4d(x, zi, UlyssesArgs{}, st, TransferEngine::kCopyEngine); },
        [&] {
          for (int q = 1; q < P; ++q)
            FASTCOMMS_CUDA_CHECK(cudaMemcpyAsync(ipc_group.peer_window(zc_ipc, (rank + q) % P),
                                                 xin.get(), bytes / P, cudaMemcpyDeviceToDevice,
                                                 st));
        },
        // NOTE [copy-out engine]: the copying copy-engine call with its copy-out on the copy
        // engines.
        [&] { group.all_to_all_4d(x, ov, UlyssesArgs{}, st, TransferEngine::kCopyEngine); },
    };
    // Knobs a variant runs with (reset to the defaults before every other variant).
    const NvlinkTuning defaults = group.tuning();
    auto setup = [&](size_t v) {
      group.tune("ce_streams", v == 14 ? "4" : std::to_string(defaults.ce_streams));
      group.tune("ce_own", v == 15 ? "sm" : (defaults.own_share_sm ? "sm" : "ce"));
      group.tune("copy_out", v == 18 ? "ce" : "auto");
    };
    // Check every output variant once (the exchange-only variant has no final layout).
    std::vector<std::byte> want;
    if (bytes <= (64u << 20)) {
      plan::RankBuffers inputs(P);
      for (int r = 0; r < P; ++r) {
        inputs[r].resize(bytes);
        std::mt19937_64 rr(1234 + r * 7 + sh.s);
        for (size_t i = 0; i < bytes; i += 8) {
          const uint64_t w = rr();
          std::memcpy(inputs[r].data() + i, &w, std::min<size_t>(8, bytes - i));
        }
      }
      want = plan::reference_all_to_all_4d(0, sh.b, sh.d, 2, std::vector<int64_t>(P, sh.s),
                                           std::vector<int64_t>(P, n / P), inputs)[rank];
    }
    int bad = 0;
    for (int v : {0, 1, 2, 3, 4, 9, 10, 11, 13, 14, 15, 16, 18}) {
      void* dst = v == 16                                                            ? zc_ipc
                  : (v == 2 || v == 3 || v == 10 || v == 11 || (v >= 14 && v != 18)) ? zc
                                                                                     : out.get();
      FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(dst, 0xA5, bytes, st));
      setup(v);
      variants[v]();
      std::vector<std::byte> got(bytes);
      FASTCOMMS_CUDA_CHECK(cudaMemcpyAsync(got.data(), dst, bytes, cudaMemcpyDeviceToHost, st));
      FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
      group.check_errors();
      ipc_group.check_errors();
      if (!want.empty() && got != want) ++bad;
    }
    // Eager device time per call of `fn`: median of 7 runs of `iters` back-to-back calls.
    auto eager_time = [&](const std::function<void()>& fn, int iters) {
      std::vector<double> samples;
      for (int rep = 0; rep < 7; ++rep) samples.push_back(bench::batch_us(st, t0, t1, fn, iters));
      return bench::median(samples);
    };
    std::vector<double> us(variants.size());
    const int iters = bytes < (16u << 20) ? 50 : 10;
    std::vector<std::vector<double>> rounds(variants.size());
    for (size_t v = 0; v < variants.size(); ++v) {
      setup(v);
      for (int w = 0; w < 5; ++w) variants[v]();
    }
    for (int rep = 0; rep < 7; ++rep) {
      for (size_t v = 0; v < variants.size(); ++v) {
        setup(v);
        rounds[v].push_back(bench::batch_us(st, t0, t1, variants[v], iters));
      }
    }
    setup(0);
    for (size_t v = 0; v < variants.size(); ++v) us[v] = bench::median(rounds[v]);
    // Graph replay (device time per call) and host cost per eager call, zero copy, SM engine.
    double graph_us = 0, host_us = 0;
    const int calls = 20;
    // Device time per call of `fn` replayed from a CUDA graph of `calls` calls (median of 7).
    auto graph_time = [&](const std::function<void()>& fn) {
      FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      FASTCOMMS_CUDA_CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < calls; ++i) fn();
      FASTCOMMS_CUDA_CHECK(cudaStreamEndCapture(st, &graph));
      FASTCOMMS_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
      const auto launch = [&] { FASTCOMMS_CUDA_CHECK(cudaGraphLaunch(exec, st)); };
      launch();  // warm-up
      const double per_launch = eager_time(launch, 1);
      FASTCOMMS_CUDA_CHECK(cudaGraphExecDestroy(exec));
      FASTCOMMS_CUDA_CHECK(cudaGraphDestroy(graph));
      return per_launch / calls;
    };
    // Small messages: the flagged path (NOTE [flagged push], sm0 takes it when every chunk fits)
    // against the barrier path (the fused kernel), eager and graph-replayed, zero copy.
    double small[4] = {0, 0, 0, 0};  // flagged eager, flagged graph, fused eager, fused graph
    const int64_t flagged_max = group.flagged_max_bytes();
    const bool small_run =
        bytes <= (3u << 20) && flagged_max > 0 && bytes / P <= static_cast<size_t>(flagged_max);
    if (small_run) {
      for (int k = 0; k < 2; ++k) {
        group.set_flagged_max_bytes(k == 0 ? flagged_max : 0);
        small[2 * k] = eager_time(variants[3], 50);
        small[2 * k + 1] = graph_time(variants[3]);
      }
      group.set_flagged_max_bytes(flagged_max);
    }
    if (bytes <= (64u << 20)) {
      graph_us = graph_time(variants[3]);
      std::vector<double> host;
      for (int rep = 0; rep < 7; ++rep) {
        FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
        const auto h0 = std::chrono::steady_clock::now();
        for (int i = 0; i < calls; ++i) variants[3]();
        const auto h1 = std::chrono::steady_clock::now();
        host.push_back(std::chrono::duration<double, std::micro>(h1 - h0).count() / calls);
      }
      host_us = bench::median(host);
      FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(st));
    }
    group.check_errors();
    if (rank == 0) {
      char name[48];
      std::snprintf(name, sizeof name, "(%lld,%lld,%lld,%lld)", (long long)sh.b, (long long)sh.s,
                    (long long)n, (long long)sh.d);
      const double best = std::min({us[0], us[1], us[2], us[3], us[9], us[10], us[14], us[15]});
      const double cross = bytes * (P - 1.0) / P;
      std::printf(
          "%-20s %8.2f | %8.1f %8.1f %8.1f %8.1f | %9.1f %8.1f | %8.1f %8.1f %8.1f | %6.2fx %6.2fx "
          "%8.1f %8.1f | %8.1f %8.1f | %8.1f %8.1f %5.1f%% | %8.1f %8.1f | %8.1f | %7.1f %7.1f "
          "%s\n",
          name, bytes / 1048576.0, us[0], us[1], us[2], us[3], us[4], us[5], us[6], us[7], us[8],
          us[4] / best, us[4] / us[3], cross / (us[2] * 1e3), cross / (us[3] * 1e3), us[9], us[10],
          us[14], us[15], 100.0 * us[6] / us[2], us[16], us[17], us[18], graph_us, host_us,
          want.empty() ? "(unchecked)"
          : bad        ? "MISMATCH"
                       : "ok");
      if (small_run)
        std::printf(
            "%-20s small path, sm0 per call: flagged %.1f us eager, %.1f us graph-replayed; "
            "barriers (fused kernel) %.1f us eager, %.1f us graph-replayed\n",
            "", small[0], small[1], small[2], small[3]);
      std::printf(
          "%-20s stages (SM, 3 kernels): barriers in+out %.1f us, transfer %.1f us, copy-out "
          "%.1f us; zero copy %.1f us, copying %.1f us\n",
          "", us[12], us[11] - us[12], us[13] - us[11], us[11], us[13]);
      std::fflush(stdout);
    }
    if (bad) return 1;
  }
  ncclCommDestroy(nccl);
  return 0;
}

}  // namespace

int main() {
  const int rc = bench::run_two_ranks("bench_a2a", rank_main);
  if (rc == gpu_test::kSkip) return rc;
  std::printf(
      "columns: ce/sm = copy-engine / SM-kernel transfer into the group window + "
      "copy-out; ce0/sm0 = zero copy (out = empty_output); nccl+perm = pack kernel + "
      "ncclSend/Recv + unpack kernel; nccl = the exchange alone; best/p and ce0/p = "
      "speed-up over nccl+perm; flatCE/flatSM = one flat copy of the crossing bytes into the peer "
      "(the link ceiling per engine; both ranks copy at once, so both directions are busy); "
      "ce0x4 = ce0 with every block split over 4 side streams; ce0ownSM = ce0 with the own share "
      "moved by the SM kernel; ce0/fl = flatCE / ce0, the share of the flat copy-engine rate the "
      "zero-copy copy-engine path reaches; ce0 ipc / flatIPC = ce0 and flatCE into windows shared "
      "by legacy CUDA IPC instead of VMM file descriptors; ce outCE = the copying copy-engine "
      "call (ce) with its copy-out on the copy engines instead of the SM kernel; "
      "GB/s = bytes crossing NVLink per rank / "
      "time; graph0 = "
      "device "
      "time per sm0 call replayed from a CUDA graph of 20 calls; host0 = host time to issue one "
      "eager sm0 call; stages = the SM engine with three kernels per call (entry barrier, "
      "transfer, exit barrier) timed zero copy, copying, and with the transfer left out: the "
      "differences give the transfer and the copy-out; sm and sm0 take the flagged path (no "
      "barriers, "
      "one kernel) where every per-peer chunk fits FASTCOMMS_FLAGGED_MAX_BYTES (1 MiB); small "
      "path = sm0 with that path and with the barrier path (fused kernel)\n");
  return rc;
}
