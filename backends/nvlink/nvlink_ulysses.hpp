// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// (Private to backends/nvlink; callers reach it through the Ulysses layer's "nvlink" transport,
/// the GPU tests and the developer benchmark include it directly.)
/// The peer-to-peer Ulysses all-to-all over NVLink: every rank writes its contribution straight
/// into each peer's window (CUDA IPC memory mapped into every peer), in the final layout, between
/// two device-side epoch barriers. No NCCL: the setup needs only the store, so several ranks may
/// share one GPU.

#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "backends/ipc/ipc_window.hpp"
#include "backends/nvlink/fd_channel.hpp"
#include "backends/nvlink/memop_watch.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/core/tensor.hpp"
#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/copy.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/cuda/vmm.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"
#include "fastcomms/ulysses/transport.hpp"

namespace fastcomms {

/// How the bytes cross.
enum class TransferEngine {
  kAuto,        ///< The copy engines above the measured crossover, the SM kernel below.
  kCopyEngine,  ///< Pitched cudaMemcpy2D/3D, one per peer, on one side stream: zero SMs.
  kSM,          ///< One kernel pushing 16-byte vectors into every peer.
  kHybrid,      ///< Both at once: the copy engines take a share of every peer's rows
                ///< (hybrid_ce_percent), the SM kernel the rest.
};

/// What moves a copying call's copy-out (NOTE [copy-out engine]).
enum class CopyOutEngine {
  kAuto,        ///< The SM kernel (the measured choice, NOTE [copy-out engine]).
  kCopyEngine,  ///< Pitched local cudaMemcpy2D/3D.
  kSM,          ///< The SM copy kernel.
};

/// What the copy-engine path's barriers run on (NOTE [memop barrier]).
enum class BarrierKind {
  kAuto,    ///< The kernel (NOTE [memop barrier]: the memop barriers are not the default).
  kKernel,  ///< The epoch-barrier kernel (one block; it needs an SM to start).
  kMemop,   ///< Stream memory operations (no SM; experimental, NOTE [memop barrier]); an error
            ///< where a device lacks them or two ranks share a GPU.
};
/// Every tuning knob of the engine, in one place. Each knob has a name (the `tune` knob of the
/// transport and of UlyssesGroup._tune) and an environment variable (README's run-time settings,
/// read once per process by from_env(); a malformed value throws there, not on a call path).
struct NvlinkTuning {
  /// engine | FASTCOMMS_ENGINE = auto|ce|sm|hybrid: the engine of transport calls.
  TransferEngine engine = TransferEngine::kAuto;
  /// ce_crossover | FASTCOMMS_CE_CROSSOVER: per-peer chunk bytes from which kAuto takes the copy
  /// engines (docs/benchmarks.md, "copy-engine path": where ce0 overtook sm0 on 2xH200).
  int64_t ce_crossover = int64_t{16} << 20;
  /// hybrid_ce_percent | FASTCOMMS_HYBRID_CE_PERCENT: the copy engines' share of every remote
  /// chunk's rows in the hybrid engine.
  int hybrid_ce_percent = 45;
  /// ce_streams | FASTCOMMS_CE_STREAMS: side streams the remote copies are issued on. 1 (the
  /// measured best): every peer's block is one pitched copy, all on one stream, since several
  /// streams only contend for the same egress; n > 1 splits every block's rows over n streams.
  int ce_streams = 1;
  /// ce_own | FASTCOMMS_CE_OWN = ce|sm: what moves this rank's own share on the copy-engine
  /// path, beside the remote copies on the caller's stream (ce: zero SMs).
  bool own_share_sm = false;
  /// copy_out | FASTCOMMS_COPY_OUT = auto|ce|sm: what moves a copying call's copy-out.
  CopyOutEngine copy_out = CopyOutEngine::kAuto;
  /// window_alloc | FASTCOMMS_WINDOW_ALLOC = auto|vmm|ipc: how the windows peers write are
  /// allocated and shared (NOTE [vmm windows]); auto takes vmm where the driver supports it.
  /// Fixed at construction: environment only.
  std::string window_alloc = "auto";
  /// flagged_max_bytes | FASTCOMMS_FLAGGED_MAX_BYTES: capacity (and initial threshold) of the
  /// flagged path per peer chunk; on 2xH200 it beat the barrier path at every chunk measured (up
  /// to 1.25 MiB). Fixed at construction (it sizes buffers): environment only.
  int64_t flagged_max_bytes = int64_t{1} << 20;
  /// fused_max_bytes | FASTCOMMS_FUSED_MAX_BYTES: largest per-peer chunk of the one-kernel
  /// barrier path.
  int64_t fused_max_bytes = int64_t{2} << 20;
  /// fused_blocks | FASTCOMMS_FUSED_BLOCKS: grid cap of the fused and flagged kernels (0: one
  /// block per SM).
  int fused_blocks = 0;
  /// barrier | FASTCOMMS_BARRIER = auto|kernel|memop: what the copy-engine path's entry and exit
  /// barriers run on (NOTE [memop barrier]); auto is the kernel; memop (experimental) applies
  /// outside a CUDA graph capture only (a captured call takes the kernel barrier, whose replays
  /// carry their own timeout).
  BarrierKind barrier = BarrierKind::kAuto;

