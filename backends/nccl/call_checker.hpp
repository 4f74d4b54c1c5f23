// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// NOTE [nccl call check]: the nccl backend's call check beside the op (FASTCOMMS_CHECK_CALLS=1,
// opt-in until its cost is measured on two GPUs; the
// nvlink backend runs every op but its peer-to-peer all-to-all on an inner nccl communicator, so
// it has it too). NCCL cannot compare calls before it moves data without a round trip per call
// (the strict check, through the store), so this one compares them beside the op: for every
// collective each rank writes its call's 16-byte fingerprint (NOTE [wire fingerprint]: op,
// dtype, count or a digest of count, PREMUL_SUM factor and call key, or a pairing term of the
// sizes per peer, root, reduction, the collective's number) into a slot of pinned host memory,
// and an ncclAllGather of 16 bytes per rank is issued on the internal stream just before the op,
// so both go through NCCL in the same order on every rank. Where the fingerprints land (a
// device-to-host copy on a side stream, or straight into mapped host memory) an event is
// recorded; the op's completion event comes after it. Checks are compared in issue order,
// without blocking (event queries), by the watchdog on every tick and every issue, by the next
// call's issue, and by the op's Work::status(); Work::wait() raises what is known. A Work never
// reports completion before its fingerprints were compared. A mismatch fails the op's Work and
// every later one with a ValueError naming each rank's call, and the communicator is aborted
// (ncclCommAbort), so every later call raises it too, finalize() included where nothing found it
// before.
//
// What it cannot do: stop the op. NCCL runs it before anyone looks at the fingerprints, so a
// mismatch whose byte counts agree (float32 against int32, SUM against MAX, another root) has
// written its mixed data when it raises; the communicator is aborted, so the data cannot go on
// to the next collective silently. Byte counts that disagree make NCCL hang (or read past a
// buffer): the exchange ran before the op, so its fingerprints land while the op hangs, the
// watchdog finds the mismatch on its next tick, and the abort ends the hung kernel, where NCCL
// alone would wait out the timeout. Calls captured into a CUDA graph are not checked (every rank
// must capture the same calls, as NCCL requires anyway), and a rank that never issues the
// collective leaves its peers' exchange waiting until the op's timeout, as NCCL would.
//
// Every rank must use the same setting (and per-op hints): a checked call's extra all-gather
// would otherwise meet a peer's op. Cost per call: the all-gather's launch and kernel on the
// op's stream, a 16-byte host-to-device copy, the landing copy and two events on a side stream;
// nothing blocks the host. Two hints trade the hang catching for less: nccl.check_calls_fuse=1
// issues the all-gather in the op's own NCCL group (one launch; the fingerprints land with the
// op, so a hang is the watchdog's timeout again; collectives only, the send/receive forms keep
// the separate launch), nccl.check_calls_memory=host lets NCCL read and write the fingerprints
// in mapped pinned host memory (no copies). docs/reliability.md has the matrix,
// tools/gpu/bench_call_check.py measures them.
#include <cuda_runtime_api.h>

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backends/nccl/nccl_api.hpp"
#include "backends/nccl/nccl_util.hpp"
#include "fastcomms/core/backend.hpp"
#include "fastcomms/core/wire_fingerprint.hpp"
#include "fastcomms/core/work.hpp"

namespace fastcomms::nccl_backend {

/// An op's Work, as the check sees it: failed when the check finds its call mismatched.
class CheckedWork : public Work {
 public:
  /// Fails the op with `code` and `why` (the work puts its prefix before it); the first failure
  /// wins, and an op that timed out or was aborted keeps that.
  virtual void fail(ErrorCode code, std::string why) = 0;
};

/// How the fingerprints travel (NOTE [nccl call check]).
struct CheckPlacement {
  bool fuse = false;    ///< the all-gather in the op's own NCCL group (nccl.check_calls_fuse=1)
  bool mapped = false;  ///< fingerprints in mapped pinned host memory (nccl.check_calls_memory)
};

/// The fingerprint slots and the checks in flight of one nccl communicator.
///
/// Thread safety: every member may be called from any thread. The issue side (acquire to track
/// or abandon) runs under the backend's issue lock with the communicator's device current; poll()
/// from the watchdog, the issuing thread and the works. Ownership: shared by the backend and its
/// works; close() (the backend's destructor) frees the slots and drops the works it holds.
class CallChecker {
 public:
  CallChecker(std::shared_ptr<NcclApi> api, int size, CheckPlacement placement);
  ~CallChecker();
  CallChecker(const CallChecker&) = delete;
  CallChecker& operator=(const CallChecker&) = delete;

