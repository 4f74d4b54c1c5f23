// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "backends/nvlink/nvlink_ulysses.hpp"

#include "backends/nvlink/fp8_dtypes.hpp"
#include "fastcomms/cuda/fp8.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

#include <unistd.h>

#include "backends/ipc/records.hpp"
#include "fastcomms/cuda/barrier.hpp"
#include "fastcomms/cuda/copy.hpp"
#include "fastcomms/cuda/memops.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {
constexpr int kSlotEntry = 0, kSlotExit = 1;
}  // namespace

namespace {
// A whole-string integer in [lo, hi] for knob `name`.
int64_t parse_int(const std::string& name, const std::string& value, int64_t lo, int64_t hi) {
  char* end = nullptr;
  const long long v = std::strtoll(value.c_str(), &end, 10);
  FASTCOMMS_CHECK(!value.empty() && end != nullptr && *end == 0 && v >= lo && v <= hi,
                  kInvalidArgument, "nvlink tuning: ", name, " must be an integer in [", lo, ", ",
                  hi, "], got '", value, "'");
  return v;
}
constexpr int64_t kMaxBytes = std::numeric_limits<int64_t>::max();
// Every knob and its environment variable (README's run-time settings).
const std::pair<const char*, const char*> kKnobs[] = {
    {"engine", "FASTCOMMS_ENGINE"},
    {"ce_crossover", "FASTCOMMS_CE_CROSSOVER"},
    {"hybrid_ce_percent", "FASTCOMMS_HYBRID_CE_PERCENT"},
    {"ce_streams", "FASTCOMMS_CE_STREAMS"},
    {"ce_own", "FASTCOMMS_CE_OWN"},
    {"copy_out", "FASTCOMMS_COPY_OUT"},
    {"window_alloc", "FASTCOMMS_WINDOW_ALLOC"},
    {"flagged_max_bytes", "FASTCOMMS_FLAGGED_MAX_BYTES"},
    {"fused_max_bytes", "FASTCOMMS_FUSED_MAX_BYTES"},
    {"fused_blocks", "FASTCOMMS_FUSED_BLOCKS"},
    {"barrier", "FASTCOMMS_BARRIER"},
};
}  // namespace

const std::vector<std::string>& NvlinkTuning::knobs() {
  static const std::vector<std::string> names = [] {
    std::vector<std::string> v;
    for (const auto& [knob, env] : kKnobs) v.emplace_back(knob);
    return v;
  }();
  return names;
}

void NvlinkTuning::set(const std::string& name, const std::string& value) {
  if (name == "engine") {
    FASTCOMMS_CHECK(value == "auto" || value == "ce" || value == "sm" || value == "hybrid",
                    kInvalidArgument, "nvlink tuning: engine must be auto, ce, sm or hybrid, got '",
                    value, "'");
    engine = value == "ce"       ? TransferEngine::kCopyEngine
             : value == "sm"     ? TransferEngine::kSM
             : value == "hybrid" ? TransferEngine::kHybrid
                                 : TransferEngine::kAuto;
  } else if (name == "ce_crossover") {
    ce_crossover = parse_int(name, value, 0, kMaxBytes);
  } else if (name == "hybrid_ce_percent") {
    hybrid_ce_percent = static_cast<int>(parse_int(name, value, 0, 100));
  } else if (name == "ce_streams") {
    ce_streams = static_cast<int>(parse_int(name, value, 1, 64));
  } else if (name == "ce_own") {
    FASTCOMMS_CHECK(value == "ce" || value == "sm", kInvalidArgument,
                    "nvlink tuning: ce_own must be ce or sm, got '", value, "'");
    own_share_sm = value == "sm";
  } else if (name == "copy_out") {
    FASTCOMMS_CHECK(value == "auto" || value == "ce" || value == "sm", kInvalidArgument,
                    "nvlink tuning: copy_out must be auto, ce or sm, got '", value, "'");
    copy_out = value == "ce"   ? CopyOutEngine::kCopyEngine
               : value == "sm" ? CopyOutEngine::kSM
                               : CopyOutEngine::kAuto;
  } else if (name == "window_alloc") {
    FASTCOMMS_CHECK(value == "auto" || value == "vmm" || value == "ipc", kInvalidArgument,
                    "nvlink tuning: window_alloc must be auto, vmm or ipc, got '", value, "'");
    window_alloc = value;
  } else if (name == "flagged_max_bytes") {
    flagged_max_bytes = parse_int(name, value, 0, int64_t{1} << 30) / 8 * 8;
  } else if (name == "fused_max_bytes") {
    fused_max_bytes = parse_int(name, value, 0, kMaxBytes);
  } else if (name == "barrier") {
    FASTCOMMS_CHECK(value == "auto" || value == "kernel" || value == "memop", kInvalidArgument,
                    "nvlink tuning: barrier must be auto, kernel or memop, got '", value, "'");
    barrier = value == "kernel"  ? BarrierKind::kKernel
              : value == "memop" ? BarrierKind::kMemop
                                 : BarrierKind::kAuto;
  } else if (name == "fused_blocks") {
    fused_blocks = static_cast<int>(parse_int(name, value, 0, 1 << 20));
  } else {
    std::string all;
    for (const auto& k : knobs()) all += (all.empty() ? "" : ", ") + k;
    throw Error(ErrorCode::kInvalidArgument,
                detail::cat("nvlink tuning: no knob '", name, "' (there are: ", all, ")"));
  }
}

