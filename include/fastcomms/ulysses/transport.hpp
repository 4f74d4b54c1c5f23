// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The Ulysses layer: one interface for the Ulysses all-to-all whatever carries the bytes.
///
/// A call is validated, planned (plan/) and checked against `out` here, once; a transport only
/// moves bytes. Three transports implement the interface: the collective path over any
/// communicator on CPU tensors (this layer), the CUDA collective path (backends/nccl) and the
/// NVLink peer-to-peer path (backends/nvlink). Backends register theirs by kind in the registry
/// below, and a backend may also lend its own engine through its communicator
/// (Communicator::ulysses_transport), so callers never name a backend's classes.

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "fastcomms/core/communicator.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/core/tensor.hpp"
#include "fastcomms/core/work.hpp"
#include "fastcomms/plan/ulysses_plan.hpp"

namespace fastcomms {

/// The name under which a backend lends its own Ulysses engine (Backend::lend): the object lent
/// is a UlyssesTransport.
inline constexpr const char* kLentUlyssesTransport = "ulysses_transport";

/// Arguments of one Ulysses call besides the tensors.
struct UlyssesArgs {
  int mode = 0;                                     ///< 0 or 1 (see ulysses_plan.hpp).
  std::optional<std::vector<int64_t>> seq_splits;   ///< Per-rank sequence shards, or even.
  std::optional<std::vector<int64_t>> head_splits;  ///< Per-rank head shards, or even.
  int64_t kv_replicas = 1;  ///< Virtual heads per x head (plan NOTE [kv replicas]).
  bool async_op = false;    ///< CPU path: return before completion (CUDA paths never block).
};

/// The plan request of one call: a (validated, contiguous 4-D) x's shape and element size, the
/// call's mode and splits, this rank and the group size.
plan::UlyssesRequest ulysses_request(const TensorView& x, const UlyssesArgs& args, int rank,
                                     int size, const std::string& comm_name, plan::Path path);

/// The plan request of a call described by shape alone (shape queries, fake tensors).
plan::UlyssesRequest ulysses_request(const std::array<int64_t, 4>& shape, int64_t element_size,
                                     const UlyssesArgs& args, int rank, int size,
                                     const std::string& comm_name, plan::Path path);

/// The one check of a call's `out` against x and this rank's plan (dtype, device, contiguity,
/// shape); `prefix` starts the message.
void check_ulysses_out(const TensorView& x, const TensorView& out, const plan::UlyssesPlan& p,
                       const std::string& prefix);

/// Plans by geometry (and rank), bounded; one per transport. Thread-safe.
class UlyssesPlanCache {
 public:
  /// The plan of `req`, made on first use.
  std::shared_ptr<const plan::UlyssesPlan> get(const plan::UlyssesRequest& req);

 private:
  using Key = std::tuple<int, int, int, int, std::array<int64_t, 4>, int64_t, std::vector<int64_t>,
                         std::vector<int64_t>, bool, int64_t>;
  std::mutex mu_;
  std::map<Key, std::shared_ptr<const plan::UlyssesPlan>> plans_;
};

/// What a transport holds.
struct UlyssesMemoryStats {
  int64_t device_bytes = 0;  ///< Device memory of windows, signal pads and staging buffers.
  uint64_t calls = 0;        ///< Calls issued so far.
};

/// A byte all-to-all_v over a group: `recv` and `send` are uint8 buffers, the counts are bytes per
/// rank (chunks in rank order), `key` the call's word for the call check (NOTE [call check]). On
/// CUDA it is enqueued on `stream` (a cudaStream_t); on CPU it returns once done.
using ByteExchange = std::function<void(
    const TensorView& recv, const TensorView& send, const std::vector<int64_t>& recv_bytes,
    const std::vector<int64_t>& send_bytes, void* stream, uint64_t key)>;

/// An all-gather of one string per rank over a whole group (the transport choice's inputs).
using StringGather = std::function<std::vector<std::string>(const std::string& mine)>;

/// What a transport is built from.
struct TransportInit {
  int rank = 0;                                ///< This rank in the group.
  int size = 1;                                ///< Ranks in the group.
  Device device;                               ///< The device the group serves.
  std::shared_ptr<Store> store;                ///< Rendezvous (peer-to-peer transports).
  std::string name = "ulysses";                ///< Store key namespace and message name.
  std::chrono::milliseconds timeout{600'000};  ///< Store and device-side waits.
  std::shared_ptr<Communicator> comm;          ///< The group's communicator (collective paths).
  /// Hierarchical: every rank's host index (hierarchical.hpp); the store is then shared by the
  /// ranks of this rank's host at least.
  std::vector<int> host_of;
  /// Hierarchical: the byte all-to-all between hosts (null: comm's all_to_all_v_single).
  ByteExchange exchange;
  /// The transport choice's all-gather (null: through the store, which then spans the group).
  StringGather gather;
};

/// One way of moving a Ulysses all-to-all. Calls on one transport come from one thread at a
/// time, in the same order on every rank of the group. A transport outlives the buffers it lent
/// only through the shared_ptr its users keep.
class UlyssesTransport : public std::enable_shared_from_this<UlyssesTransport> {
 public:
  /// @param rank, size the group; @param name for messages
  UlyssesTransport(int rank, int size, std::string name);
  virtual ~UlyssesTransport() = default;
  UlyssesTransport(const UlyssesTransport&) = delete;
  UlyssesTransport& operator=(const UlyssesTransport&) = delete;