  /// Sets knob `name` from its text form; throws kInvalidArgument naming the knob, the value
  /// and what is accepted.
  void set(const std::string& name, const std::string& value);
  /// The knob names set() accepts.
  static const std::vector<std::string>& knobs();
  /// The process's settings (parsed on first use).
  static const NvlinkTuning& from_env();
};

/// Setup of a group (the timeout bounds store waits and device barrier waits).
struct NvlinkUlyssesOptions : IpcGroupOptions {
  std::string name = "ulysses";                    ///< Key namespace in the store.
  NvlinkTuning tuning = NvlinkTuning::from_env();  ///< Engine knobs.
  /// NOTE [hierarchical split]: the ranks of the plans this group runs, by member (empty: the
  /// group's own ranks). A host's engine of a hierarchical group runs the whole group's plan,
  /// member q being rank plan_ranks[q] of it: puts go to members only, at the plan's offsets.
  std::vector<int> plan_ranks;
};

/// One group of ranks doing Ulysses all-to-alls over NVLink.
class NvlinkUlysses {
 public:
  /// Collective: allocates and exchanges the signal pads.
  explicit NvlinkUlysses(NvlinkUlyssesOptions options);
  ~NvlinkUlysses();
  NvlinkUlysses(const NvlinkUlysses&) = delete;
  NvlinkUlysses& operator=(const NvlinkUlysses&) = delete;

  /// The output shape of a call (validated like the call).
  std::array<int64_t, 4> output_shape(const TensorView& x, const UlyssesArgs& args) const;

  /// Enqueues the exchange on `stream` (no host block). `out` is a contiguous device tensor of
  /// output_shape(); when it is a buffer from empty_output() peers write into it directly (zero
  /// copy), otherwise into this group's window, then a local copy-out fills `out`.
  /// Device-side failures (ranks disagreeing on the call, a barrier timeout) are reported by the
  /// next call or by check_errors().
  void all_to_all_4d(const TensorView& x, const TensorView& out, const UlyssesArgs& args,
                     cudaStream_t stream, TransferEngine engine = TransferEngine::kAuto);
  /// The same with the call already validated (x on this device, `out` checked against `p`).
  void run(const TensorView& x, const TensorView& out, const plan::UlyssesRequest& req,
           const plan::UlyssesPlan& p, cudaStream_t stream, TransferEngine engine);
  /// FP8 on the wire fused into the transfer (NOTE [fp8 fused push]): `p8` is the call's plan
  /// for one-byte elements (x's shape); every rank quantizes its rows as it writes them into the
  /// peers' windows (FP8 rows at the output's offsets, a float32 scale per output row after
  /// them), then dequantizes its window into `out` (x's dtype; `scales` null) or copies the FP8
  /// rows into `out` (dtype `wire`) and the scales into `scales`. The SM kernel runs it (the copy
  /// engines cannot quantize). Groups of two ranks or more; validated by the caller.
  void run_fp8(const TensorView& x, const TensorView& out, float* scales,
               const plan::UlyssesPlan& p8, DType wire, cudaStream_t stream);