const NvlinkTuning& NvlinkTuning::from_env() {
  static const NvlinkTuning t = [] {
    NvlinkTuning v;
    for (const auto& [knob, env] : kKnobs) {
      const char* e = std::getenv(env);
      if (e == nullptr || *e == 0) continue;
      try {
        v.set(knob, e);
      } catch (const Error& err) {
        throw Error(err.code(), detail::cat(env, ": ", err.what()));
      }
    }
    return v;
  }();
  return t;
}

void NvlinkUlysses::tune(const std::string& knob, const std::string& value) {
  FASTCOMMS_CHECK(knob != "window_alloc", kInvalidArgument, prefix(),
                  "window_alloc is fixed when the group is made (FASTCOMMS_WINDOW_ALLOC)");
  NvlinkTuning t = opt_.tuning;
  t.set(knob, value);
  FASTCOMMS_CHECK(t.barrier != BarrierKind::kMemop || memops_ok_, kUnsupported, prefix(),
                  "barrier=memop, but ",
                  memops_why_.empty() ? "the group is one rank" : memops_why_);
  if (knob == "flagged_max_bytes") set_flagged_max_bytes(t.flagged_max_bytes);
  if (knob == "fused_blocks") set_fused_max_blocks(t.fused_blocks);
  opt_.tuning = t;
}

std::string NvlinkUlysses::prefix() const {
  return detail::cat("[rank ", opt_.rank, "/", opt_.size, " ", opt_.name, "] all_to_all_4d: ");
}

NvlinkUlysses::NvlinkUlysses(NvlinkUlyssesOptions options) : opt_(std::move(options)) {
  FASTCOMMS_CHECK(opt_.store != nullptr, kInvalidArgument, prefix(), "a store is required");
  FASTCOMMS_CHECK(opt_.size >= 1 && opt_.rank >= 0 && opt_.rank < opt_.size, kInvalidArgument,
                  prefix(), "rank ", opt_.rank, " is not in a group of ", opt_.size);
  FASTCOMMS_CHECK(opt_.plan_ranks.empty() || static_cast<int>(opt_.plan_ranks.size()) == opt_.size,
                  kInvalidArgument, prefix(), "plan_ranks names ", opt_.plan_ranks.size(),
                  " ranks for a group of ", opt_.size);
  cuda::DeviceGuard guard(opt_.device);
  // NOTE [vmm windows]: every rank says what it can do; VMM only when all can (and were asked).
  const std::string& alloc = opt_.tuning.window_alloc;
  std::string why;
  const bool can = opt_.size > 1 && alloc != "ipc" && cuda::vmm_supported(opt_.device, &why);
  FASTCOMMS_CHECK(alloc != "vmm" || can || opt_.size == 1, kUnsupported, prefix(),
                  "FASTCOMMS_WINDOW_ALLOC=vmm, but ", why);
  if (can) fds_ = std::make_unique<FdChannel>();
  opt_.store->set_string(detail::cat(opt_.name, "/fdchannel/", opt_.rank),
                         can ? fds_->address() : std::string("-"));
  fd_addresses_.resize(opt_.size);
  bool all = can;
  for (int q = 0; q < opt_.size; ++q) {
    fd_addresses_[q] =
        opt_.store->get_string(detail::cat(opt_.name, "/fdchannel/", q), opt_.timeout);
    ipc_records::check_fd_address(fd_addresses_[q], q, prefix());  // NOTE [ipc records]
    all = all && fd_addresses_[q] != "-";
  }
  FASTCOMMS_CHECK(alloc != "vmm" || all || opt_.size == 1, kUnsupported, prefix(),
                  "FASTCOMMS_WINDOW_ALLOC=vmm, but a peer cannot share VMM memory");
  vmm_windows_ = all;
  if (!all) fds_.reset();
  pads_ = exchange(static_cast<int64_t>(cuda::pad_bytes(opt_.size)), "pads");
  FASTCOMMS_CUDA_CHECK(cudaMemset(pads_.local(), 0, pads_.bytes));
  peer_pad_table_ = cuda::DeviceBuffer(sizeof(void*) * opt_.size);
  FASTCOMMS_CUDA_CHECK(cudaMemcpy(peer_pad_table_.get(), pads_.ptrs.data(),
                                  sizeof(void*) * opt_.size, cudaMemcpyHostToDevice));
  skip_ = cuda::DeviceBuffer(sizeof(int));
  FASTCOMMS_CUDA_CHECK(cudaMemset(skip_.get(), 0, sizeof(int)));
  sync_ = cuda::DeviceBuffer(32);
  FASTCOMMS_CUDA_CHECK(cudaMemset(sync_.get(), 0, 32));
  error_ = cuda::PinnedBuffer(sizeof(int));
  std::memset(error_.get(), 0, sizeof(int));
  FASTCOMMS_CUDA_CHECK(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_dev_), error_.get(), 0));
  // The flagged small-message buffers (NOTE [flagged push]), zeroed before peers may write.
  flagged_cap_ = opt_.size == 1 ? 0 : std::max<int64_t>(0, opt_.tuning.flagged_max_bytes) / 8 * 8;
  if (opt_.size > 1) {
    // Exchanged even when off (16 bytes), so that ranks started with different settings fail
    // here, on the sizes, instead of disagreeing at every call.
    const int64_t lines = 2 * int64_t{opt_.size} * (1 + flagged_cap_ / 8);
    flagged_ = exchange(flagged_cap_ > 0 ? lines * 16 : 16, "flagged");
    FASTCOMMS_CUDA_CHECK(cudaMemset(flagged_.local(), 0, flagged_.bytes));
    flagged_table_ = cuda::DeviceBuffer(sizeof(void*) * opt_.size);
    FASTCOMMS_CUDA_CHECK(cudaMemcpy(flagged_table_.get(), flagged_.ptrs.data(),
                                    sizeof(void*) * opt_.size, cudaMemcpyHostToDevice));
    flagged_max_ = flagged_cap_;
  }
  set_fused_max_blocks(opt_.tuning.fused_blocks);
  if (opt_.size > 1) {
    // NOTE [memop barrier]: every rank says whether its device runs stream memory operations,
    // and its GPU's PCI bus id: measured (docs/benchmarks.md, "memop barriers"), with two ranks
    // on one GPU the memop barriers let a rank read its window before a peer's copies had
    // landed (1-2% of copy-engine calls in worlds 3 and 4 on 2xH200), so they are refused there.
    std::string no_memops;
    const bool mine = cuda::memops_supported(opt_.device, &no_memops);
    char bus[32] = {0};
    FASTCOMMS_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, opt_.device));
    opt_.store->set_string(detail::cat(opt_.name, "/memops/", opt_.rank),
                           detail::cat(mine ? "1 " : "0 ", bus));
    bool all_memops = mine;
    std::vector<std::string> buses;
    for (int q = 0; q < opt_.size; ++q) {
      const std::string v =
          opt_.store->get_string(detail::cat(opt_.name, "/memops/", q), opt_.timeout);
      all_memops = all_memops && v.rfind("1 ", 0) == 0;
      buses.push_back(v.size() > 2 ? v.substr(2) : v);
    }
    // NOTE [shared GPU residency]: the spinning grids that may share this rank's GPU at once:
    // each rank of the group on it (itself included), twice where there are several (a sync call
    // and an async call, on the group's two lanes, may be in flight together).
    ranks_here_ = static_cast<int>(std::count(buses.begin(), buses.end(), std::string(bus)));
    gpu_grids_.store(one_lane_grids());  // until an async lane exists
    std::sort(buses.begin(), buses.end());
    const bool shared = std::adjacent_find(buses.begin(), buses.end()) != buses.end();
    memops_why_ = !mine ? no_memops
                  : !all_memops
                      ? std::string("a peer's device does not run stream memory operations")
                  : shared ? std::string(
                                 "two ranks of the group share a GPU, where the memop "
                                 "barriers were measured to let a call read early")
                           : std::string();
    memops_ok_ = memops_why_.empty();
    FASTCOMMS_CHECK(opt_.tuning.barrier != BarrierKind::kMemop || memops_ok_, kUnsupported,
                    prefix(), "FASTCOMMS_BARRIER=memop, but ", memops_why_);
    memops_flush_ = memops_ok_ && cuda::memops_can_flush(opt_.device);
    memops_ = exchange(static_cast<int64_t>(2 * sizeof(uint64_t) * opt_.size), "memops");
    FASTCOMMS_CUDA_CHECK(cudaMemset(memops_.local(), 0, memops_.bytes));
  }
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
  // Every pad must be zeroed before any peer signals into it.
  opt_.store->set_string(detail::cat(opt_.name, "/pads_zeroed/", opt_.rank), "1");
  for (int q = 0; q < opt_.size; ++q)
    opt_.store->wait({detail::cat(opt_.name, "/pads_zeroed/", q)}, opt_.timeout);
}

