// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// Driver entry points through the runtime (cudaGetDriverEntryPointByVersion), so nothing in the
// library links libcuda and a build with CUDA still loads on a machine without a driver.

#include <cuda_runtime_api.h>

#include <string>

namespace fastcomms::cuda::detail {

/// Loads driver function `name` (the CUDA 12.0 ABI of it) into `fn`. On failure `fn` stays null
/// and `missing` names the first entry point that was not found.
template <class Fn>
void load_driver_entry(const char* name, Fn& fn, std::string& missing) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult status = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess || p == nullptr) {
    (void)cudaGetLastError();
    if (missing.empty()) missing = name;
    return;
  }
  fn = reinterpret_cast<Fn>(p);
}

}  // namespace fastcomms::cuda::detail
