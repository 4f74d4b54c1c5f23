// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// NOTE [nccl config hints]: a communicator's hints become the ncclConfig_t its NCCL communicator
// is made with (ncclCommInitRankConfig, and ncclCommSplit for a split's members), under the keys
// torchcomms' nccl backend reads (TorchCommNCCLBootstrap.cpp, populateNcclConfigFromHints), in
// both spellings it takes: blocking, cgaClusterSize / cga_cluster_size, minCTAs / min_ctas,
// maxCTAs / max_ctas, netName, splitShare / split_share, trafficClass / traffic_class, commName,
// collnetEnable / collnet_enable, CTAPolicy / cta_policy, shrinkShare, nvlsCTAs / nvls_ctas,
// nChannelsPerNetPeer / n_channels_per_net_peer, nvlinkCentricSched / nvlink_centric_sched.
// commName defaults to the communicator's name, as torchcomms sets it. The backend-level hints
// is_high_priority_stream (a bool as torchcomms parses one) and max_event_pool_size (an unsigned
// integer) are read by the backend, not NCCL. What differs from torchcomms, on purpose:
// - A value that is not a whole integer (or bool) raises ValueError naming the key and the value
//   (torchcomms' std::stoi takes "12abc" as 12 and raises a bare "stoi" on "abc").
// - blocking=0 raises: the backend drives NCCL in blocking mode (a non-blocking communicator
//   returns ncclInProgress from its calls, which the backend would take for a failure; torchcomms'
//   init fails the same way, with "operation in progress").
// - nvlsCTAs > 0 asks NCCL for NVLink SHARP (multicast objects), which fastcomms keeps off on
//   shared machines (NCCL_NVLS_ENABLE=0): the hint is not passed to NCCL and a warning says so.
// - nChannelsPerNetPeer and nvlinkCentricSched reach NCCL (torchcomms' #elif never reaches them
//   with NCCL >= 2.27, so it warns and drops them).
// A key neither torchcomms nor fastcomms reads is logged as a warning and ignored, as torchcomms
// does ("NCCL hint '<key>' is not supported in this NCCL version, ignoring for comm '<name>'");
// fastcomms' own hints (check_calls, nccl.*) and other layers' namespaced ones (gloo.*, ...) are
// not warned about.
#include <nccl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "fastcomms/core/options.hpp"

namespace fastcomms::nccl_backend {

/// The ncclConfig_t a communicator's hints ask for, with the strings its pointers name.
/// Copyable: get() points the config's strings at this object's own.
class NcclConfig {
 public:
  /// NCCL_CONFIG_INITIALIZER with `hints` applied (NOTE [nccl config hints]); `name` is the
  /// default commName, `prefix` starts error messages and warnings. Throws kInvalidArgument for a
  /// value of the wrong type, kUnsupported for blocking=0.
  NcclConfig(const Hints& hints, const std::string& name, const std::string& prefix);

  /// The config, valid while this object lives and is not modified.
  ncclConfig_t* get();
  /// Names the communicator `name` (nccl-lazy's pair communicators).
  void set_comm_name(std::string name) { comm_name_ = std::move(name); }
  /// Hint is_high_priority_stream (or fastcomms' nccl.high_priority=1).
  bool high_priority_stream() const { return high_priority_; }
  /// Hint max_event_pool_size (torchcomms' default 1000).
  size_t max_event_pool_size() const { return max_event_pool_size_; }
  /// What was logged as ignored, one line per hint (for tests).
  const std::vector<std::string>& ignored() const { return ignored_; }

 private:
  ncclConfig_t config_ = NCCL_CONFIG_INITIALIZER;
  std::string comm_name_, net_name_;
  bool has_net_name_ = false;
  bool high_priority_ = false;
  size_t max_event_pool_size_ = 1000;
  std::vector<std::string> ignored_;
};

}  // namespace fastcomms::nccl_backend