NvlinkUlysses::~NvlinkUlysses() {
  // Local work only: let this device finish what was enqueued before unmapping.
  (void)cudaSetDevice(opt_.device);
  (void)cudaDeviceSynchronize();  // the watchdog still releases a wait that times out meanwhile
  watch_.reset();
}

NvlinkUlysses::Window NvlinkUlysses::exchange(int64_t bytes, const std::string& tag, bool vmm) {
  Window w;
  w.bytes = bytes;
  w.vmm = vmm;
  const uint64_t generation = generation_++;
  const std::string base = detail::cat(opt_.name, "/", tag, "/", generation, "/");
  // The record every peer checks: the size and how it is shared; for legacy IPC the handle.
  cudaIpcMemHandle_t handle{};
  int fd = -1;
  int64_t mapped = bytes;
  if (vmm) {
    w.vmm_local = cuda::VmmBuffer(static_cast<size_t>(std::max<int64_t>(bytes, 16)), opt_.device);
    mapped = static_cast<int64_t>(w.vmm_local.size());
    fd = w.vmm_local.export_fd();
  } else {
    w.ipc_local = cuda::DeviceBuffer(static_cast<size_t>(std::max<int64_t>(bytes, 16)));
    FASTCOMMS_CUDA_CHECK(cudaIpcGetMemHandle(&handle, w.ipc_local.get()));
  }
  const int64_t kind = vmm ? 1 : 0;
  ipc_records::WindowRecord mine;  // NOTE [ipc records]
  static_assert(sizeof handle == ipc_records::kHandleBytes);
  std::memcpy(mine.handle.data(), &handle, sizeof handle);
  mine.bytes = bytes;
  mine.kind = kind;
  opt_.store->set(base + std::to_string(opt_.rank), ipc_records::encode(mine));
  w.maps.resize(opt_.size);
  w.imports.resize(opt_.size);
  w.ptrs.resize(opt_.size);
  try {
    // VMM: the descriptor goes to every peer first (a listener keeps what it has not asked for
    // yet), then each peer's comes in.
    for (int k = 1; vmm && k < opt_.size; ++k) {
      const int q = (opt_.rank + k) % opt_.size;
      FdChannel::send(fd_addresses_[q], {generation, opt_.rank, mapped}, fd, opt_.timeout);
    }
  } catch (...) {
    if (fd >= 0) ::close(fd);
    throw;
  }
  if (fd >= 0) ::close(fd);
  for (int q = 0; q < opt_.size; ++q) {
    if (q == opt_.rank) {
      w.ptrs[q] = w.local();
      continue;
    }
    std::vector<uint8_t> v;
    try {
      v = opt_.store->get(base + std::to_string(q), opt_.timeout);
    } catch (const Error& e) {
      throw Error(e.code(), detail::cat(prefix(), "rank ", q, " did not publish its ", tag,
                                        " window: ", e.what()));
    }
    const auto rec = ipc_records::decode_window(v, bytes, kind, q, prefix(), tag);
    cudaIpcMemHandle_t peer;
    std::memcpy(&peer, rec.handle.data(), sizeof peer);
    if (vmm) {
      const FdChannel::Received r = fds_->receive(generation, q, opt_.timeout);
      try {
        ipc_records::check_import_size(r.bytes, bytes, q, prefix());
      } catch (...) {
        ::close(r.fd);
        throw;
      }
      try {
        w.imports[q] = cuda::VmmImport(r.fd, static_cast<size_t>(r.bytes), opt_.device);
      } catch (...) {
        ::close(r.fd);
        throw;
      }
      ::close(r.fd);
      w.ptrs[q] = w.imports[q].get();
    } else {
      w.maps[q] = cuda::IpcMapping(peer);
      w.ptrs[q] = w.maps[q].get();
    }
  }
  return w;
}

