// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The communicator (torchcomms' TorchComm in C++): validates every call, runs hooks, numbers
/// ops, and delegates to a backend.

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "fastcomms/core/backend.hpp"
#include "fastcomms/core/options.hpp"
#include "fastcomms/core/work.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

class Communicator;

/// NOTE [hook op record]: what a hook is told about an op, the op's tensors included, so a hook
/// written in C++ (the flight recorder, the NaN check) needs nothing else and runs on every path
/// a call takes (the Python methods, the process group's and the compiled calls' C++ paths). The
/// views and pointers are valid during the hook's call only. A tensor an op reads and writes (in
/// place: all_reduce, broadcast, reduce) is in both inputs and outputs; a recv has only an
/// output, a send only an input; batch and the ops without tensors have none.
struct OpInfo {
  OpKind op;       ///< Which op (kSplit, kNewWindow, kFinalize, kAllGatherPExec too).
  uint64_t op_id;  ///< NOTE [op ids]: one increasing sequence per process; finalize: 0.
  bool async_op;   ///< Async or sync.
  WorkPtr work;    ///< The issued op (post-hooks of ops with a Work only; else null).
  std::span<const TensorView> inputs = {};   ///< The tensors the op reads.
  std::span<const TensorView> outputs = {};  ///< The tensors the op writes.
  int peer = -1;                             ///< The root, or the peer of send/recv; -1: none.
  const ReduceOp* reduce = nullptr;          ///< The reduction of a reducing op; else null.
  /// all_to_all_v_single's split sizes (rows per peer; empty: even splits).
  std::span<const int64_t> input_splits = {};
  std::span<const int64_t> output_splits = {};
  size_t num_ops = 0;                 ///< batch: how many sends and recvs.
  std::span<const int> ranks = {};    ///< split: the ranks of the group this rank joins.
  const std::string* name = nullptr;  ///< split: the new communicator's name as given.
  /// The caller's own record of the call (CallOptions::frontend), opaque to the core; null for
  /// an op the library issues for itself.
  const void* frontend = nullptr;
  /// split's post-hooks: the communicator the split made (null on a rank that joined none).
  const std::shared_ptr<Communicator>* new_comm = nullptr;
};

/// NOTE [op ids]: the next op id of the process. Every communicator of the process numbers its
/// ops from this one sequence, starting at 1 (as torchcomms numbers ops across its
/// communicators), so hooks and the flight recorder see ids that never repeat across
/// communicators, a backend written in Python's included (NOTE [python backend trampoline]).
/// finalize takes none (its hooks see 0).
uint64_t next_op_id();

/// Handle on a registered hook; remove() unregisters it (idempotent, safe after the
/// communicator is gone).
class RemovableHandle {
 public:
  RemovableHandle() = default;
  explicit RemovableHandle(std::function<void()> remover) : remover_(std::move(remover)) {}
  /// Unregisters the hook.
  void remove() {
    if (remover_) {
      auto fn = std::move(remover_);
      remover_ = nullptr;
      fn();
    }
  }

 private:
  std::function<void()> remover_;
};

/// Per-op arguments every collective takes besides its tensors.
struct CallOptions {
  bool async_op = false;   ///< Return before completion (wait on the Work).
  OpOptions options;       ///< Hints and a timeout (0: the communicator's).
  void* stream = nullptr;  ///< CUDA backends: the caller's cudaStream_t the op is ordered on.
  /// The caller's own word for the call, compared across ranks by the call check with the rest
  /// of the fingerprint (NOTE [call check]): the Ulysses layer passes its geometry, so calls whose
  /// byte counts agree but whose layouts differ are caught too. 0: none.
  uint64_t call_key = 0;
  /// The caller's own record of the call, handed to hooks as OpInfo::frontend (NOTE [hook op
  /// record]) and to the backend as OpContext::frontend (NOTE [python backend trampoline]); the
  /// core never reads it.
  const void* frontend = nullptr;
};

