// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Per-op and per-communicator options.

#include <chrono>
#include <map>
#include <memory>
#include <string>

namespace fastcomms {

class Store;

/// Hints: free-form key/value pairs a backend may read (e.g. "gloo.interface").
using Hints = std::map<std::string, std::string>;

/// The default communicator timeout (torchcomms: 600 s).
inline constexpr std::chrono::milliseconds kDefaultTimeout{600'000};

/// Options of one op.
struct OpOptions {
  Hints hints;                           ///< Per-op hints.
  std::chrono::milliseconds timeout{0};  ///< 0: the communicator's timeout.
};

/// Options of a communicator.
struct CommOptions {
  std::chrono::milliseconds timeout = kDefaultTimeout;  ///< Default per-op timeout.
  bool abort_process_on_timeout_or_error = false;       ///< std::abort() on timeout or error.
  std::shared_ptr<Store> store;                         ///< Rendezvous store.
  Hints hints;                                          ///< Communicator-wide hints.
  std::string name;                                     ///< Communicator name (messages, keys).
};

}  // namespace fastcomms