void NvlinkUlysses::ensure_window(int64_t bytes, cudaStream_t stream) {
  if (window_.bytes >= bytes) return;
  // Growing is collective and rare: every rank reaches the same decision from the same call.
  // Drain this rank's use of the old window, agree through the store, then swap.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FASTCOMMS_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  FASTCOMMS_CHECK(capture == cudaStreamCaptureStatusNone, kInvalidArgument, prefix(),
                  "all_to_all_4d: the window must grow to ", bytes,
                  " bytes, which cannot happen while the stream captures a CUDA graph; run the "
                  "call once outside the capture first (or pass an empty_output() buffer as out)");
  FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(stream));
  Window fresh = exchange(std::max(bytes, window_.bytes * 2), "window", vmm_windows_);
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
  window_ = std::move(fresh);
}

void NvlinkUlysses::flagged_call(const TensorView& x, const TensorView& out,
                                 const plan::UlyssesPlan& p, const plan::UlyssesRequest& req,
                                 cudaStream_t stream) {
  // NOTE [flagged push]: every pair exchanges at least its header, so empty puts are kept.
  std::vector<cuda::CopyJob> sends, recvs;
  std::vector<int> send_peer, recv_peer;
  for (int k = 0; k < opt_.size; ++k) {
    const int q = (opt_.rank + k) % opt_.size;  // rotated: ranks do not all start at peer 0
    sends.push_back({x.data, q == opt_.rank ? out.data : nullptr, p.puts[plan_rank(q)]});
    send_peer.push_back(q);
    if (q == opt_.rank) continue;
    recvs.push_back(
        {nullptr, out.data, peer_plan(p, req, plan_rank(q))->puts[plan_rank(opt_.rank)]});
    recv_peer.push_back(q);
  }
  ++epoch_;
  cuda::FlaggedPushArgs f;
  f.epoch = static_cast<uint64_t*>(sync_.get());
  f.done = reinterpret_cast<unsigned int*>(static_cast<uint64_t*>(sync_.get()) + 2);
  f.local = static_cast<const uint4*>(flagged_.local());
  f.peers = static_cast<uint4* const*>(flagged_table_.get());
  f.rank = opt_.rank;
  f.size = opt_.size;
  f.slot_lines = 1 + flagged_cap_ / 8;
  f.key = p.geometry_key;
  f.error = error_dev_;
  f.skip = static_cast<int*>(skip_.get());
  f.timeout_ns = static_cast<uint64_t>(opt_.timeout.count()) * 1'000'000ull;
  f.max_blocks = fused_max_blocks_;
  f.gpu_grids = launch_grids();
  cuda::flagged_push_async(f, sends.data(), send_peer.data(), static_cast<int>(sends.size()),
                           recvs.data(), recv_peer.data(), static_cast<int>(recvs.size()), stream);
}

void* NvlinkUlysses::empty_output(int64_t bytes) {
  FASTCOMMS_CHECK(bytes > 0, kInvalidArgument, prefix(), "empty_output needs bytes > 0, got ",
                  bytes);
  cuda::DeviceGuard guard(opt_.device);
  user_windows_.push_back(std::make_unique<Window>(exchange(bytes, "user", vmm_windows_)));
  return user_windows_.back()->local();
}

