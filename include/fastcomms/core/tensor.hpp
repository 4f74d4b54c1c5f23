// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Data types and the non-owning tensor view that crosses the C++ core (no torch here).

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fastcomms {

/// Element types the library moves. Reductions support the numeric ones (see ReduceOp).
enum class DType : int8_t {
  kFloat16 = 0,
  kBFloat16,
  kFloat32,
  kFloat64,
  kFloat8E4M3FN,
  kFloat8E5M2,
  kInt8,
  kUInt8,
  kInt32,
  kInt64,
  kBool,
};

/// Bytes per element of `dt`.
size_t dtype_size(DType dt) noexcept;
/// torch's name for `dt` ("float16", "bfloat16", ...).
std::string_view dtype_name(DType dt) noexcept;
/// True for the integer and bool types (the bitwise reductions accept only these).
bool dtype_is_integral(DType dt) noexcept;
/// Parses torch's name (also "bf16", "fp16", "fp32", "fp64"); throws kInvalidArgument.
DType dtype_from_name(std::string_view name);

/// Where a tensor lives.
enum class DeviceType : int8_t { kCPU = 0, kCUDA = 1 };

/// A device: its type and index (-1 for the CPU).
struct Device {
  DeviceType type = DeviceType::kCPU;  ///< CPU or CUDA.
  int index = -1;                      ///< CUDA ordinal; -1 on the CPU.
  bool operator==(const Device&) const = default;
  /// "cpu" or "cuda:N".
  std::string str() const;
};

/// A non-owning view of a strided tensor: what the binding layer hands the core.
struct TensorView {
  void* data = nullptr;           ///< First element (already offset by the storage offset).
  DType dtype = DType::kFloat32;  ///< Element type.
  std::vector<int64_t> shape;     ///< Sizes per dimension.
  std::vector<int64_t> strides;   ///< Strides per dimension, in elements.
  Device device;                  ///< Where the memory lives.

  /// A contiguous view over `data` with the given shape.
  static TensorView contiguous(void* data, DType dtype, std::vector<int64_t> shape,
                               Device device = {});
  /// Number of elements.
  int64_t numel() const noexcept;
  /// Bytes covered by the elements (numel * element size).
  int64_t nbytes() const noexcept { return numel() * static_cast<int64_t>(dtype_size(dtype)); }
  /// Bytes per element.
  size_t element_size() const noexcept { return dtype_size(dtype); }
  /// True when the elements are densely packed in row-major order.
  bool is_contiguous() const noexcept;
  /// Size of dimension 0 (1 for a 0-d tensor).
  int64_t rows() const noexcept { return shape.empty() ? 1 : shape[0]; }
  /// Bytes of one dimension-0 row of a contiguous tensor (0 when it has no rows).
  int64_t row_bytes() const noexcept { return rows() > 0 ? nbytes() / rows() : 0; }
  /// "float32[4, 8] cpu" style description for messages.
  std::string describe() const;
};

}  // namespace fastcomms
