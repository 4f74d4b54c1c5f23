// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The registry of the device all-to-all-v implementation (fastcomms/core/device_alltoallv.hpp).
#include "fastcomms/core/device_alltoallv.hpp"

#include <mutex>
#include <utility>

#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

std::mutex& registry_mu() {
  static std::mutex mu;
  return mu;
}
DeviceAlltoallvFactory& registered() {
  static DeviceAlltoallvFactory f;
  return f;
}

}  // namespace

void register_device_alltoallv(DeviceAlltoallvFactory factory) {
  std::lock_guard<std::mutex> lock(registry_mu());
  registered() = std::move(factory);
}

std::unique_ptr<DeviceAlltoallv> make_device_alltoallv(const DeviceAlltoallvInit& init) {
  DeviceAlltoallvFactory f;
  {
    std::lock_guard<std::mutex> lock(registry_mu());
    f = registered();
  }
  FASTCOMMS_CHECK(f != nullptr, kUnsupported, "[rank ", init.rank, "/", init.size, " ", init.name,
                  " device_alltoallv_single] this build of fastcomms has no CUDA layer");
  return f(init);
}

}  // namespace fastcomms