std::shared_ptr<const plan::UlyssesPlan> NvlinkUlysses::peer_plan(const plan::UlyssesPlan& mine,
                                                                  plan::UlyssesRequest req, int q) {
  // Peer q's plan for the same call: its input shape follows from the (agreed) global geometry:
  // mode 0 takes q's sequence shard, mode 1 q's head shard.
  req.rank = q;
  if (req.mode == 0)
    req.shape[1] = mine.seq_splits[q];
  else
    req.shape[2] = mine.head_splits[q];
  return plans_.get(req);
}

void* NvlinkUlysses::peer_window(const void* local, int q) const {
  for (const auto& w : user_windows_)
    if (w->local() == local && q >= 0 && q < opt_.size) return w->ptrs[q];
  return nullptr;
}

int NvlinkUlysses::launch_grids() const {
  // NOTE [two lanes on one GPU]: the control grids as before the second lane counted
  if (faults_.one_lane_cap) return one_lane_grids();
  return gpu_grids_.load();
}

void NvlinkUlysses::check_errors() {
  const int e = *static_cast<volatile int*>(error_.get());
  if (e == cuda::kBarrierOk) return;
  *static_cast<volatile int*>(error_.get()) = 0;
  ++memop_generation_;  // NOTE [memop watchdog]: late tokens of the failed call match no wait
  {
    cuda::DeviceGuard guard(opt_.device);
    // Later calls run again. NOTE [legacy stream ordering]: a plain cudaMemset is not ordered
    // before a kernel on the caller's non-blocking stream, whose blocks would read the old skip
    // word and leave the output unwritten without an error; so the reset is waited for here, on
    // a stream of its own (not the device: a grid of another call may still spin until its own
    // timeout).
    cuda::Stream reset;
    FASTCOMMS_CUDA_CHECK(cudaMemsetAsync(skip_.get(), 0, sizeof(int), reset.get()));
    FASTCOMMS_CUDA_CHECK(cudaStreamSynchronize(reset.get()));
  }
  throw Error(e == cuda::kBarrierTimeout ? ErrorCode::kTimeout : ErrorCode::kInvalidArgument,
              prefix() + (e == cuda::kBarrierTimeout
                              ? "a peer did not reach the device barrier within the timeout"
                              : "ranks disagree on the call (a peer's geometry key differs, or "
                                "a peer gave up on it); the transfer was skipped or its result "
                                "is void"));
}

uint64_t NvlinkUlysses::device_epoch() const {
  cuda::DeviceGuard guard(opt_.device);
  uint64_t e = 0;
  FASTCOMMS_CUDA_CHECK(cudaDeviceSynchronize());
  FASTCOMMS_CUDA_CHECK(cudaMemcpy(&e, sync_.get(), sizeof e, cudaMemcpyDeviceToHost));
  return e;
}

int64_t NvlinkUlysses::memory_bytes() const {
  int64_t total = pads_.bytes + window_.bytes + flagged_.bytes + memops_.bytes;
  for (const auto& w : user_windows_) total += w->bytes;
  return total;
}

std::array<int64_t, 4> NvlinkUlysses::output_shape(const TensorView& x,
                                                   const UlyssesArgs& args) const {
  return plan::ulysses_output_shape(
      ulysses_request(x, args, opt_.rank, opt_.size, opt_.name, plan::Path::kPeerToPeer));
}

void NvlinkUlysses::all_to_all_4d(const TensorView& x, const TensorView& out,
                                  const UlyssesArgs& args, cudaStream_t stream,
                                  TransferEngine engine) {
  const std::string where = prefix();
  const plan::UlyssesRequest req =
      ulysses_request(x, args, opt_.rank, opt_.size, opt_.name, plan::Path::kPeerToPeer);
  FASTCOMMS_CHECK(x.device.type == DeviceType::kCUDA && x.device.index == opt_.device,
                  kInvalidArgument, where, "x is on ", x.device.str(),
                  ", the group serves cuda:", opt_.device);
  const auto plan_ptr = plans_.get(req);
  check_ulysses_out(x, out, *plan_ptr, where);
  run(x, out, req, *plan_ptr, stream, engine);
}