  /// "collective", "cuda_collective", "nvlink" or "hierarchical".
  virtual std::string kind() const = 0;
  /// This rank.
  int rank() const { return rank_; }
  /// Ranks in the group.
  int size() const { return size_; }

  /// The output shape of a call with input `shape`; validates like the call itself.
  std::array<int64_t, 4> output_shape(const std::array<int64_t, 4>& shape, int64_t element_size,
                                      const UlyssesArgs& args) const;
  /// The output shape of a call with input `x` (a 4-D, contiguous tensor).
  std::array<int64_t, 4> output_shape(const TensorView& x, const UlyssesArgs& args) const;
  /// The largest output of this call over every rank, in bytes (a buffer that size serves any).
  int64_t max_out_bytes(const std::array<int64_t, 4>& shape, int64_t element_size,
                        const UlyssesArgs& args) const;

  /// Validates the call (x, out, args), then runs it. CUDA transports enqueue on `stream` (a
  /// cudaStream_t; null: the default stream) and return a completed Work; the CPU path blocks
  /// unless args.async_op. The Work keeps every internal buffer the call uses alive.
  WorkPtr all_to_all_4d(const TensorView& x, const TensorView& out, const UlyssesArgs& args,
                        void* stream);

  /// FP8 on the wire fused into the transfer, where this transport has such a path (NOTE [fp8
  /// wire]): x's rows of d values (float16, bfloat16 or float32) are quantized to `wire` as they
  /// are sent, then dequantized into `out` (x's dtype, the call's output shape; `scales` null)
  /// or left as FP8 rows in `out` (dtype `wire`) with their float32 scales in `scales` (out's
  /// shape without d). Validates like all_to_all_4d. Returns false, having done nothing, where
  /// the transport has no fused path for this call: the caller then quantizes, exchanges the
  /// FP8 rows and the scales, and dequantizes.
  virtual bool all_to_all_4d_fp8(const TensorView& x, const TensorView& out,
                                 const TensorView* scales, const UlyssesArgs& args, DType wire,
                                 void* stream);

  /// Collective: a device buffer of `bytes` that peers write directly when a tensor on it is
  /// passed as `out` (zero copy). The pointer keeps what backs the buffer alive (it stays valid
  /// after destroy() while held). Null where the transport has no such buffers (then an
  /// ordinary tensor is as good).
  virtual std::shared_ptr<void> empty_output(int64_t bytes);
  /// A transport for calls issued on another stream than this one's (async calls): its own
  /// windows and barriers where the transport has any (created on first use, collectively),
  /// else this one.
  virtual std::shared_ptr<UlyssesTransport> async_lane();
  /// Memory held and calls issued.
  virtual UlyssesMemoryStats memory_stats() const;
  /// Throws if an earlier enqueued call failed on the device (peers disagreed, a barrier timed
  /// out). Calls check on their own; this is for the last one.
  virtual void check_errors();
  /// Collective release of windows and streams (a lent transport stays with its owner).
  virtual void destroy();
  /// Sets a tuning knob by name for later calls (developer benchmarks; the NVLink transport has
  /// "engine" = auto|ce|sm|hybrid). Throws kInvalidArgument for a knob it does not have.
  virtual void tune(const std::string& knob, const std::string& value);

