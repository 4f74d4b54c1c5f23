// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [nccl config hints] (nccl_config.hpp).
#include "backends/nccl/nccl_config.hpp"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <string_view>

#include "fastcomms/core/log.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::nccl_backend {
namespace {

std::string_view trimmed(std::string_view s) {
  const auto b = s.find_first_not_of(" \t\n\r\f\v");
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\n\r\f\v") - b + 1);
}

// A whole integer of T (surrounding white space and a leading '+' allowed, as std::stoi takes).
template <typename T>
T parse_integer(const std::string& key, const std::string& value, const char* expected,
                const std::string& prefix) {
  std::string_view s = trimmed(value);
  if (s.size() > 1 && s.front() == '+') s.remove_prefix(1);
  T out{};
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  FASTCOMMS_CHECK(!s.empty() && ec == std::errc() && end == s.data() + s.size(), kInvalidArgument,
                  prefix, "hint ", key, " must be ", expected, ", got '", value, "'");
  return out;
}

// torchcomms' string_to_bool: 1/true/yes/y or 0/false/no/n, any case, white space trimmed.
bool parse_bool(const std::string& key, const std::string& value, const std::string& prefix) {
  std::string s(trimmed(value));
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (s == "1" || s == "true" || s == "yes" || s == "y") return true;
  if (s == "0" || s == "false" || s == "no" || s == "n") return false;
  throw Error(ErrorCode::kInvalidArgument,
              detail::cat(prefix, "hint ", key,
                          " must be a bool (1/true/yes/y or 0/false/no/n), got '", value, "'"));
}

// fastcomms' own hints the nccl backend or the communicator reads, besides NCCL's config.
bool fastcomms_hint(const std::string& key) {
  if (key == "check_calls" || key == "nccl.high_priority" || key == "nccl.check_calls_fuse" ||
      key == "nccl.check_calls_memory")
    return true;
  // Another layer's or backend's namespace ("gloo.interface", "ulysses.x"): not NCCL's to judge.
  const auto dot = key.find('.');
  return dot != std::string::npos && dot > 0 && key.compare(0, dot, "nccl") != 0;
}

}  // namespace

NcclConfig::NcclConfig(const Hints& hints, const std::string& name, const std::string& prefix)
    : comm_name_(name) {
  const auto as_int = [&](const std::string& key, const std::string& value) {
    return parse_integer<int>(key, value, "an integer", prefix);
  };
  for (const auto& [key, value] : hints) {
    if (key == "is_high_priority_stream") {
      high_priority_ = parse_bool(key, value, prefix);
    } else if (key == "max_event_pool_size") {
      max_event_pool_size_ =
          parse_integer<size_t>(key, value, "an unsigned integer (an event count)", prefix);
    } else if (key == "blocking") {
      const int v = as_int(key, value);
      // The backend takes a non-blocking communicator's ncclInProgress for a failure: refused
      // here, naming why, rather than failing later in an op (NOTE [nccl config hints]).
      FASTCOMMS_CHECK(v != 0, kUnsupported, prefix,
                      "hint blocking=0 (a non-blocking NCCL communicator) is not supported: the "
                      "nccl backend drives NCCL in blocking mode; leave it unset or pass 1");
      config_.blocking = v;
    } else if (key == "cgaClusterSize" || key == "cga_cluster_size") {
      config_.cgaClusterSize = as_int(key, value);
    } else if (key == "minCTAs" || key == "min_ctas") {
      config_.minCTAs = as_int(key, value);
    } else if (key == "maxCTAs" || key == "max_ctas") {
      config_.maxCTAs = as_int(key, value);
    } else if (key == "netName") {
      net_name_ = value;
      has_net_name_ = true;
    } else if (key == "splitShare" || key == "split_share") {
      config_.splitShare = as_int(key, value);
    } else if (key == "trafficClass" || key == "traffic_class") {
      config_.trafficClass = as_int(key, value);
    } else if (key == "commName") {
      comm_name_ = value;
    } else if (key == "collnetEnable" || key == "collnet_enable") {
      config_.collnetEnable = as_int(key, value);
    } else if (key == "CTAPolicy" || key == "cta_policy") {
      config_.CTAPolicy = as_int(key, value);
    } else if (key == "shrinkShare") {
      config_.shrinkShare = as_int(key, value);
    } else if (key == "nvlsCTAs" || key == "nvls_ctas") {
      const int v = as_int(key, value);
      if (v > 0) {
        // NVLink SHARP needs multicast objects, which stay off on shared machines
        // (NCCL_NVLS_ENABLE=0): the hint is dropped, loudly.
        ignored_.push_back(detail::cat(
            "hint ", key, "=", v,
            " asks NCCL for NVLink SHARP (NVLS, multicast objects), which fastcomms keeps off "
            "(NCCL_NVLS_ENABLE=0): not passed to NCCL"));
        FASTCOMMS_LOG(kWarn, prefix, ignored_.back());
      } else {
        config_.nvlsCTAs = v;  // NCCL judges 0 and negative values
      }
    } else if (key == "nChannelsPerNetPeer" || key == "n_channels_per_net_peer") {
      config_.nChannelsPerNetPeer = as_int(key, value);
    } else if (key == "nvlinkCentricSched" || key == "nvlink_centric_sched") {
      config_.nvlinkCentricSched = as_int(key, value);
    } else if (!fastcomms_hint(key)) {
      ignored_.push_back(detail::cat("NCCL hint '", key,
                                     "' is not supported in this NCCL version, ignoring for comm '",
                                     name, "'"));
      FASTCOMMS_LOG(kWarn, prefix, ignored_.back());
    }
  }
  if (auto it = hints.find("nccl.high_priority"); it != hints.end() && it->second == "1")
    high_priority_ = true;
}

ncclConfig_t* NcclConfig::get() {
  config_.commName = comm_name_.c_str();
  config_.netName = has_net_name_ ? net_name_.c_str() : NCCL_CONFIG_UNDEF_PTR;
  return &config_;
}

}  // namespace fastcomms::nccl_backend