void NvlinkUlysses::run(const TensorView& x, const TensorView& out, const plan::UlyssesRequest& req,
                        const plan::UlyssesPlan& p, cudaStream_t stream, TransferEngine engine) {
  check_errors();  // a device-side failure of an earlier call surfaces here, on every rank
  cuda::DeviceGuard guard(opt_.device);
  // NOTE [a group of one rank]: no peer, so no barrier, no epoch and no window: the call is one
  // copy of x into out (the plan's own-share descriptor) on the copy engine, a single memcpy
  // node when captured in a CUDA graph. Zero copy and copying are the same call here.
  const int me = plan_rank(opt_.rank);
  if (opt_.size == 1) {
    if (!p.puts[me].empty() && !faults_.skip_transfer)
      cuda::copy_engine_async({x.data, out.data, p.puts[me]}, stream);
    return;
  }
  if (flagged_eligible(p, engine)) {
    flagged_call(x, out, p, req, stream);
    return;
  }
  const Window& dest = destination(out, p, stream);
  // NOTE [copying path]: without a zero-copy `out`, peers write into this rank's window and a
  // copy-out moves their regions into `out` after the exit barrier; this rank's own share goes
  // straight into `out` (it never crosses a link, so it needs no window and no copy-out).
  const bool copying = &dest == &window_;
  // Ranks must agree on zero copy or not: the key carries the choice.
  const uint64_t key = p.geometry_key ^ (copying ? 0 : 0x9e3779b97f4a7c15ull);
  // This rank's own share (it never crosses a link: straight into `out` when copying) and the
  // remote blocks, rotated so that ranks do not all hit peer 0 first.
  const cuda::CopyJob own{x.data, copying ? out.data : dest.ptrs[opt_.rank], p.puts[me]};
  std::vector<cuda::CopyJob> remote;
  int64_t max_chunk = p.puts[me].bytes();
  for (int k = 1; k < opt_.size; ++k) {
    const int peer = (opt_.rank + k) % opt_.size;
    const plan::CopyDesc& put = p.puts[plan_rank(peer)];
    max_chunk = std::max(max_chunk, put.bytes());
    if (!put.empty()) remote.push_back({x.data, dest.ptrs[peer], put});
  }
  ++epoch_;
  if (engine == TransferEngine::kAuto)
    engine =
        max_chunk >= opt_.tuning.ce_crossover ? TransferEngine::kCopyEngine : TransferEngine::kSM;
  transfer(std::move(remote), own, barrier_args(key), engine, max_chunk, stream);
  // NOTE [copy-out engine]: the copy-out of a copying call runs on the SM kernel unless
  // FASTCOMMS_COPY_OUT=ce. Measured on 2xH200 (docs/benchmarks.md): the copy engines took about
  // 250 us for the 185 MiB local copy-out of (1,37800,40,128), the SM kernel about 100 us, and an
  // async copying call under a GEMM chain hid no more of itself with them (44% vs 55-62%).
  const bool ce_out = opt_.tuning.copy_out == CopyOutEngine::kCopyEngine;
  if (copying && p.out_bytes > 0) copy_out(out, p, req, stream, ce_out);
}

void NvlinkUlysses::run_fp8(const TensorView& x, const TensorView& out, float* scales,
                            const plan::UlyssesPlan& p8, DType wire, cudaStream_t stream) {
  check_errors();
  cuda::DeviceGuard guard(opt_.device);
  FASTCOMMS_CHECK(opt_.size > 1, kInvalidArgument, prefix(), "the fused FP8 path needs peers");
  const int64_t d = p8.d;
  // The window: FP8 rows laid out as the largest output, then one scale per row.
  const int64_t q_bytes = (p8.max_out_bytes + 15) / 16 * 16;
  const int64_t rows_max = d > 0 ? p8.max_out_bytes / d : 0;
  ensure_window(q_bytes + 4 * rows_max + 16, stream);
  std::vector<cuda::Fp8PushJob> jobs;
  for (int k = 0; k < opt_.size; ++k) {  // rotated: ranks do not all start at peer 0
    const int peer = (opt_.rank + k) % opt_.size;
    const plan::CopyDesc& put = p8.puts[plan_rank(peer)];
    if (put.empty()) continue;
    auto* base = static_cast<char*>(window_.ptrs[peer]);
    jobs.push_back({x.data, base, reinterpret_cast<float*>(base + q_bytes), put});
  }
  // Ranks must agree that the call is FP8 and in which format: the key carries both.
  const uint64_t key = p8.geometry_key ^ (0xf8f8f8f8f8f8f8f8ull + static_cast<uint64_t>(wire));
  ++epoch_;
  cuda::BarrierArgs b = barrier_args(key);
  b.slot = kSlotEntry;
  cuda::barrier_async(b, stream);
  cuda::fp8_quantize_push(jobs.data(), static_cast<int>(jobs.size()), d, fp8_value_of(x.dtype),
                          fp8_wire_of(wire), stream);
  b.slot = kSlotExit;
  b.advance = true;
  cuda::barrier_async(b, stream);
  const auto* local = static_cast<const char*>(window_.local());
  const auto* local_scales = reinterpret_cast<const float*>(local + q_bytes);
  const int64_t rows = d > 0 ? p8.out_bytes / d : 0;
  if (scales == nullptr) {
    cuda::fp8_dequantize_rows(local, fp8_wire_of(wire), local_scales, rows, d, out.data,
                              fp8_value_of(out.dtype), stream);
    return;
  }
  if (p8.out_bytes > 0) {
    FASTCOMMS_CUDA_CHECK(
        cudaMemcpyAsync(out.data, local, p8.out_bytes, cudaMemcpyDeviceToDevice, stream));
    FASTCOMMS_CUDA_CHECK(cudaMemcpyAsync(scales, local_scales, rows * sizeof(float),
                                         cudaMemcpyDeviceToDevice, stream));
  }
}

bool NvlinkUlysses::flagged_eligible(const plan::UlyssesPlan& p, TransferEngine engine) const {
  if (engine != TransferEngine::kAuto && engine != TransferEngine::kSM) return false;
  // Decided on the global geometry, so every rank of a consistent call decides alike; not under
  // the barrier paths' test faults.
  const auto biggest = [](const std::vector<int64_t>& v) {
    return v.empty() ? int64_t{0} : *std::max_element(v.begin(), v.end());
  };
  const int64_t chunk = p.b * biggest(p.seq_splits) * biggest(p.head_splits) * p.d * p.element_size;
  return flagged_max_ > 0 && chunk <= flagged_max_ && !faults_.any() && opt_.size > 1 &&
         2 * opt_.size - 1 <= 16 && (p.d * p.element_size) % 8 == 0;
}