/// NOTE [persistent all-gather]: torchcomms' AllGatherPHandle. all_gather_p_init keeps the output
/// buffer (and registers it with a backend that registers memory: nccl, nvlink), every
/// all_gather_p_exec gathers into it without registering anything, all_gather_p_free releases
/// it; an exec after the free, or on another communicator, raises.
class AllGatherP {
 public:
  /// The output buffer given to all_gather_p_init.
  const TensorView& output() const { return output_; }
  /// Whether all_gather_p_init registered the buffer with the backend (freed: deregistered).
  bool registered() const { return registered_; }
  /// Whether all_gather_p_free has run.
  bool freed() const { return freed_.load(); }

 private:
  friend class Communicator;
  TensorView output_;
  bool registered_ = false;
  std::atomic<bool> freed_{false};
  const Communicator* owner_ = nullptr;
};

/// A communicator over one backend.
class Communicator : public std::enable_shared_from_this<Communicator> {
 public:
  /// Creates a communicator over `backend_name` (statically registered or dlopen-loaded, see
  /// factory.hpp). `options.store` must be set.
  static std::shared_ptr<Communicator> create(const std::string& backend_name, int rank, int size,
                                              Device device, CommOptions options);
  /// This rank's key space for a new communicator of `options.name` on `options.store` (NOTE
  /// [store incarnations]): wraps the store for authentication where FASTCOMMS_STORE_TOKEN asks
  /// for it, takes this incarnation's ticket, and checks with the other ranks that they agree on
  /// authentication, size and who holds which rank (collective over the ranks). create() does it
  /// for built-in backends; a backend set up elsewhere (one written in Python) passes the result
  /// to the constructor. `where` starts messages.
  static std::shared_ptr<Store> join_key_space(CommOptions& options, int rank, int size,
                                               const std::string& where);
  /// Wraps an existing backend. `key_space` is this communicator's own namespace in the store
  /// (null: options.store); `process_abort` is the one the backend was made with (its
  /// BackendInit's; null: the backend has none), on which this communicator sets its abort hooks.
  Communicator(std::unique_ptr<Backend> backend, int rank, int size, Device device,
               CommOptions options, std::shared_ptr<Store> key_space = nullptr,
               std::shared_ptr<ProcessAbort> process_abort = nullptr);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return options_.name; }
  Device device() const { return device_; }
  std::string backend_name() const { return backend_->name(); }
  std::string backend_version() const { return backend_->version(); }
  const CommOptions& options() const { return options_; }
  /// Where an error of an async op's wait aborts the process (NOTE [process abort]): null
  /// unless options().abort_process_on_timeout_or_error. Sync ops abort inside the call.
  std::shared_ptr<ProcessAbort> process_abort_on_error() const {
    return options_.abort_process_on_timeout_or_error ? process_abort_ : nullptr;
  }
  /// This communicator's own namespace in the store (the one its backend rendezvoused in), for
  /// the layers above that set up over it (Ulysses transports).
  const std::shared_ptr<Store>& key_space() const { return key_space_; }
  /// A number for the next object set up over key_space(): every rank counts alike as long as
  /// it creates such objects in the same order.
  uint64_t next_key_id() { return next_key_id_.fetch_add(1); }
  Backend& backend() { return *backend_; }
  /// Changes the default timeout of later ops.
  void set_timeout(std::chrono::milliseconds t);
  /// Merges hints into the communicator's hints.
  void set_hints(const Hints& hints);
  bool is_aborted() const { return aborted_.load(); }
  /// Runs abort hooks, then aborts the backend: every waiter gets an Aborted error.
  void abort();
  /// Orderly, collective shutdown; later ops raise. `frontend`: OpInfo::frontend for its hooks.
  void finalize(const void* frontend = nullptr);
  /// Registers a tensor's memory with the backend (local; see Backend::register_memory).
  void tensor_register(const TensorView& t);
  /// Drops a registration made by tensor_register.
  void tensor_deregister(const TensorView& t);
  /// NOTE [persistent all-gather]: local; keeps `output` (a view: the caller keeps the memory
  /// alive until all_gather_p_free) and registers it with a backend that registers memory.
  std::shared_ptr<AllGatherP> all_gather_p_init(const TensorView& output,
                                                const CallOptions& o = {});
  /// Collective: gathers every rank's `input` into the handle's output (its numel must be
  /// size() * input's, same dtype and device).
  WorkPtr all_gather_p_exec(AllGatherP& handle, const TensorView& input, const CallOptions& o = {});
  /// Releases the handle (deregisters what init registered); a second free does nothing.
  void all_gather_p_free(AllGatherP& handle);
  /// Collective: a window of the backend (kUnsupported when it has none).
  std::shared_ptr<Window> new_window(const void* frontend = nullptr);
  /// What the backend lends under `what`, or null (see Backend::lend); null once aborted or
  /// finalized.
  std::shared_ptr<void> lend(const std::string& what);
  /// "[rank r/n name op] " for messages.
  std::string prefix(OpKind op) const;

  WorkPtr send(const TensorView& t, int dst, const CallOptions& o = {});
  WorkPtr recv(const TensorView& t, int src, const CallOptions& o = {});
  WorkPtr batch_p2p(const std::vector<P2POp>& ops, const CallOptions& o = {});
  WorkPtr broadcast(const TensorView& t, int root, const CallOptions& o = {});
  WorkPtr all_reduce(const TensorView& t, const ReduceOp& op, const CallOptions& o = {});
  WorkPtr reduce(const TensorView& t, int root, const ReduceOp& op, const CallOptions& o = {});
  WorkPtr all_gather(const std::vector<TensorView>& outputs, const TensorView& input,
                     const CallOptions& o = {});
  WorkPtr all_gather_v(const std::vector<TensorView>& outputs, const TensorView& input,
                       const CallOptions& o = {});
  WorkPtr all_gather_single(const TensorView& output, const TensorView& input,
                            const CallOptions& o = {});
  WorkPtr reduce_scatter(const TensorView& output, const std::vector<TensorView>& inputs,
                         const ReduceOp& op, const CallOptions& o = {});
  WorkPtr reduce_scatter_v(const TensorView& output, const std::vector<TensorView>& inputs,
                           const ReduceOp& op, const CallOptions& o = {});
  WorkPtr reduce_scatter_single(const TensorView& output, const TensorView& input,
                                const ReduceOp& op, const CallOptions& o = {});
  WorkPtr all_to_all_single(const TensorView& output, const TensorView& input,
                            const CallOptions& o = {});
  /// Empty split lists mean even splits (torch.distributed's convention).
  WorkPtr all_to_all_v_single(const TensorView& output, const TensorView& input,
                              const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits, const CallOptions& o = {});
  WorkPtr all_to_all(const std::vector<TensorView>& outputs, const std::vector<TensorView>& inputs,
                     const CallOptions& o = {});
  WorkPtr barrier(const CallOptions& o = {});
  WorkPtr scatter(const TensorView& output, const std::vector<TensorView>& inputs, int root,
                  const CallOptions& o = {});
  WorkPtr gather(const std::vector<TensorView>& outputs, const TensorView& input, int root,
                 const CallOptions& o = {});
  WorkPtr gather_single(const TensorView& output, const TensorView& input, int root,
                        const CallOptions& o = {});
  /// A communicator over `ranks` (ranks of this one), or null on a rank not in `ranks`. Every
  /// rank of this communicator calls it (the split is collective over it for some backends),
  /// each with the list of the group it joins, members alike (a colour split: lists of different
  /// groups differ and must be disjoint); an empty list joins none. The split counter advances on
  /// every call, so later splits stay aligned.
  std::shared_ptr<Communicator> split(const std::vector<int>& ranks, const std::string& name,
                                      const CommOptions* options = nullptr,
                                      const void* frontend = nullptr);

  using PreHook = std::function<void(const OpInfo&)>;
  using PostHook = std::function<void(const OpInfo&)>;
  using AbortHook = std::function<void()>;
  /// Called with the op and its error where an op whose pre-hooks ran raises (its post-hooks do
  /// not run).
  using ErrorHook = std::function<void(const OpInfo&, const Error&)>;
  /// NOTE [one hook registry]: pre-hooks run on the calling thread before every op (the
  /// collectives and point-to-point ops once their arguments are checked, batch, split,
  /// new_window, finalize), post-hooks once it is issued (a sync op: complete); a hook that
  /// throws stops the op (pre) or reaches its caller (post). The Python communicator's hooks
  /// are registered here too. Thread-safe; a hook may (un)register hooks.
  RemovableHandle register_pre_hook(PreHook fn);
  RemovableHandle register_post_hook(PostHook fn);
  RemovableHandle register_abort_hook(AbortHook fn);
  /// Error hooks: run on the calling thread where an op whose pre-hooks ran raises a fastcomms
  /// Error, before the error reaches the caller (the flight recorder dumps on a timeout); a
  /// throwing error hook is logged and the op's own error goes on.
  RemovableHandle register_error_hook(ErrorHook fn);

 private:
  struct Hooks;
  // Runs the pre-hooks of `info`, then `body`, then the post-hooks (info.work from `work_of` of
  // the result); the hooks registered when it starts.
  template <typename Body>
  auto hooked(OpInfo info, Body&& body);
  // `peers` (a callable filling an OpContext's peer_out / peer_in) for the ops whose sizes differ
  // per peer; it runs only when the call is checked (NOTE [call check]). `rec` holds what hooks
  // are told of the op's arguments (NOTE [hook op record]; op, op_id and async_op are set here).
  template <typename Fn, typename PeerFn = std::nullptr_t>
  WorkPtr run(OpKind op, const CallOptions& o, Fn&& issue, CallFingerprint fp = {},
              PeerFn peers = nullptr, OpInfo rec = {});
  // Whether this op is to be checked across ranks: the op's hint check_calls, else the
  // communicator's setting.
  bool wants_check(const CallOptions& o) const;
  // all_gather_single, which hooks see as `hook_op` (NOTE [persistent all-gather]).
  WorkPtr all_gather_single_as(OpKind hook_op, const TensorView& output, const TensorView& input,
                               const CallOptions& o);
  // NOTE [call check] through the store, for backends that do not check in band.
  void check_through_store(const OpContext& ctx);
  void check_usable(OpKind op) const;
  void check_peer(OpKind op, const char* arg, int peer, bool allow_self) const;
  void check_tensor(OpKind op, const char* arg, const TensorView& t) const;
  void check_same_dtype(OpKind op, const char* arg, const TensorView& t, DType want) const;
  void check_reduce(OpKind op, const ReduceOp& r, const TensorView& t) const;
  void check_self_pairs(OpKind op, const std::vector<P2POp>& ops) const;

  std::unique_ptr<Backend> backend_;
  int rank_;
  int size_;
  Device device_;
  CommOptions options_;
  std::atomic<bool> aborted_{false};
  std::atomic<bool> finalized_{false};
  std::atomic<uint64_t> split_counter_{0};
  std::shared_ptr<Store> key_space_;
  std::atomic<uint64_t> next_key_id_{0};
  std::shared_ptr<Hooks> hooks_;
  std::shared_ptr<ProcessAbort> process_abort_;  // NOTE [process abort]
  // NOTE [call check]: FASTCOMMS_CHECK_CALLS or the hint check_calls; the store check's
  // sequence, and why it cannot go on (a rank that did not come: the sequences no longer match).
  bool check_calls_ = false;
  std::mutex check_mu_;
  uint64_t check_seq_ = 0;
  std::string check_broken_;
};

}  // namespace fastcomms
