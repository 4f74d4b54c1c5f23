// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// The nccl backend over a chosen NcclApi (NOTE [nccl seam]); the "nccl" registration uses
// real_nccl_api(), a test passes a fake.
#include <memory>

#include "backends/nccl/nccl_api.hpp"
#include "fastcomms/core/backend.hpp"

namespace fastcomms::nccl_backend {

/// A nccl backend for `init` whose every NCCL and CUDA runtime call goes to `api` (not null).
/// It creates its communicator by unique id through init.options.store, as the "nccl"
/// registration does. Throws fastcomms::Error as that backend's constructor does.
std::unique_ptr<Backend> make_nccl_backend(const BackendInit& init, std::shared_ptr<NcclApi> api);

}  // namespace fastcomms::nccl_backend