const NvlinkUlysses::Window& NvlinkUlysses::destination(const TensorView& out,
                                                        const plan::UlyssesPlan& p,
                                                        cudaStream_t stream) {
  // A user window when `out` is one (zero copy), else the group's window.
  for (const auto& w : user_windows_) {
    if (w->local() != out.data) continue;
    FASTCOMMS_CHECK(w->bytes >= p.max_out_bytes, kInvalidArgument, prefix(),
                    "the empty_output buffer holds ", w->bytes, " bytes, the call needs ",
                    p.max_out_bytes, " on some rank");
    return *w;
  }
  ensure_window(p.max_out_bytes, stream);
  return window_;
}

cuda::BarrierArgs NvlinkUlysses::barrier_args(uint64_t key) const {
  cuda::BarrierArgs b;
  b.local_pad = static_cast<uint64_t*>(pads_.local());
  b.peer_pads = static_cast<uint64_t* const*>(peer_pad_table_.get());
  b.rank = opt_.rank;
  b.size = opt_.size;
  // NOTE [device epoch]: the epoch lives on the device (sync_ word 0); barriers publish one past
  // it and the call's last barrier stores it back, so a captured graph advances on each replay.
  b.epoch = static_cast<uint64_t*>(sync_.get());
  b.key = key;
  b.error = error_dev_;
  b.skip = static_cast<int*>(skip_.get());
  b.timeout_ns = static_cast<uint64_t>(opt_.timeout.count()) * 1'000'000ull;
  if (flagged_cap_ > 0) {  // NOTE [one call, two paths]
    b.flag_peers = static_cast<uint4* const*>(flagged_table_.get());
    b.flag_local = static_cast<const uint4*>(flagged_.local());
    b.flag_slot_lines = 1 + flagged_cap_ / 8;
  }
  return b;
}

void NvlinkUlysses::transfer(std::vector<cuda::CopyJob> remote, const cuda::CopyJob& own,
                             cuda::BarrierArgs b, TransferEngine engine, int64_t max_chunk,
                             cudaStream_t stream) {
  if (engine == TransferEngine::kSM && max_chunk <= opt_.tuning.fused_max_bytes &&
      !faults_.skip_entry_barrier && !faults_.unfused && !faults_.skip_transfer &&
      remote.size() < 16) {
    // One launch: entry barrier, push, exit barrier (NOTE [fused push]).
    std::vector<cuda::CopyJob> jobs;
    if (!own.desc.empty()) jobs.push_back(own);
    jobs.insert(jobs.end(), remote.begin(), remote.end());
    cuda::FusedPushArgs f;
    f.bar = b;
    f.go = static_cast<uint64_t*>(sync_.get()) + 1;
    f.done = reinterpret_cast<unsigned int*>(static_cast<uint64_t*>(sync_.get()) + 2);
    f.max_blocks = fused_max_blocks_;
    f.gpu_grids = launch_grids();
    cuda::fused_push_async(f, jobs.data(), static_cast<int>(jobs.size()), stream);
    return;
  }
  // NOTE [memop barrier]: the copy-engine path without any kernel, outside graph capture.
  const bool memop = engine == TransferEngine::kCopyEngine && memop_barriers(stream);
  MemopWatch::Ticket ticket;
  if (memop) {
    if (!watch_) {
      std::vector<uint64_t*> peers(opt_.size);
      for (int q = 0; q < opt_.size; ++q) peers[q] = static_cast<uint64_t*>(memops_.ptrs[q]);
      watch_ = std::make_unique<MemopWatch>(
          opt_.device, opt_.rank, opt_.size, static_cast<uint64_t*>(memops_.local()),
          std::move(peers), static_cast<volatile int*>(error_.get()), opt_.timeout);
    }
    ticket = watch_->take();
    ticket.generation = memop_generation_;
    ticket.tokens[0] = memop_token(b.key, kSlotEntry);
    ticket.tokens[1] = memop_token(b.key, kSlotExit);
    FASTCOMMS_CUDA_CHECK(cudaEventRecord(ticket.start, stream));
    if (!faults_.skip_entry_barrier) memop_barrier(kSlotEntry, ticket.tokens[0], stream);
    FASTCOMMS_CUDA_CHECK(cudaEventRecord(ticket.mid, stream));
  }
  b.slot = kSlotEntry;
  if (!faults_.skip_entry_barrier && !memop) cuda::barrier_async(b, stream);
  // NOTE [copy-engine path]: the remote blocks go to the copy engines as pitched 2D/3D copies
  // (one per peer and block, every batch element in one 3D copy) on one side stream, forked
  // from the caller's stream after the entry barrier and joined back before the exit barrier;
  // this rank's own share moves on the caller's stream meanwhile. The hybrid gives the copy
  // engines `hybrid_ce_percent` of every remote block's rows and the SM kernel the rest.
  std::vector<cuda::CopyJob> ce_jobs, sm_jobs;
  if (engine == TransferEngine::kHybrid) {
    const int ce_percent = opt_.tuning.hybrid_ce_percent;
    for (const auto& j : remote) {
      const auto tenths = plan::split_desc(j.desc, 10);
      const size_t to_ce = (tenths.size() * ce_percent + 50) / 100;
      for (size_t i = 0; i < tenths.size(); ++i)
        (i < to_ce ? ce_jobs : sm_jobs).push_back({j.src, j.dst, tenths[i]});
    }
  } else if (engine == TransferEngine::kCopyEngine) {
    ce_jobs = std::move(remote);
  } else {
    sm_jobs = std::move(remote);
  }
  const bool own_on_sm = engine != TransferEngine::kCopyEngine || opt_.tuning.own_share_sm;
  if (faults_.skip_transfer) ce_jobs.clear(), sm_jobs.clear();
  if (!ce_jobs.empty()) copy_engine_remote(ce_jobs, stream);
  if (!own.desc.empty() && !faults_.skip_transfer) {
    if (own_on_sm)
      sm_jobs.insert(sm_jobs.begin(), own);
    else
      cuda::copy_engine_async(own, stream);
  }
  if (!sm_jobs.empty()) {
    cuda::copy_sm_async(sm_jobs.data(), static_cast<int>(sm_jobs.size()), 0, stream,
                        static_cast<const int*>(skip_.get()));
  }
  // The exit barrier tells peers their payload has landed, so it waits for the copy engines
  // (a copy is complete once the stream that issued it reaches the join).
  if (!ce_jobs.empty() && !faults_.skip_ce_join) {
    for (size_t k = 0; k < ce_streams_.size(); ++k) ce_join_[k].wait_on(stream);
  }
  if (memop) {
    memop_barrier(kSlotExit, ticket.tokens[1], stream);
    FASTCOMMS_CUDA_CHECK(cudaEventRecord(ticket.end, stream));
    watch_->submit(ticket);
    return;
  }
  b.slot = kSlotExit;
  b.advance = true;
  cuda::barrier_async(b, stream);
}