  /// Collective: a device buffer of `bytes` mapped into every peer; passing it (as a tensor of
  /// the right shape) as `out` skips the copy-out. Released by destroy() or the destructor.
  void* empty_output(int64_t bytes);

  /// Peer `q`'s mapping of the empty_output() buffer whose local base is `local` (null if
  /// `local` is not one).
  void* peer_window(const void* local, int q) const;

  /// Throws if a device-side barrier flagged an error (reads pinned memory; no sync).
  void check_errors();

  /// Faults armed by the adversarial tests (their control runs must fail) and the stage
  /// breakdown of bench_a2a. Never set otherwise.
  struct DebugFaults {
    bool skip_entry_barrier = false;        ///< Omit the entry barrier (non-fused paths).
    uint64_t delay_before_copy_out_ns = 0;  ///< Spin this long before the copy-out.
    uint64_t delay_ce_ns = 0;    ///< Spin this long on each copy-engine stream before its copies.
    bool skip_ce_join = false;   ///< Exit barrier not ordered after the copy engines (ce_ordering).
    bool unfused = false;        ///< Never take the fused one-kernel path (bench stages).
    bool skip_transfer = false;  ///< Barriers and copy-out only, no transfer (bench stages).
    /// Cap the spinning grids as if no second lane existed (the control of two_lanes in
    /// test_nvlink_ulysses; NOTE [two lanes on one GPU]). Leaves the flagged path on.
    bool one_lane_cap = false;
    /// True when any fault is armed (they exercise the barrier path, so the flagged one is off).
    bool any() const {
      return skip_entry_barrier || delay_before_copy_out_ns || delay_ce_ns || skip_ce_join ||
             unfused || skip_transfer;
    }
  };
  /// Arms test faults on this rank.
  void set_debug_faults(const DebugFaults& f) { faults_ = f; }

  /// NOTE [two lanes on one GPU]: a group's async calls run on a second engine (the async lane,
  /// NOTE [async lane]) on the same GPU, so a sync call and an async call may be in flight
  /// there at once, each a spinning grid (fused or flagged) that waits for the same lane's grid
  /// on every peer. At 512 threads these kernels take 78 and 104 registers on sm_90 (ptxas), so
  /// an SM holds one block of either: two grids of one block per SM cannot both be resident.
  /// When one rank's GPU starts the sync lane's grid first and a peer's GPU the async lane's (an
  /// async call followed by a sync one, whose grids become ready together when the work before
  /// them ends, can start in either order), each grid waits for a peer grid that cannot start
  /// beside the other: nothing moves until the spinning grids time out and the call fails. So
  /// once the async lane exists, both engines' spinning grids take half of what the GPU holds
  /// (NOTE [shared GPU residency], with twice the grids); before it, one lane keeps the whole
  /// GPU. Idempotent; any thread.
  void share_gpu_with_lane() { gpu_grids_.store(2 * ranks_here_); }
  /// Spinning grids of this group that may be on its GPU at once (NOTE [shared GPU residency]).
  int gpu_grids() const { return gpu_grids_.load(); }