  const CheckPlacement& placement() const { return placement_; }

  /// A free slot holding `call` (a new slab of slots where none is free).
  int acquire(const WireCall& call, const std::string& prefix);
  /// Where NCCL reads this rank's fingerprint and writes every rank's.
  const void* send_buffer(int slot) const;
  void* recv_buffer(int slot) const;
  /// Before the all-gather, on `stream`: this rank's fingerprint to the device (device memory).
  void stage(int slot, cudaStream_t stream, const std::string& prefix);
  /// Once the all-gather is issued on `stream`: the fingerprints' way to the host, ending in the
  /// slot's event (a side stream's copy without fusion, a copy on `stream` with it).
  void land(int slot, cudaStream_t stream, const std::string& prefix);
  /// After the op on `stream`: the op's completion waits for the landing (side-stream copies).
  void join(int slot, cudaStream_t stream, const std::string& prefix);
  /// The slot's all-gather was issued: compare it once landed, failing `work` (null: the op did
  /// not issue) on a mismatch; `mine` is the call, for the message.
  void track(int slot, const CallFingerprint& mine, std::shared_ptr<CheckedWork> work);
  /// The slot's all-gather was never issued: the slot is free again.
  void abandon(int slot);

  /// Compares every tracked check whose fingerprints have landed, in issue order, without
  /// blocking. Returns whether a mismatch is known (then nothing more is compared). The caller's
  /// capture mode must be relaxed (NOTE [watchdog and graph capture]): it queries events.
  bool poll();
  /// The mismatch found, in words (empty: none).
  std::string mismatch() const;
  /// Whether tracked checks wait for their fingerprints.
  bool pending() const;
  /// A work raised its failure to its caller (so finalize() need not raise the mismatch).
  void note_raised() { raised_ = true; }
  bool raised() const { return raised_; }
  /// The communicator was aborted: what lands from now on is no peer's call, so nothing more is
  /// compared.
  void cancel();
  /// Frees the slots and drops the works held; later calls compare nothing. The slots' copies
  /// must be over (the communicator destroyed or aborted).
  void close();

 private:
  struct Slab {
    std::unique_ptr<HostBuffer> host;
    std::unique_ptr<DeviceBuffer> device;  // null with mapped memory
    std::vector<std::unique_ptr<Event>> landed, staged;
  };
  struct Check {
    int slot;
    WireCall call;
    CallFingerprint mine;
    std::shared_ptr<CheckedWork> work;
  };
  static constexpr int kSlabSlots = 64;
  char* host_slot(int slot) const;
  char* device_slot(int slot) const;
  cudaEvent_t landed(int slot) const;
  cudaEvent_t staged(int slot) const;

  std::shared_ptr<NcclApi> api_;
  int size_;
  CheckPlacement placement_;
  size_t stride_;  // bytes per slot: this rank's fingerprint, then every rank's

  mutable std::mutex mu_;
  std::vector<Slab> slabs_;
  std::vector<int> free_;
  std::deque<Check> checks_;      // tracked, in issue order
  std::vector<WireCall> calls_;   // by slot: what acquire() wrote
  std::unique_ptr<Stream> side_;  // the landing copies without fusion, device memory
  std::string mismatch_;
  bool cancelled_ = false, closed_ = false;
  std::atomic<bool> raised_{false};
};

}  // namespace fastcomms::nccl_backend
