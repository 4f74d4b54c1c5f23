// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The NVLink probe. NVML is opened with dlopen, so the library loads on a machine without it;
/// when NVML cannot answer, the answer is "unknown", never "yes".

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace fastcomms::cuda {

/// NVML's answer for each ordered pair of the given CUDA devices: true when the two are joined by
/// NVLink. std::nullopt when NVML is missing or cannot answer for some pair; `why` (if given)
/// then says what failed.
std::optional<std::map<std::pair<int, int>, bool>> nvlink_matrix(const std::vector<int>& devices,
                                                                 std::string* why = nullptr);

}  // namespace fastcomms::cuda
