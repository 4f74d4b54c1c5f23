// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The abstract backend every transport implements, and the context an op is issued with.
///
/// The Communicator validates arguments (ranks, sizes, dtypes, contiguity) before it calls a
/// backend, so a backend may assume well-formed input; it still checks what only it knows (the
/// device type, dtypes it cannot reduce).

#include <chrono>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "fastcomms/core/options.hpp"
#include "fastcomms/core/reduce_op.hpp"
#include "fastcomms/core/tensor.hpp"
#include "fastcomms/core/window.hpp"
#include "fastcomms/core/work.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

/// Every op of the communicator API, for capabilities() and messages.
enum class OpKind : int {
  kSend = 0,
  kRecv,
  kBatchP2P,
  kBroadcast,
  kAllReduce,
  kReduce,
  kAllGather,
  kAllGatherV,
  kAllGatherSingle,
  kReduceScatter,
  kReduceScatterV,
  kReduceScatterSingle,
  kAllToAllSingle,
  kAllToAllVSingle,
  kAllToAll,
  kBarrier,
  kScatter,
  kGather,
  kGatherSingle,
  kSplit,
  kNewWindow,  ///< Not a backend op: hooks see it (Communicator::new_window).
  kFinalize,   ///< Not a backend op: hooks see it (Communicator::finalize), with op id 0.
  /// Not a backend op: hooks see Communicator::all_gather_p_exec under its own name (the backend
  /// runs an all_gather_single).
  kAllGatherPExec,
  kCount,
};

/// The API name of `op` ("all_reduce", ...).
const char* op_name(OpKind op) noexcept;

/// What a backend can do.
struct Capabilities {
  uint64_t ops = 0;           ///< Bit (1 << OpKind) per supported op.
  bool cpu_tensors = false;   ///< Takes CPU tensors.
  bool cuda_tensors = false;  ///< Takes CUDA tensors.
  /// Judges point-to-point ops with this rank itself on its own (a backend written in Python,
  /// as torchcomms leaves it to its backends); else the communicator refuses a send or recv to
  /// self and a self pair without its partner (NOTE [self pairs in a batch]).
  bool self_p2p = false;
  bool supports(OpKind op) const { return (ops >> static_cast<int>(op)) & 1u; }
};

/// NOTE [call fingerprint]: what a rank says a collective is, in 40 bytes, so ranks can compare
/// it before any data moves (NOTE [call check]): ranks that issued different collectives,
/// sizes, dtypes, roots or reductions then raise on every rank instead of one process dying
/// inside the transport or data mixing silently. -1 marks a field the op does not fix across
/// ranks (the sizes of the _v forms, which the check compares per peer instead).
struct CallFingerprint {
  int32_t op = -1;           ///< OpKind.
  int32_t dtype = -1;        ///< DType.
  int32_t root = -1;         ///< Root rank of rooted ops.
  int32_t reduce = -1;       ///< RedOpType of reductions.
  int64_t count = -1;        ///< Elements every rank must agree on.
  uint64_t factor_bits = 0;  ///< PREMUL_SUM's factor, bit for bit.
  uint64_t key = 0;  ///< The caller's own word for the call (CallOptions::call_key), 0: none.
  bool operator==(const CallFingerprint&) const = default;
};
static_assert(sizeof(CallFingerprint) == 40 && std::is_trivially_copyable_v<CallFingerprint>);

/// "broadcast(root 0, 1024 x float32)": a fingerprint in words, for mismatch messages.
std::string describe(const CallFingerprint& f);

