// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Reduction operators (torchcomms' ReduceOp / RedOpType).

#include <string_view>

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
struct ReduceOp {
  RedOpType type = RedOpType::kSum;  ///< What to compute.
  double factor = 1.0;               ///< PREMUL_SUM's factor (ignored otherwise).

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
};

}  // namespace fastcomms
