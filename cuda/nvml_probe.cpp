// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NVML's header is not installed: the few entry points used are declared here and resolved with
// dlsym from libnvidia-ml.so.1.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <mutex>

#include "fastcomms/cuda/nvml.hpp"
#include "fastcomms/error.hpp"
#include "fastcomms/trusted_path.hpp"

namespace fastcomms::cuda {
namespace {

using nvmlReturn_t = int;
using nvmlDevice_t = void*;
constexpr nvmlReturn_t NVML_SUCCESS = 0;
constexpr int NVML_P2P_CAPS_INDEX_NVLINK = 3;  // nvmlGpuP2PCapsIndex_t
constexpr int NVML_P2P_STATUS_OK = 0;          // nvmlGpuP2PStatus_t

struct Nvml {
  void* lib = nullptr;
  nvmlReturn_t (*init)() = nullptr;
  nvmlReturn_t (*by_pci)(const char*, nvmlDevice_t*) = nullptr;
  nvmlReturn_t (*p2p_status)(nvmlDevice_t, nvmlDevice_t, int, int*) = nullptr;
  std::string error;
};

const Nvml& nvml() {
  static Nvml n = [] {
    Nvml m;
    const char* override_path = std::getenv("FASTCOMMS_NVML_LIBRARY");
    if (override_path) {  // a library named by the user must be trusted before it runs
      try {
        check_trusted_library(override_path, "FASTCOMMS_NVML_LIBRARY");
      } catch (const Error& e) {
        m.error = std::string("cannot load NVML: ") + e.what();
        return m;
      }
    }
    m.lib = ::dlopen(override_path ? override_path : "libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!m.lib) {
      const char* e = ::dlerror();
      m.error = std::string("cannot load NVML: ") + (e ? e : "dlopen failed");
      return m;
    }
    m.init = reinterpret_cast<decltype(m.init)>(::dlsym(m.lib, "nvmlInit_v2"));
    m.by_pci =
        reinterpret_cast<decltype(m.by_pci)>(::dlsym(m.lib, "nvmlDeviceGetHandleByPciBusId_v2"));
    m.p2p_status =
        reinterpret_cast<decltype(m.p2p_status)>(::dlsym(m.lib, "nvmlDeviceGetP2PStatus"));
    if (!m.init || !m.by_pci || !m.p2p_status) {
      m.error =
          "NVML lacks nvmlInit_v2, nvmlDeviceGetHandleByPciBusId_v2 or nvmlDeviceGetP2PStatus";
      return m;
    }
    if (const nvmlReturn_t r = m.init(); r != NVML_SUCCESS) {
      m.error = "nvmlInit_v2 returned " + std::to_string(r);
      m.init = nullptr;
    }
    return m;
  }();
  return n;
}

}  // namespace

std::optional<std::map<std::pair<int, int>, bool>> nvlink_matrix(const std::vector<int>& devices,
                                                                 std::string* why) {
  const Nvml& n = nvml();
  auto unknown = [&](const std::string& reason) {
    if (why) *why = reason;
    return std::optional<std::map<std::pair<int, int>, bool>>{};
  };
  if (!n.error.empty() || !n.init) return unknown(n.error.empty() ? "NVML unavailable" : n.error);
  std::vector<nvmlDevice_t> handles;
  for (int d : devices) {
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, d) != cudaSuccess) {
      (void)cudaGetLastError();
      return unknown("cudaDeviceGetPCIBusId failed for device " + std::to_string(d));
    }
    nvmlDevice_t h = nullptr;
    if (n.by_pci(bus, &h) != NVML_SUCCESS) return unknown(std::string("NVML does not know ") + bus);
    handles.push_back(h);
  }
  std::map<std::pair<int, int>, bool> out;
  for (size_t i = 0; i < devices.size(); ++i) {
    for (size_t j = 0; j < devices.size(); ++j) {
      if (i == j) {
        out[{devices[i], devices[j]}] = true;  // a device reaches itself without a link
        continue;
      }
      int status = -1;
      if (n.p2p_status(handles[i], handles[j], NVML_P2P_CAPS_INDEX_NVLINK, &status) != NVML_SUCCESS)
        return unknown("nvmlDeviceGetP2PStatus failed for devices " + std::to_string(devices[i]) +
                       " and " + std::to_string(devices[j]));
      out[{devices[i], devices[j]}] = status == NVML_P2P_STATUS_OK;
    }
  }
  return out;
}

}  // namespace fastcomms::cuda