/// NOTE [call check]: ranks compare their calls before data moves. One rank's record of a call
/// is its fingerprint, then the bytes it sends to and expects from every peer (`peer_out`,
/// `peer_in`; -1 throughout where the op has no per-peer sizes), as int64 words: the same length
/// for every op of a communicator of `size` ranks, so exchanging records can itself never
/// disagree on sizes. Backends that can compare in band do (gloo: one allgather of the records
/// before the op, FASTCOMMS_CHECK_CALLS=strict); for the others the communicator compares them
/// through its store (core/communicator.cpp). The default setting (1) is each backend's own:
/// gloo's tags and probe, nccl's 16-byte fingerprints beside the op (NOTE [wire fingerprint],
/// NOTE [nccl call check]).
std::vector<int64_t> call_record(const CallFingerprint& f, const std::vector<int64_t>& peer_out,
                                 const std::vector<int64_t>& peer_in, int size);
/// Words in one record of a communicator of `size` ranks.
size_t call_record_words(int size);
/// Compares every rank's record (`all`: `size` records back to back, rank order): empty where
/// they agree, else the first disagreement in rank order, in words, the same on every rank.
/// Throws kInvalidArgument where `all` is not `size` records.
std::string call_records_mismatch(const std::vector<int64_t>& all, int size);
/// The error a mismatch raises on a rank whose fingerprint is `mine`: `prefix`, the mismatch,
/// then what this rank called.
Error call_mismatch_error(const std::string& prefix, const std::string& mismatch,
                          const CallFingerprint& mine);
/// call_records_mismatch, thrown as call_mismatch_error where the records disagree.
void check_call_records(const std::string& prefix, const CallFingerprint& mine,
                        const std::vector<int64_t>& all, int size);

/// How one op was issued.
struct OpContext {
  OpKind op = OpKind::kBarrier;          ///< Which op.
  uint64_t op_id = 0;                    ///< NOTE [op ids]: one sequence per process.
  bool async_op = false;                 ///< The caller asked for an async op.
  std::chrono::milliseconds timeout{0};  ///< Effective timeout (never 0 here).
  const Hints* hints = nullptr;          ///< Per-op hints (may be null).
  std::string prefix;                    ///< "[rank r/n comm op] " for error messages.
  void* stream = nullptr;  ///< The caller's cudaStream_t (CUDA backends; null: the default stream).
  CallFingerprint fingerprint;  ///< The call as every rank must see it (collectives).
  /// Bytes to and from every peer for the ops whose sizes differ per peer (the _v forms and the
  /// list all_to_all), for the call check; empty for the others.
  std::vector<int64_t> peer_out, peer_in;
  /// The caller's own record of the call (CallOptions::frontend), opaque to the core. Only a
  /// backend made by the same layer as the caller reads it (NOTE [python backend trampoline]:
  /// a backend written in Python gets the call's torch tensors from it); null for an op the
  /// library issues for itself.
  const void* frontend = nullptr;
};

/// NOTE [call check]: how a communicator's calls are compared across ranks (FASTCOMMS_CHECK_CALLS,
/// or the hint check_calls): "0" off, "1" the backend's own check (gloo: by default; nccl and
/// nvlink: opt-in), "strict" the check before data moves. Every rank must use the same.
enum class CallCheckMode { kOff, kDefault, kStrict };

/// Parses "0", "1" or "strict"; false (leaving *m) for anything else.
bool parse_call_check_mode(const std::string& v, CallCheckMode* m);

/// One op's mode: the first of `hint_names` among ctx's per-op hints, else `communicator`. A hint
/// that does not parse throws kInvalidArgument naming it.
CallCheckMode op_call_check_mode(const OpContext& ctx, CallCheckMode communicator,
                                 std::initializer_list<const char*> hint_names);

/// One point-to-point op of a batch.
struct P2POp {
  enum class Kind { kSend, kRecv } kind = Kind::kSend;  ///< Send or receive.
  TensorView tensor;                                    ///< The data.
  int peer = 0;                                         ///< Destination or source rank.
};

