// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Device windows (torchcomms' TorchCommDeviceWindow): what a kernel gets from
/// `TorchCommWindow.get_device_window()` to move data and synchronize from the GPU, with no host
/// round trip. Header-only; include it from a .cu file. Host code may include it too (the layout
/// and the enums; the device methods exist only under nvcc). No torch, no CUDA runtime calls.
///
/// A DeviceWindow is a POD: pass it by value to a kernel (or pass the device pointer that
/// `get_device_window()` returns and copy `*ptr` inside the kernel). It holds this rank's window
/// buffer, every peer's buffer mapped here (CUDA IPC), the signal pad, this rank's counters and
/// the barrier slots, all made by the host window (collectively) and valid until the window's
/// tensor is deregistered.
///
/// Return codes (torchcomms'): 0 success; kDeviceInvalid (-1) a rank, id, offset or size out of
/// range (nothing is written); kDeviceTimeout (-2) a wait gave up after the communicator's
/// timeout (the host's next `check_errors()` raises TimeoutError). Every thread of a WARP or
/// BLOCK scope call gets the same code.
///
/// NOTE [device window ordering]: the contract is release on signal, acquire on wait.
///  - put() stores with plain (weak) st.global through the peer's mapping, vectorized to 16 bytes
///    where both sides are aligned; by itself it orders nothing.
///  - signal() (and put() with a signal_id) first joins the scope's threads (bar.sync for BLOCK,
///    bar.warp.sync for WARP), so every store those threads made happens before the leader's
///    next operation at CTA scope; the leader then publishes with atom.release.sys.global.add.u64
///    (ADD) or st.release.sys.global.u64 (SET). A release is cumulative in the PTX memory model:
///    it carries every write ordered before it (the group's, through bar.sync) to system scope.
///  - wait_signal()/wait_signal_from()/wait_counter()/barrier() spin with ld.acquire.sys.global
///    until the comparison holds, then join the scope's threads, so every thread of the group
///    sees what the signaller wrote before its release.
///  - fence() is fence.acq_rel.sys: this thread's earlier puts are ordered before its later
///    puts and signals at system scope (torchcomms makes it a compiler barrier only; ours is
///    stronger). No fence.proxy.* is needed: puts are generic-proxy stores, never the copy
///    engine or TMA (async proxy); data a copy engine wrote is ordered by the stream (the kernel
///    starts after the copy completes).
///  - barrier() = signal-all (st.release.sys of this rank's epoch into each peer's slot) +
///    wait-all (ld.acquire.sys), so it is a full acq_rel rendezvous of the ranks.
///  - Counters are this rank's own memory: put(..., counter_id) bumps counter[counter_id] with
///    atom.release.gpu once the group's stores are issued (the source buffer may be reused).
/// The test control `kFaultUnorderedSignal` (armed only by tests) makes the leader signal with a
/// relaxed atomic before the group's stores: tests/python/test_device_window_gpu.py shows that
/// the receiver then reads stale data, so the ordering above is what the checks rest on.

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define FASTCOMMS_DEVICE_FN __device__ __forceinline__
#endif

namespace fastcomms::device {

/// How signal() changes the receiver's slot (torchcomms' SignalOp).
enum class SignalOp : int {
  SET = 0,  ///< slot = value
  ADD = 1,  ///< slot += value
};

/// The comparison a wait holds out for (torchcomms' CmpOp): `current <cmp> value`.
enum class CmpOp : int { EQ = 0, NE = 1, LT = 2, LE = 3, GT = 4, GE = 5 };

/// Which threads call together (torchcomms' CoopScope): THREAD one thread; WARP all 32 lanes of
/// a warp; BLOCK every thread of the block. WARP/BLOCK calls must be reached convergently.
enum class CoopScope : int { THREAD = 0, WARP = 1, BLOCK = 2 };

/// Return codes of the device calls.
inline constexpr int kDeviceOk = 0;
inline constexpr int kDeviceInvalid = -1;
inline constexpr int kDeviceTimeout = -2;

/// Fault bits (DeviceWindow::flags_), armed by tests only: kFaultUnorderedSignal drops the
/// ordering of a signal after a put (NOTE [device window ordering]).
inline constexpr uint32_t kFaultUnorderedSignal = 1u;

/// What a device put reads from (torchcomms' RegisteredBuffer): a local buffer from
/// `TorchCommWindow.register_local_buffer(tensor)`, whose return value is a device pointer to
/// one of these.
struct RegisteredBuffer {
  void* base_ptr = nullptr;        ///< First byte of the local buffer (this device).
  size_t size = 0;                 ///< Bytes.
  void* backend_window = nullptr;  ///< Unused on CUDA IPC (kept for torchcomms' layout).
};

/// The device-side window. Field order is a layout contract (fastcomms.triton reads the fields
/// by offset; python/fastcomms/triton/_layout.py, checked against offsetof in the CPU tests).
struct DeviceWindow {
  void* base_ = nullptr;                      ///< This rank's window buffer.
  size_t size_ = 0;                           ///< Bytes of each rank's buffer.
  int32_t rank_ = 0;                          ///< This rank.
  int32_t num_ranks_ = 0;                     ///< Ranks of the window's communicator.
  int32_t signal_count_ = 0;                  ///< Signal ids: [0, signal_count_).
  int32_t counter_count_ = 0;                 ///< Counter ids: [0, counter_count_).
  int32_t barrier_count_ = 0;                 ///< Barrier ids: [0, barrier_count_).
  uint32_t flags_ = 0;                        ///< Fault bits (tests only).
  void* const* peer_bases_ = nullptr;         ///< [q]: rank q's buffer mapped here.
  uint64_t* signals_ = nullptr;               ///< Local pad: [id * num_ranks + sender].
  uint64_t* const* peer_signals_ = nullptr;   ///< [q]: rank q's signal pad mapped here.
  uint64_t* counters_ = nullptr;              ///< Local: [counter_id].
  uint64_t* barriers_ = nullptr;              ///< Local: [id * num_ranks + sender] epochs.
  uint64_t* const* peer_barriers_ = nullptr;  ///< [q]: rank q's barrier slots mapped here.
  uint64_t* barrier_epochs_ = nullptr;        ///< Local: [id], this rank's last epoch.
  int* error_ = nullptr;                      ///< Host-mapped word a timed-out wait sets.
  uint64_t timeout_ns_ = 0;                   ///< Longest wait (0: forever).

#if defined(__CUDACC__)
  // -- metadata ----------------------------------------------------------------------------------
  FASTCOMMS_DEVICE_FN int rank() const { return rank_; }
  FASTCOMMS_DEVICE_FN int num_ranks() const { return num_ranks_; }
  FASTCOMMS_DEVICE_FN void* base() const { return base_; }
  FASTCOMMS_DEVICE_FN size_t size() const { return size_; }