  /// Caps the grid of the fused small-message kernel (0: one block per SM). A tuning knob for
  /// the benchmark; the default comes from FASTCOMMS_FUSED_BLOCKS (unset: 0).
  void set_fused_max_blocks(int blocks) { fused_max_blocks_ = blocks < 0 ? 0 : blocks; }
  /// Largest per-peer chunk (bytes, over every pair of the call) that takes the flagged path
  /// (NOTE [flagged push]: no barriers, one kernel); 0 turns it off. Clamped to the capacity
  /// allocated at construction (FASTCOMMS_FLAGGED_MAX_BYTES, default 1 MiB; the buffers take 4 x
  /// size x that).
  void set_flagged_max_bytes(int64_t bytes) {
    flagged_max_ = std::clamp<int64_t>(bytes, 0, flagged_cap_);
  }
  int64_t flagged_max_bytes() const { return flagged_max_; }
  /// Bytes of the grow-only window copying calls land in (a call whose largest output needs more
  /// grows it, collectively; not while its stream captures a CUDA graph).
  int64_t window_bytes() const { return window_.bytes; }
  /// Bytes of device memory this group holds (windows, user windows, pads).
  int64_t memory_bytes() const;
  /// How the windows peers write are allocated: "vmm" or "ipc" (NOTE [vmm windows]).
  const char* window_alloc() const { return vmm_windows_ ? "vmm" : "ipc"; }
  /// Calls issued from the host so far (a captured call counts once).
  uint64_t epoch() const { return epoch_; }
  /// Calls completed on the device (NOTE [device epoch]; replays of a captured call count each
  /// time). Synchronizes the device.
  uint64_t device_epoch() const;
  /// The engine knobs this group runs with.
  const NvlinkTuning& tuning() const { return opt_.tuning; }
  /// Sets one knob for later calls (NvlinkTuning::set; flagged_max_bytes is clamped to the
  /// capacity allocated at construction). Host state only: safe between calls on every rank
  /// alike, since every knob that changes the path is decided on the agreed geometry.
  void tune(const std::string& knob, const std::string& value);
  /// What copy-engine calls outside a graph capture synchronise with: "memop" or "kernel"
  /// (NOTE [memop barrier]).
  /// Whether the memop waits flush remote writes (CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES).
  bool memops_flush() const { return memops_flush_; }
  const char* ce_barrier() const {
    return memops_ok_ && opt_.tuning.barrier == BarrierKind::kMemop ? "memop" : "kernel";
  }
  /// This group's setup.
  const NvlinkUlyssesOptions& options() const { return opt_; }

 private:
  struct Window {
    // This rank's memory: a cudaMalloc buffer shared by legacy IPC, or (NOTE [vmm windows]) a
    // cuMemCreate allocation shared as a file descriptor.
    cuda::DeviceBuffer ipc_local;
    cuda::VmmBuffer vmm_local;
    std::vector<cuda::IpcMapping> maps;    // index q: peer q's buffer (empty for q == rank)
    std::vector<cuda::VmmImport> imports;  // the same for VMM windows
    std::vector<void*> ptrs;               // index q: where to write for peer q
    int64_t bytes = 0;
    bool vmm = false;
    void* local() const { return vmm ? vmm_local.get() : ipc_local.get(); }
  };
  // Collective: `bytes` of device memory mapped into every peer; `vmm` picks the allocation.
  Window exchange(int64_t bytes, const std::string& tag, bool vmm = false);
  // Whether windows peers write (the group window, user windows) are VMM allocations.
  bool vmm_windows() const { return vmm_windows_; }
  void ensure_window(int64_t bytes, cudaStream_t stream);
  // The steps of run(): the path choice, the destination, the barrier arguments, the transfer
  // between the barriers, and the copy-out of a copying call.
  bool flagged_eligible(const plan::UlyssesPlan& p, TransferEngine engine) const;
  const Window& destination(const TensorView& out, const plan::UlyssesPlan& p, cudaStream_t stream);
  cuda::BarrierArgs barrier_args(uint64_t key) const;
  // Whether this copy-engine call takes the memop barriers (NOTE [memop barrier]).
  bool memop_barriers(cudaStream_t stream) const;
  // The token of slot `slot` of a call keyed `key` in this generation.
  uint64_t memop_token(uint64_t key, int slot) const;
  void memop_barrier(int slot, uint64_t token, cudaStream_t stream);
  void transfer(std::vector<cuda::CopyJob> remote, const cuda::CopyJob& own, cuda::BarrierArgs b,
                TransferEngine engine, int64_t max_chunk, cudaStream_t stream);
  // The remote copies of the copy-engine share on the side streams, forked from and joined back
  // into `stream` (which the exit barrier then follows).
  void copy_engine_remote(const std::vector<cuda::CopyJob>& remote, cudaStream_t stream);
  void copy_out(const TensorView& out, const plan::UlyssesPlan& p, const plan::UlyssesRequest& req,
                cudaStream_t stream, bool ce);
  void flagged_call(const TensorView& x, const TensorView& out, const plan::UlyssesPlan& p,
                    const plan::UlyssesRequest& req, cudaStream_t stream);
  std::string prefix() const;
  std::shared_ptr<const plan::UlyssesPlan> peer_plan(const plan::UlyssesPlan& mine,
                                                     plan::UlyssesRequest req, int q);

