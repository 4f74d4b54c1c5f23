// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// NOTE [process group fast path]: what fastcomms._c10d's backend calls in fastcomms._C to run a
// process group's hottest collectives (all_reduce, all_gather_into_tensor, reduce_scatter_tensor:
// what DDP and FSDP2 issue per bucket and per layer; all_to_all_single with equal splits, as
// sequence and expert parallelism issue it) on the communicator without the Python
// round trip of NOTE [c10d backend over python] (measured on one H200: about 13 us of host time
// per call through Python against 8 us for the communicator's own call, docs/benchmarks.md).
//
// The two modules are built with different pybind11s, so nothing pybind11 crosses: _C hands out
// this table of plain functions in a capsule (`fastcomms._C._fast_ops`) and each communicator's
// C++ object in another (`TorchComm._fast`, None while the communicator has Python hooks or
// observers, which only the Python path runs, or is not a C++ communicator). The backend reads
// `_fast` on every call (a reconfigure replaces it) and takes the Python path when it is None
// or the call is one the table does not cover (several tensors, a PREMUL_SUM factor held in a
// tensor). The work keeps the op's tensors as the Python path does (a dropped unfinished work
// parks them, NOTE [python tensors outlive their op] in binding.cpp), and errors reach Python as
// the same exceptions: the table sets them (NOTE [error mapping]) and the backend rethrows them as
// a Python error. Both modules build with torch's headers and ABI flag, so at::Tensor and
// std::string are the same types on both sides.
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <string>

namespace fastcomms::python {

struct FastWork;  // _C's: the communicator's work and the op's tensors

enum class FastOp : int {
  kAllReduce = 0,
  kAllGatherSingle = 1,
  kReduceScatterSingle = 2,
  kAllToAllSingle = 3,  // equal splits only
};

struct FastError {
  int code = -1;  ///< fastcomms' ErrorCode, or -1 for another exception (a RuntimeError)
  std::string message;
};

struct FastOps {
  static constexpr int kAbi = 1;
  int abi = kAbi;
  /// Issues `op` async on the communicator `comm` (the capsule's pointer) on the caller's
  /// current stream: all_reduce(a), all_gather_single(out a, in b), reduce_scatter_single(out a,
  /// in b), all_to_all_single(out a, in b); `red` is torch's reduction (never UNUSED),
  /// `factor` PREMUL_SUM's. GIL held. Null with a Python error set when the op raised.
  FastWork* (*issue)(void* comm, FastOp op, const at::Tensor& a, const at::Tensor& b,
                     c10d::ReduceOp::RedOpType red, double factor) = nullptr;
  /// Waits as TorchWork.wait does (a CUDA op: the caller's stream waits). No GIL needed. False
  /// with `err` filled when the op failed.
  bool (*wait)(FastWork* w, FastError* err) = nullptr;
  /// Whether the op is done (no GIL needed).
  bool (*completed)(FastWork* w) = nullptr;
  /// Drops the work (an unfinished op's tensors are parked). GIL held.
  void (*release)(FastWork* w) = nullptr;
  /// Sets the Python exception fastcomms raises for `err`. GIL held.
  void (*set_error)(const FastError& err) = nullptr;
};

inline constexpr const char* kFastOpsCapsule = "fastcomms._C._fast_ops";
inline constexpr const char* kFastCommCapsule = "fastcomms._C.Comm";

}  // namespace fastcomms::python
