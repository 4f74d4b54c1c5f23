// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

// Element-wise reduction functions on the CPU for every reducible dtype, in the form Gloo takes:
// c[i] = a[i] op b[i]. Half types compute in float and round to nearest even, as torch does.

#include <cstdint>
#include <cstring>
#include <functional>

#include "fastcomms/core/half.hpp"  // half/bf16 codecs (fastcomms::)
#include "fastcomms/core/reduce_op.hpp"
#include "fastcomms/core/tensor.hpp"

namespace fastcomms::gloo_backend {

using ReduceFn = std::function<void(void*, const void*, const void*, size_t)>;

/// The reduce function for (op, dtype); throws kUnsupported for combinations that have none.
ReduceFn reduce_fn(RedOpType op, DType dt);

/// Multiplies every element of `data` by `factor` in place (PREMUL_SUM's pre-step): the factor
/// rounded to `dt`, the product rounded to `dt` (NOTE [premul arithmetic]).
void scale_in_place(void* data, int64_t n, DType dt, double factor);

/// `factor` rounded to `dt` (as NCCL holds PREMUL_SUM's scalar in the reduction's type).
double factor_in(DType dt, double factor);

/// The one element of a host factor tensor (NOTE [device factor]), as a double.
double read_factor(const TensorView& f);

/// Divides every element by `n` in place (AVG's post-step; integers truncate toward zero).
void divide_in_place(void* data, int64_t count, DType dt, int64_t n);

}  // namespace fastcomms::gloo_backend
