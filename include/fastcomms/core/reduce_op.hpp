// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Reduction operators (torchcomms' ReduceOp / RedOpType).

#include <string_view>
#include <utility>

#include "fastcomms/core/tensor.hpp"

namespace fastcomms {

/// The kind of a reduction.
enum class RedOpType : int {
  kSum = 0,
  kProduct,
  kMin,
  kMax,
  kBand,
  kBor,
  kBxor,
  kAvg,
  kPremulSum,
};

/// torch's name of `t` ("SUM", "PREMUL_SUM", ...).
std::string_view red_op_name(RedOpType t) noexcept;

/// A reduction: its type and, for PREMUL_SUM, the factor each input is multiplied by first.
///
/// NOTE [device factor]: PREMUL_SUM's factor is a number (`factor`, known on the host at the
/// call) or, where `factor_tensor.data` is set, one element in memory that the op reads when it
/// runs: on a CUDA op, device memory on the op's device (NCCL's ncclScalarDevice: no host sync,
/// so a factor computed by an earlier kernel on the caller's stream is the one used); on a CPU op,
/// host memory read by the backend's worker when the op runs. The element has the reduced
/// tensor's dtype (the Python binding casts a floating factor of another dtype on the caller's
/// stream). The view is borrowed: the caller keeps the memory alive until the op completes. The
/// call check cannot compare such a factor across ranks (reading it on the host would sync): it
/// fingerprints it as "factor unknown" (core/wire_fingerprint.cpp).
struct ReduceOp {
  RedOpType type = RedOpType::kSum;  ///< What to compute.
  double factor = 1.0;               ///< PREMUL_SUM's factor (ignored otherwise).
  TensorView factor_tensor = {};     ///< PREMUL_SUM's factor in memory, where data is set.

  /// True when PREMUL_SUM's factor is read from memory when the op runs (NOTE [device factor]).
  bool has_factor_tensor() const noexcept {
    return type == RedOpType::kPremulSum && factor_tensor.data != nullptr;
  }

  static ReduceOp sum() { return {RedOpType::kSum}; }
  static ReduceOp product() { return {RedOpType::kProduct}; }
  static ReduceOp min() { return {RedOpType::kMin}; }
  static ReduceOp max() { return {RedOpType::kMax}; }
  static ReduceOp band() { return {RedOpType::kBand}; }
  static ReduceOp bor() { return {RedOpType::kBor}; }
  static ReduceOp bxor() { return {RedOpType::kBxor}; }
  static ReduceOp avg() { return {RedOpType::kAvg}; }
  /// PREMUL_SUM(factor): sum of factor * input.
  static ReduceOp premul_sum(double factor) { return {RedOpType::kPremulSum, factor}; }
  /// PREMUL_SUM with its factor read from `factor` (one element) when the op runs.
  static ReduceOp premul_sum(TensorView factor) {
    return {RedOpType::kPremulSum, 1.0, std::move(factor)};
  }
};

}  // namespace fastcomms