  NvlinkUlyssesOptions opt_;
  bool vmm_windows_ = false;
  std::unique_ptr<FdChannel> fds_;         // NOTE [vmm windows]: descriptors from peers
  std::vector<std::string> fd_addresses_;  // index q: peer q's channel address
  Window pads_;
  cuda::DeviceBuffer peer_pad_table_;  // device array of P pad pointers
  cuda::DeviceBuffer skip_;            // device int: transfer kernels skip when set
  cuda::DeviceBuffer sync_;            // device words: epoch (u64), go (u64), done (u32)
  cuda::PinnedBuffer error_;           // host-mapped int: BarrierError
  int* error_dev_ = nullptr;
  Window window_;  // grow-only destination for copying calls
  // NOTE [flagged push]: [2 halves][size senders][1 + cap / 8 lines of 16 bytes]
  Window flagged_;
  cuda::DeviceBuffer flagged_table_;  // device array of P flag-buffer pointers
  int64_t flagged_cap_ = 0;           // data bytes per slot
  int64_t flagged_max_ = 0;           // current threshold (<= cap)
  std::vector<std::unique_ptr<Window>> user_windows_;
  // The copy-engine side streams (tuning.ce_streams of them, made on first use).
  std::vector<cuda::Stream> ce_streams_;
  cuda::Event ce_fork_;
  std::vector<cuda::Event> ce_join_;
  // NOTE [memop barrier]: [2 stages][size senders] u64 slots, mapped into every peer; usable
  // when every rank's device runs memops (agreed at construction).
  Window memops_;
  bool memops_ok_ = false;
  bool memops_flush_ = false;          // waits flush remote writes (where the device can)
  std::string memops_why_;             // why memops_ok_ is false
  uint64_t memop_generation_ = 0;      // bumped when an error is reported (NOTE [memop watchdog])
  std::unique_ptr<MemopWatch> watch_;  // started with the first memop call
  DebugFaults faults_;
  int fused_max_blocks_ = 0;
  // spinning grids of this group that may be on this GPU at once (NOTE [shared GPU residency]):
  // the ranks of the group on it (ranks_here_) times the lanes that may be in flight there
  int ranks_here_ = 1;
  std::atomic<int> gpu_grids_{1};
  int launch_grids() const;  // gpu_grids_, or as with one lane under DebugFaults::one_lane_cap
  // the grids with one lane: each rank here, twice where several share the GPU (their lanes are
  // counted from the start there)
  int one_lane_grids() const { return ranks_here_ > 1 ? 2 * ranks_here_ : 1; }
  // Member q's rank in the plans this group runs (NvlinkUlyssesOptions::plan_ranks).
  int plan_rank(int q) const { return opt_.plan_ranks.empty() ? q : opt_.plan_ranks[q]; }
  uint64_t epoch_ = 0;
  uint64_t generation_ = 0;
  UlyssesPlanCache plans_;
};

}  // namespace fastcomms
