// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// A fake NCCL and CUDA runtime behind the nccl backend's seam (NOTE [nccl seam] in
// backends/nccl/nccl_api.hpp), so the backend's host logic runs in CI on a machine with no GPU.
//
// Ranks are threads of one process, each with its own "device" (the ordinal its thread made
// current with cudaSetDevice). Device memory is host memory. A communicator is made by unique id
// (what the backend passes through the store) and joins the other ranks of that id; ncclCommSplit
// groups the ranks of a communicator by colour and orders them by key. Collectives (all_reduce,
// broadcast, reduce, all_gather, reduce_scatter) are matched by their order on each
// communicator, sends and receives by their order per pair of ranks; the rank whose call
// completes a match moves the bytes, and the launch it belongs to (one call, or every call of one
// group) completes once all its parts are matched. Streams and events are host objects: an event
// is complete once every launch its stream held when it was recorded is complete, so an op whose
// peer never comes, or one held with hold(), stays in progress. An asynchronous copy is a launch
// too: it moves its bytes once everything before it on its stream is complete, and its host side
// must be pinned (cudaHostAlloc). Mismatched collectives are what NCCL makes of them: where the
// ranks' calls are of one kind and move the same bytes (float32 against int32, SUM against MAX,
// another root) each rank's kernel does its own call over everyone's bytes, so the data comes out
// mixed and nothing fails; where the kind or the byte counts differ the launches hang until their
// communicator is aborted (NCCL hangs or reads past a buffer). Either is listed in violations().
//
// The fake models NCCL; it knows nothing of the backend's decisions (timeouts, error codes, which
// calls go into a group). What the backend does wrong against NCCL's rules (a call on a
// communicator after ncclCommAbort or ncclCommDestroy, an unbalanced group, mismatched
// collectives, an event of one device recorded on another's stream, a destroyed stream or event
// used) is listed by violations(), which every test checks is empty.
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "backends/nccl/nccl_api.hpp"

namespace fastcomms::test {

/// The fake (one per test; every rank thread shares it, as a process shares NCCL). Thread-safe.
class FakeNccl final : public nccl_backend::NcclApi {
 public:
  /// One call the backend made, in the order calls were made.
  struct Call {
    std::string name;              ///< The C name: "ncclAllReduce", "cudaEventRecord", ...
    int device = -1;               ///< The communicator's, stream's or event's device, else the
                                   ///< calling thread's current one.
    const void* comm = nullptr;    ///< The communicator it names, if any.
    const void* stream = nullptr;  ///< The stream it names, if any.
    const void* event = nullptr;   ///< The event it names, if any.
    bool in_group = false;         ///< Made between ncclGroupStart and ncclGroupEnd on its thread.
    std::thread::id thread;        ///< The calling thread.
  };
  /// One rank's ncclCommSplit.
  struct Split {
    int device, parent_rank, parent_size, color, key;
    int new_rank, new_size;  ///< -1 where the rank joined no communicator (NCCL_SPLIT_NOCOLOR)
  };
  /// The ncclConfig_t one ncclCommInitRankConfig or ncclCommSplit received (NOTE [nccl config
  /// hints]), its strings copied; `given` false where the call passed no config.
  struct ConfigSeen {
    std::string call;  ///< "ncclCommInitRankConfig" or "ncclCommSplit"
    int device = -1;
    bool given = false;
    ncclConfig_t config{};  ///< its string pointers cleared: see comm_name, net_name
    std::string comm_name, net_name;
    bool has_comm_name = false, has_net_name = false;
  };
  /// Objects alive now.
  struct Live {
    int comms = 0, streams = 0, events = 0, buffers = 0, host_buffers = 0;
  };

  FakeNccl();
  ~FakeNccl() override;

