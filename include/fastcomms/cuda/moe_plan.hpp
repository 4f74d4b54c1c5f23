// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The MoE routing-plan kernels (NOTE [moe plan kernels] in include/fastcomms/plan/moe_plan.hpp):
/// one block each, ordered on `stream`, launched on the current device. The caller has checked
/// the sizes (core/rows.cpp); keys (ranks, local experts) are at most plan::kMoePlanMaxKeys.

#include <cuda_runtime_api.h>

#include "fastcomms/plan/moe_plan.hpp"

namespace fastcomms::cuda {

void moe_plan_home(const plan::MoePlanHome& a, cudaStream_t stream);
void moe_plan_send(const plan::MoePlanSend& a, cudaStream_t stream);
void moe_plan_expert(const plan::MoePlanExpert& a, cudaStream_t stream);

}  // namespace fastcomms::cuda
