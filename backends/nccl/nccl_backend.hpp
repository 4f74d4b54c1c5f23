// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// The nccl and nccl-lazy backends over a chosen NcclApi (NOTE [nccl seam]); the "nccl" and
// "nccl-lazy" registrations use real_nccl_api(), a test passes a fake.
#include <memory>

#include "backends/nccl/nccl_api.hpp"
#include "backends/nccl/nccl_config.hpp"
#include "fastcomms/core/backend.hpp"

namespace fastcomms::nccl_backend {

/// A nccl backend for `init` whose every NCCL and CUDA runtime call goes to `api` (not null).
/// It creates its communicator by unique id through init.options.store, as the "nccl"
/// registration does. Throws fastcomms::Error as that backend's constructor does.
std::unique_ptr<Backend> make_nccl_backend(const BackendInit& init, std::shared_ptr<NcclApi> api);
/// The same, its NCCL communicator made with `config` (NOTE [nccl config hints]) rather than the
/// config init's hints ask for.
std::unique_ptr<Backend> make_nccl_backend(const BackendInit& init, std::shared_ptr<NcclApi> api,
                                           NcclConfig config);

/// An "nccl-lazy" backend for `init` over `api` (NOTE [nccl-lazy]): collectives and batches on a
/// nccl backend over every rank, each send and receive on a two-rank nccl backend per peer made
/// on the first send or receive between the two. Throws fastcomms::Error as make_nccl_backend.
std::unique_ptr<Backend> make_nccl_lazy_backend(const BackendInit& init,
                                                std::shared_ptr<NcclApi> api);

}  // namespace fastcomms::nccl_backend