/// NOTE [process abort]: the one way fastcomms aborts the process, where
/// CommOptions::abort_process_on_timeout_or_error asks for it: the reason goes to stderr, the
/// communicator's abort hooks run (on a thread of their own, for kHookGrace at most, so a hook
/// that blocks cannot turn the abort into a hang, and a hook that throws cannot stop it), then
/// std::abort(). The communicator uses it for an error its call raises (a sync op), the Python
/// binding for one an async op's wait raises (Communicator::process_abort_on_error), and a
/// backend reaches it through BackendInit::process_abort for what its own threads detect (the
/// nccl watchdog's timeout). Thread safety: every member may be called from any thread.
class ProcessAbort {
 public:
  /// How long the abort hooks may run before the process aborts regardless.
  static constexpr std::chrono::seconds kHookGrace{10};
  /// The communicator's abort hooks, run before the abort (set once it exists).
  void set_hooks(std::function<void()> run_hooks);
  /// Prints `why`, runs the hooks, aborts the process. Never returns.
  [[noreturn]] void abort_process(const std::string& why) const;
  /// Whether an op's error of this code aborts the process under the option: a timeout or a
  /// failure of the transport, never a refused argument or an abort() the caller asked for.
  static bool applies(ErrorCode code) {
    return code == ErrorCode::kTimeout || code == ErrorCode::kBackendError ||
           code == ErrorCode::kCudaError || code == ErrorCode::kInternal;
  }

 private:
  mutable std::mutex mu_;
  std::function<void()> run_hooks_;
};

/// The name under which a backend on NCCL lends its ncclComm_t (Backend::lend; the pointer the
/// shared_ptr holds is the communicator, not owned: valid until the backend is finalized, aborted
/// or destroyed). torchcomms' TorchCommNCCL.get_nccl_comm_ptr() reads it.
inline constexpr const char* kLentNcclComm = "nccl_comm";

/// What a backend is created from.
struct BackendInit {
  int rank = 0;         ///< This rank.
  int size = 1;         ///< Ranks in the communicator.
  Device device;        ///< The device the communicator serves.
  CommOptions options;  ///< Timeout, store (never null here), hints, name.
  /// Where the backend aborts the process (NOTE [process abort]); never null. The communicator
  /// made over the backend sets its abort hooks on it.
  std::shared_ptr<ProcessAbort> process_abort = std::make_shared<ProcessAbort>();
};

/// A transport. All ops default to throwing kUnsupported; a backend overrides what it has and
/// says so in capabilities().
///
/// The contract (a backend built as a library states FASTCOMMS_BACKEND_ABI_VERSION, factory.hpp,
/// and is refused when it differs; bump it with any change to this class or to the structs its
/// members take):
/// - Who calls: the Communicator, never user code. It validates arguments first, so a backend
///   may assume shapes, dtypes, ranks and roots are in range and consistent on this rank.
/// - Threads: ops may be issued from any thread, and from several at once (a backend serialises
///   what its transport needs serialised, in issue order per calling thread); collectives must
///   be issued in the same order on every rank. abort() may come from any thread at any time,
///   an op blocked in another thread included, and from the process-abort thread; it must not
///   block on the network. finalize() comes once, after the caller's last op, from one thread.
///   The destructor runs after finalize() or abort() and must not throw or wait for peers.
/// - Work: an op returns at once where the op is async (the Work completes or fails later,
///   possibly on a backend thread); a Work's buffers stay valid while it is held
///   (NOTE [work keeps its buffers]). Errors are fastcomms::Error with a code, their message
///   starting with OpContext::prefix; what a backend thread cannot raise goes to the log
///   (fastcomms/core/log.hpp), never silently dropped.
class Backend {
 public:
  virtual ~Backend() = default;
  /// Registry name ("gloo", "nccl", ...).
  virtual std::string name() const = 0;
  /// Version string of the transport underneath.
  virtual std::string version() const = 0;
  /// What it supports.
  virtual Capabilities capabilities() const = 0;

