// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/tensor.hpp"

#include <sstream>

#include "fastcomms/core/reduce_op.hpp"
#include "fastcomms/core/work.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

size_t dtype_size(DType dt) noexcept {
  switch (dt) {
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
    case DType::kInt8:
    case DType::kUInt8:
    case DType::kBool:
      return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dt) noexcept {
  switch (dt) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kFloat8E4M3FN:
      return "float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "float8_e5m2";
    case DType::kInt8:
      return "int8";
    case DType::kUInt8:
      return "uint8";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kBool:
      return "bool";
  }
  return "unknown";
}

bool dtype_is_integral(DType dt) noexcept {
  return dt == DType::kInt8 || dt == DType::kUInt8 || dt == DType::kInt32 || dt == DType::kInt64 ||
         dt == DType::kBool;
}

DType dtype_from_name(std::string_view name) {
  for (int i = 0; i <= static_cast<int>(DType::kBool); ++i) {
    if (dtype_name(static_cast<DType>(i)) == name) return static_cast<DType>(i);
  }
  if (name == "bf16") return DType::kBFloat16;
  if (name == "fp16" || name == "half") return DType::kFloat16;
  if (name == "fp32" || name == "float") return DType::kFloat32;
  if (name == "fp64" || name == "double") return DType::kFloat64;
  throw Error(ErrorCode::kInvalidArgument, detail::cat("unknown dtype '", name, "'"));
}

std::string Device::str() const {
  return type == DeviceType::kCPU ? std::string("cpu") : detail::cat("cuda:", index);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::vector<int64_t> shape,
                                  Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = std::move(shape);
  v.strides.assign(v.shape.size(), 1);
  for (int i = static_cast<int>(v.shape.size()) - 2; i >= 0; --i)
    v.strides[i] = v.strides[i + 1] * std::max<int64_t>(v.shape[i + 1], 1);
  v.device = device;
  return v;
}

int64_t TensorView::numel() const noexcept {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

bool TensorView::is_contiguous() const noexcept {
  if (strides.size() != shape.size()) return false;
  int64_t expected = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    if (shape[i] == 1) continue;  // any stride is fine for a size-1 dimension
    if (shape[i] == 0) return true;
    if (strides[i] != expected) return false;
    expected *= shape[i];
  }
  return true;
}

std::string TensorView::describe() const {
  std::ostringstream os;
  os << dtype_name(dtype) << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "] " << device.str();
  return os.str();
}

std::string_view red_op_name(RedOpType t) noexcept {
  switch (t) {
    case RedOpType::kSum:
      return "SUM";
    case RedOpType::kProduct:
      return "PRODUCT";
    case RedOpType::kMin:
      return "MIN";
    case RedOpType::kMax:
      return "MAX";
    case RedOpType::kBand:
      return "BAND";
    case RedOpType::kBor:
      return "BOR";
    case RedOpType::kBxor:
      return "BXOR";
    case RedOpType::kAvg:
      return "AVG";
    case RedOpType::kPremulSum:
      return "PREMUL_SUM";
  }
  return "UNKNOWN";
}

const char* work_status_name(WorkStatus s) noexcept {
  switch (s) {
    case WorkStatus::kNotStarted:
      return "NOT_STARTED";
    case WorkStatus::kInProgress:
      return "INPROGRESS";
    case WorkStatus::kCompleted:
      return "COMPLETED";
    case WorkStatus::kTimedOut:
      return "TIMEDOUT";
    case WorkStatus::kError:
      return "ERROR";
  }
  return "UNKNOWN";
}

}  // namespace fastcomms