  // -- RMA ---------------------------------------------------------------------------------------
  /// Copies `bytes` from `src_buf` at `src_offset` into rank `dst_rank`'s window at
  /// `dst_offset`, by the scope's threads; then, with `signal_id >= 0`, ADDs 1 to the peer's
  /// signal (release: NOTE [device window ordering]) and, with `counter_id >= 0`, 1 to this
  /// rank's counter.
  FASTCOMMS_DEVICE_FN int put(size_t dst_offset, const RegisteredBuffer& src_buf, size_t src_offset,
                              int dst_rank, size_t bytes, int signal_id = -1, int counter_id = -1,
                              CoopScope scope = CoopScope::THREAD);

  // -- signals (written into the receiver's pad) --------------------------------------------------
  /// Changes this rank's slot of `signal_id` in `peer`'s pad, after the scope's earlier writes.
  FASTCOMMS_DEVICE_FN int signal(int peer, int signal_id, SignalOp op = SignalOp::ADD,
                                 uint64_t value = 1, CoopScope scope = CoopScope::THREAD);
  /// Waits until the sum over senders of `signal_id` compares true with `value` (acquire).
  FASTCOMMS_DEVICE_FN int wait_signal(int signal_id, CmpOp cmp, uint64_t value,
                                      CoopScope scope = CoopScope::THREAD);
  /// Waits until `peer`'s slot of `signal_id` compares true with `value` (acquire).
  FASTCOMMS_DEVICE_FN int wait_signal_from(int peer, int signal_id, CmpOp cmp, uint64_t value,
                                           CoopScope scope = CoopScope::THREAD);
  /// The sum over senders of `signal_id` (0 for an id out of range).
  FASTCOMMS_DEVICE_FN uint64_t read_signal(int signal_id) const;
  /// Zeroes every sender's slot of `signal_id` here (only while no peer signals it).
  FASTCOMMS_DEVICE_FN void reset_signal(int signal_id, CoopScope scope = CoopScope::THREAD);

  // -- counters (this rank's memory) --------------------------------------------------------------
  FASTCOMMS_DEVICE_FN int wait_counter(int counter_id, CmpOp cmp, uint64_t value,
                                       CoopScope scope = CoopScope::THREAD);
  FASTCOMMS_DEVICE_FN uint64_t read_counter(int counter_id) const;
  FASTCOMMS_DEVICE_FN void reset_counter(int counter_id, CoopScope scope = CoopScope::THREAD);

  // -- synchronization ----------------------------------------------------------------------------
  /// fence.acq_rel.sys: this thread's earlier puts before its later ones.
  FASTCOMMS_DEVICE_FN int fence();
  /// Local completion: the scope's puts are issued, their sources may be reused.
  FASTCOMMS_DEVICE_FN int flush(CoopScope scope = CoopScope::THREAD);
  /// Every rank reaches barrier `barrier_id` (acq_rel). One group per rank uses an id at a time.
  FASTCOMMS_DEVICE_FN int barrier(int barrier_id, CoopScope scope = CoopScope::THREAD);

  // -- addresses ----------------------------------------------------------------------------------
  /// `peer`'s window buffer mapped here, for direct loads and stores (this rank's own buffer for
  /// peer == rank(); nullptr out of range).
  FASTCOMMS_DEVICE_FN void* get_nvlink_address(int peer) const;
  /// Always nullptr: fastcomms never creates NVLink multicast objects.
  FASTCOMMS_DEVICE_FN void* get_multimem_address(size_t offset = 0) const;
#endif
};

static_assert(sizeof(RegisteredBuffer) == 24, "RegisteredBuffer layout (Triton reads it)");
static_assert(sizeof(DeviceWindow) == 112, "DeviceWindow layout (Triton reads it)");
static_assert(offsetof(DeviceWindow, peer_bases_) == 40, "DeviceWindow layout");
static_assert(offsetof(DeviceWindow, timeout_ns_) == 104, "DeviceWindow layout");

}  // namespace fastcomms::device

#if defined(__CUDACC__)
#include "fastcomms/device/window_impl.cuh"
#endif