  virtual WorkPtr send(const TensorView& t, int dst, const OpContext& ctx);
  virtual WorkPtr recv(const TensorView& t, int src, const OpContext& ctx);
  virtual WorkPtr batch_p2p(const std::vector<P2POp>& ops, const OpContext& ctx);
  virtual WorkPtr broadcast(const TensorView& t, int root, const OpContext& ctx);
  virtual WorkPtr all_reduce(const TensorView& t, const ReduceOp& op, const OpContext& ctx);
  virtual WorkPtr reduce(const TensorView& t, int root, const ReduceOp& op, const OpContext& ctx);
  /// outputs[i] receives rank i's input; sizes may differ per rank (the _v form).
  virtual WorkPtr all_gather(const std::vector<TensorView>& outputs, const TensorView& input,
                             const OpContext& ctx);
  virtual WorkPtr all_gather_single(const TensorView& output, const TensorView& input,
                                    const OpContext& ctx);
  /// inputs[i] is reduced into rank i's output; sizes may differ per rank (the _v form).
  virtual WorkPtr reduce_scatter(const TensorView& output, const std::vector<TensorView>& inputs,
                                 const ReduceOp& op, const OpContext& ctx);
  virtual WorkPtr reduce_scatter_single(const TensorView& output, const TensorView& input,
                                        const ReduceOp& op, const OpContext& ctx);
  /// Splits count dim-0 rows of the (contiguous) tensors; always given, even for the even op.
  virtual WorkPtr all_to_all_v_single(const TensorView& output, const TensorView& input,
                                      const std::vector<int64_t>& output_splits,
                                      const std::vector<int64_t>& input_splits,
                                      const OpContext& ctx);
  virtual WorkPtr all_to_all(const std::vector<TensorView>& outputs,
                             const std::vector<TensorView>& inputs, const OpContext& ctx);
  virtual WorkPtr barrier(const OpContext& ctx);
  /// inputs are used on the root only.
  virtual WorkPtr scatter(const TensorView& output, const std::vector<TensorView>& inputs, int root,
                          const OpContext& ctx);
  /// outputs are used on the root only.
  virtual WorkPtr gather(const std::vector<TensorView>& outputs, const TensorView& input, int root,
                         const OpContext& ctx);
  /// A backend over `ranks`, named `name`. Called on every rank of this backend (the split may
  /// be collective over the parent, as ncclCommSplit is) with the same `ranks` and `name`; `init`
  /// is null on a rank that is not in `ranks`, which then gets null back.
  virtual std::unique_ptr<Backend> split(const std::vector<int>& ranks, const std::string& name,
                                         const BackendInit* init);
  /// Registers `bytes` at `ptr` (this rank's memory on the backend's device) with the transport,
  /// so later ops on it move without staging (torchcomms' TorchComm::tensor_register; NCCL's
  /// ncclCommRegister). Local, not collective. Default: throws kUnsupported. `where` starts
  /// messages.
  virtual void register_memory(void* ptr, int64_t bytes, const std::string& where);
  /// Drops the registration of `ptr` (throws kInvalidArgument where there is none).
  virtual void deregister_memory(void* ptr, const std::string& where);
  /// Whether new_window() works.
  virtual bool supports_window() const { return false; }
  /// Collective: a window of this backend (default: throws kUnsupported).
  virtual std::shared_ptr<Window> new_window(const OpContext& ctx);
  /// An object this backend lends to the layers above it under the name `what`, or null. Core
  /// knows neither the names nor the types: a layer above names what it asks for and what type
  /// it is (the Ulysses layer asks for its transport, kLentUlyssesTransport in
  /// fastcomms/ulysses/transport.hpp), and only a backend that implements that layer's interface
  /// answers to its name.
  virtual std::shared_ptr<void> lend(const std::string& what) {
    (void)what;
    return nullptr;
  }
  /// True when this backend compares `ctx`'s call across ranks itself (NOTE [call check]), so
  /// the communicator need not.
  virtual bool checks_calls(const OpContext& ctx) const {
    (void)ctx;
    return false;
  }
  /// Unblocks every waiter with an Aborted error; the backend is unusable afterwards.
  virtual void abort() {}
  /// Collective, orderly shutdown.
  virtual void finalize() {}
};

}  // namespace fastcomms