 protected:
  /// The transport's part of a call: `plan` is this rank's plan, `x` and `out` are checked.
  virtual WorkPtr run(const TensorView& x, const TensorView& out, const UlyssesArgs& args,
                      const plan::UlyssesRequest& req,
                      const std::shared_ptr<const plan::UlyssesPlan>& plan, void* stream) = 0;
  /// Which descriptors this transport executes.
  virtual plan::Path path() const = 0;
  /// Extra checks of x before planning (device, ...). Default: none.
  virtual void check_input(const TensorView& x) const;
  /// "[rank r/n name] all_to_all_4d: ".
  std::string prefix() const;
  /// The plan of `req` (cached).
  std::shared_ptr<const plan::UlyssesPlan> plan_for(const plan::UlyssesRequest& req) {
    return plans_.get(req);
  }

  int rank_, size_;
  std::string name_;

 private:
  mutable UlyssesPlanCache plans_;  // thread-safe; shape queries fill it too
};

using UlyssesTransportPtr = std::shared_ptr<UlyssesTransport>;

/// Makes a transport of one kind.
using TransportFactory = std::function<UlyssesTransportPtr(const TransportInit&)>;

/// Registers the transport `kind` (a static initializer in the backend that implements it).
void register_transport(const std::string& kind, TransportFactory factory);
/// Whether `kind` is registered ("collective" always is).
bool has_transport(const std::string& kind);
/// Makes a transport of `kind`: "collective" (init.comm's device picks the CPU or the CUDA
/// collective path), "cuda_collective", "nvlink" (collective over init's store), "hierarchical"
/// (init.host_of; on CUDA the NVLink engine of backends/nvlink inside a host). Throws
/// kUnsupported for a kind this build lacks.
UlyssesTransportPtr make_transport(const std::string& kind, const TransportInit& init);

/// NVML's answer on whether each pair of `devices` is NVLink-joined; nullopt (with `why`) when it
/// cannot say.
using NvlinkMatrix = std::map<std::pair<int, int>, bool>;
using NvlinkProbe =
    std::function<std::pair<std::optional<NvlinkMatrix>, std::string>(const std::vector<int>&)>;
/// Registers the probe (backends/nvlink, which links NVML through cuda/).
void register_nvlink_probe(NvlinkProbe probe);
/// The registered probe's answer, or (nullopt, "this build has no CUDA layer").
std::pair<std::optional<NvlinkMatrix>, std::string> nvlink_matrix(const std::vector<int>& devices);

/// (usable, why) from every rank's "host|device" entry: usable when there is one host and every
/// pair of distinct GPUs is NVLink-joined by `probe` (ranks sharing a GPU count as joined); the
/// probe's "unknown" is never taken for yes. Every rank computes it from the same entries.
std::pair<bool, std::string> nvlink_decision(const std::vector<std::string>& who,
                                             const NvlinkProbe& probe);

/// The transport a Ulysses group takes.
struct TransportChoice {
  UlyssesTransportPtr transport;  ///< Null when the collective path was chosen without a comm.
  std::string kind;               ///< "nvlink", "hierarchical", "collective" or "cuda_collective".
  std::string reason;             ///< Why, in words.
};

/// Chooses and makes the transport of a group, collectively (every rank gets the same answer).
/// `transport`: "auto", "nvlink", "hierarchical" or "collective"; `require_nvlink` makes "auto"
/// refuse instead of falling back. A communicator whose backend lends an engine (init.comm's
/// nvlink backend) gives that one. Otherwise every rank's "host|device" is gathered (from `who`
/// when the caller already has it, else through init.gather or init.store): one host,
/// nvlink_decision() decides; several hosts (NOTE [hierarchical choice]), "hierarchical" when some
/// host holds two ranks or more and every host's ranks are NVLink-joined (on CPU only when asked
/// for), else the collective path.
TransportChoice select_transport(const TransportInit& init, const std::string& transport,
                                 bool require_nvlink,
                                 std::optional<std::vector<std::string>> who = std::nullopt);

/// The collective path over `comm` for CPU tensors (pack, one all_to_all_v_single, unpack; each
/// chunk carries the call's header, so ranks that issued different calls all raise).
UlyssesTransportPtr make_collective_transport(std::shared_ptr<Communicator> comm);

/// Registers `kind` at static-initialization time.
struct StaticTransportRegistration {
  StaticTransportRegistration(const std::string& kind, TransportFactory factory) {
    register_transport(kind, std::move(factory));
  }
};

}  // namespace fastcomms
