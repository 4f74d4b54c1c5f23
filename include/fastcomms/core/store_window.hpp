// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Windows over a store alone (NOTE [store windows]): CUDA IPC windows for ranks that cannot
/// share a communicator's NCCL (MPS clients of one GPU, which NCCL refuses).

#include <chrono>
#include <memory>
#include <string>

#include "fastcomms/core/store.hpp"
#include "fastcomms/core/window.hpp"

namespace fastcomms {

/// A window group made over a store alone, with no communicator: ranks that cannot share an
/// NCCL communicator (MPS clients of one GPU, which NCCL refuses) still get CUDA IPC windows and
/// their device API. Every rank of the group calls make_store_window with the same name.
struct StoreWindowInit {
  int rank = 0;
  int size = 1;
  int device = 0;                              ///< CUDA ordinal.
  std::shared_ptr<Store> store;                ///< Rendezvous (IPC handles travel through it).
  std::string name = "window";                 ///< Key namespace in the store.
  std::chrono::milliseconds timeout{600'000};  ///< Store waits and device waits.
};
/// Collective: a CUDA IPC window (backends/ipc) over `init.store`; kUnsupported in a build
/// without CUDA.
std::shared_ptr<Window> make_store_window(const StoreWindowInit& init);
/// Installs what make_store_window calls (backends/ipc does at load time).
void set_store_window_maker(std::shared_ptr<Window> (*maker)(const StoreWindowInit&));

}  // namespace fastcomms