  // ---- control -------------------------------------------------------------------------------
  /// The next `times` calls named `call` ("ncclAllReduce") on `device` (-1: any) return `result`
  /// and do nothing else.
  void fail(const std::string& call, ncclResult_t result, int device = -1, int times = 1);
  /// The same for a CUDA runtime call ("cudaEventRecord").
  void fail_cuda(const std::string& call, cudaError_t error, int device = -1, int times = 1);
  /// ncclCommGetAsyncError on every communicator of `device` reports `result` from now on.
  void set_async_error(int device, ncclResult_t result);
  /// What ncclGetLastError returns (default empty).
  void set_last_error(const std::string& text);
  /// Launches issued on `device` from now on do not complete until release(device).
  void hold(int device);
  void release(int device);
  /// How long a blocking call (init, split, stream synchronize) waits for the others before it
  /// fails and says so in violations() (default 20 s).
  void set_wait_limit(std::chrono::milliseconds limit);

  // ---- what happened -------------------------------------------------------------------------
  /// Every call, in order (on `device` only, unless -1).
  std::vector<Call> calls(int device = -1) const;
  /// How many calls named `name` were made on `device` (-1: any).
  int count(const std::string& name, int device = -1) const;
  std::vector<Split> splits() const;
  std::vector<ConfigSeen> configs() const;
  /// Breaks of NCCL's or CUDA's rules, in words; empty when the backend kept them all.
  std::vector<std::string> violations() const;
  Live live() const;
  /// Group depth of the calling thread (0 outside any group).
  static int group_depth();