bool NvlinkUlysses::memop_barriers(cudaStream_t stream) const {
  if (!memops_ok_ || opt_.tuning.barrier != BarrierKind::kMemop) return false;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FASTCOMMS_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  return capture == cudaStreamCaptureStatusNone;
}

uint64_t NvlinkUlysses::memop_token(uint64_t key, int slot) const {
  // NOTE [memop watchdog]: the generation in the top 24 bits (never 0), a mix of the key and the
  // slot below.
  uint64_t h = key ^ (0x9e3779b97f4a7c15ull * static_cast<uint64_t>(slot + 1));
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return ((memop_generation_ + 1) << 40) | (h & ((uint64_t{1} << 40) - 1));
}

void NvlinkUlysses::memop_barrier(int slot, uint64_t token, cudaStream_t stream) {
  std::vector<uint64_t*> remote(opt_.size), local(opt_.size);
  for (int q = 0; q < opt_.size; ++q) {
    remote[q] = static_cast<uint64_t*>(memops_.ptrs[q]) + slot * opt_.size + opt_.rank;
    local[q] = static_cast<uint64_t*>(memops_.local()) + slot * opt_.size + q;
  }
  cuda::memop_barrier_async(remote, local, opt_.rank, token, memops_flush_, stream);
}

void NvlinkUlysses::copy_engine_remote(const std::vector<cuda::CopyJob>& remote,
                                       cudaStream_t stream) {
  const int fan = std::max(1, opt_.tuning.ce_streams);
  while (static_cast<int>(ce_streams_.size()) < fan) {
    ce_streams_.emplace_back(false);
    ce_join_.emplace_back(false);
  }
  // Every side stream made so far is forked and joined (a knob lowered later leaves idle ones,
  // which join at once), so the exit barrier's wait list never misses a stream in use.
  ce_fork_.record(stream);
  for (auto& s : ce_streams_) {
    ce_fork_.wait_on(s.get());
    if (faults_.delay_ce_ns > 0) cuda::spin_async(faults_.delay_ce_ns, s.get());
  }
  if (fan == 1) {
    for (const auto& j : remote) cuda::copy_engine_async(j, ce_streams_[0].get());
  } else {
    size_t i = 0;
    for (const auto& j : remote)
      for (const plan::CopyDesc& d : plan::split_desc(j.desc, fan))
        cuda::copy_engine_async({j.src, j.dst, d}, ce_streams_[i++ % fan].get());
  }
  for (size_t k = 0; k < ce_streams_.size(); ++k) ce_join_[k].record(ce_streams_[k].get());
}

void NvlinkUlysses::copy_out(const TensorView& out, const plan::UlyssesPlan& p,
                             const plan::UlyssesRequest& req, cudaStream_t stream, bool ce) {
  if (faults_.delay_before_copy_out_ns > 0)
    cuda::spin_async(faults_.delay_before_copy_out_ns, stream);
  // The regions peer q wrote are q's puts to this rank, read back in place from the window.
  std::vector<cuda::CopyJob> out_jobs;
  for (int q = 0; q < opt_.size; ++q) {
    if (q == opt_.rank) continue;
    const auto theirs = peer_plan(p, req, plan_rank(q));
    const plan::CopyDesc& in = theirs->puts[plan_rank(opt_.rank)];
    if (in.empty()) continue;
    plan::CopyDesc c = in;
    c.src_offset = in.dst_offset;
    c.src_pitch = in.dst_pitch;
    c.src_slice_pitch = in.dst_slice_pitch;
    out_jobs.push_back({window_.local(), out.data, c});
  }
  if (ce) {
    for (const auto& j : out_jobs) cuda::copy_engine_async(j, stream);
    return;
  }
  cuda::copy_sm_async(out_jobs.data(), static_cast<int>(out_jobs.size()), 0, stream);
}

}  // namespace fastcomms