  // ---- NcclApi -------------------------------------------------------------------------------
  ncclResult_t get_version(int* version) override;
  const char* get_error_string(ncclResult_t result) override;
  const char* get_last_error(ncclComm_t comm) override;
  ncclResult_t get_unique_id(ncclUniqueId* id) override;
  ncclResult_t comm_init_rank_config(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                     ncclConfig_t* config) override;
  ncclResult_t comm_split(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                          ncclConfig_t* config) override;
  ncclResult_t comm_abort(ncclComm_t comm) override;
  ncclResult_t comm_destroy(ncclComm_t comm) override;
  ncclResult_t comm_get_async_error(ncclComm_t comm, ncclResult_t* async_error) override;
  ncclResult_t comm_register(ncclComm_t comm, void* buff, size_t size, void** handle) override;
  ncclResult_t comm_deregister(ncclComm_t comm, void* handle) override;
  ncclResult_t red_op_create_pre_mul_sum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                         ncclScalarResidence_t residence, ncclComm_t comm) override;
  ncclResult_t red_op_destroy(ncclRedOp_t op, ncclComm_t comm) override;
  ncclResult_t group_start() override;
  ncclResult_t group_end() override;
  ncclResult_t all_reduce(const void* sendbuff, void* recvbuff, size_t count,
                          ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                          cudaStream_t stream) override;
  ncclResult_t broadcast(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm,
                         cudaStream_t stream) override;
  ncclResult_t reduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                      ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) override;
  ncclResult_t all_gather(const void* sendbuff, void* recvbuff, size_t sendcount,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) override;
  ncclResult_t reduce_scatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                              ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                              cudaStream_t stream) override;
  ncclResult_t send(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                    ncclComm_t comm, cudaStream_t stream) override;
  ncclResult_t recv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                    ncclComm_t comm, cudaStream_t stream) override;

  const char* cuda_get_error_name(cudaError_t error) override;
  const char* cuda_get_error_string(cudaError_t error) override;
  cudaError_t cuda_get_last_error() override;
  cudaError_t cuda_get_device(int* device) override;
  cudaError_t cuda_set_device(int device) override;
  cudaError_t cuda_device_get_stream_priority_range(int* least, int* greatest) override;
  cudaError_t cuda_stream_create_with_priority(cudaStream_t* stream, unsigned int flags,
                                               int priority) override;
  cudaError_t cuda_stream_destroy(cudaStream_t stream) override;
  cudaError_t cuda_stream_synchronize(cudaStream_t stream) override;
  cudaError_t cuda_stream_wait_event(cudaStream_t stream, cudaEvent_t event,
                                     unsigned int flags) override;
  cudaError_t cuda_stream_is_capturing(cudaStream_t stream,
                                       cudaStreamCaptureStatus* status) override;
  cudaError_t cuda_thread_exchange_stream_capture_mode(cudaStreamCaptureMode* mode) override;
  cudaError_t cuda_event_create_with_flags(cudaEvent_t* event, unsigned int flags) override;
  cudaError_t cuda_event_destroy(cudaEvent_t event) override;
  cudaError_t cuda_event_record(cudaEvent_t event, cudaStream_t stream) override;
  cudaError_t cuda_event_query(cudaEvent_t event) override;
  cudaError_t cuda_malloc(void** ptr, size_t size) override;
  cudaError_t cuda_free(void* ptr) override;
  cudaError_t cuda_memset_async(void* ptr, int value, size_t count, cudaStream_t stream) override;
  cudaError_t cuda_memcpy_async(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                cudaStream_t stream) override;
  cudaError_t cuda_host_alloc(void** ptr, size_t size, unsigned int flags) override;
  cudaError_t cuda_free_host(void* ptr) override;

  struct Launch;
  struct Stream;
  struct Event;
  struct Comm;
  struct World;
  struct Part;

 private:
  struct NcclFailure {
    std::string call;
    ncclResult_t result;
    int device, left;
  };
  struct CudaFailure {
    std::string call;
    cudaError_t error;
    int device, left;
  };
  // An asynchronous copy: runs once every launch its stream held before it is complete.
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
    std::vector<std::shared_ptr<Launch>> deps;
    std::shared_ptr<Launch> launch;
  };
  // Pinned host memory (cudaHostAlloc).
  struct HostAlloc {
    std::unique_ptr<char[]> mem;
    size_t size;
    unsigned int flags;
  };

  // All below run with mu_ held.
  Comm* comm_of(ncclComm_t comm, const char* call);
  Stream* stream_of(cudaStream_t stream, const char* call);
  Event* event_of(cudaEvent_t event, const char* call);
  void record(const char* name, int device, const void* comm, const void* stream,
              const void* event);
  bool take_failure(const char* call, int device, ncclResult_t* result);
  bool take_failure(const char* call, int device, cudaError_t* error);
  void violation(std::string what);
  ncclResult_t enqueue(Part part, Stream* stream);
  void submit(const std::shared_ptr<Launch>& launch, Part& part);
  void finish(Launch& launch);
  void progress();  // runs the copies whose streams reached them
  const HostAlloc* host_alloc_of(const void* p) const;  // the pinned allocation holding p
  void check_nccl_buffer(const void* p, const char* call, const char* what);
  void run_collective(World& world, uint64_t seq);
  bool done(const Launch& launch) const;
  template <typename Pred>
  bool wait_for(std::unique_lock<std::mutex>& lock, Pred pred, const std::string& what);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::chrono::milliseconds wait_limit_{20000};
  std::vector<Call> calls_;
  std::vector<Split> splits_;
  std::vector<ConfigSeen> configs_;
  void record_config(const char* call, int device, const ncclConfig_t* config);
  std::vector<std::string> violations_;
  std::vector<NcclFailure> nccl_failures_;
  std::vector<CudaFailure> cuda_failures_;
  std::map<int, ncclResult_t> async_errors_;
  std::string last_error_;
  std::set<int> held_;
  uint64_t next_id_ = 1;
  std::map<std::string, std::shared_ptr<World>> by_id_;
  std::vector<std::unique_ptr<Comm>> comms_;
  std::map<const void*, std::unique_ptr<Stream>> streams_;  // destroyed ones stay, marked
  std::map<int, Stream*> default_streams_;
  std::map<const void*, std::unique_ptr<Event>> events_;
  std::vector<std::shared_ptr<Launch>> launches_;
  std::map<void*, std::unique_ptr<char[]>> buffers_;
  std::map<const char*, HostAlloc> host_buffers_;
  std::vector<Copy> copies_;
};

}  // namespace fastcomms::test
