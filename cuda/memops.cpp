// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [memop barrier] (fastcomms/cuda/memops.hpp). The driver call comes through the entry point
// the runtime hands out, so nothing links libcuda.
#include "fastcomms/cuda/memops.hpp"

#include <cuda.h>

#include <algorithm>

#include "detail/driver_entry.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::cuda {
namespace {

struct Driver {
  decltype(&::cuStreamBatchMemOp) batch = nullptr;
  decltype(&::cuDeviceGet) device_get = nullptr;
  decltype(&::cuDeviceGetAttribute) attribute = nullptr;
  std::string missing;
};

const Driver& driver() {
  static const Driver d = [] {
    Driver v;
    auto load = [&v](const char* name, auto& fn) {
      detail::load_driver_entry(name, fn, v.missing);
    };
    load("cuStreamBatchMemOp", v.batch);
    load("cuDeviceGet", v.device_get);
    load("cuDeviceGetAttribute", v.attribute);
    return v;
  }();
  return d;
}

// The driver's per-batch limit is not queryable; 256 operations is what it documents.
constexpr size_t kBatch = 256;

}  // namespace

bool memops_supported(int device, std::string* why) {
  const Driver& d = driver();
  if (!d.missing.empty()) {
    if (why) *why = "the CUDA driver has no entry point " + d.missing;
    return false;
  }
  DeviceGuard guard(device);
  if (cudaFree(nullptr) != cudaSuccess) {  // the primary context is current from here
    (void)cudaGetLastError();
    if (why) *why = "no CUDA context on this device";
    return false;
  }
  CUdevice dev = 0;
  int can = 0;
  if (d.device_get(&dev, device) != CUDA_SUCCESS ||
      d.attribute(&can, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev) != CUDA_SUCCESS ||
      can == 0) {
    if (why) *why = "the device does not run 64-bit stream memory operations";
    return false;
  }
  return true;
}

bool memops_can_flush(int device) {
  const Driver& d = driver();
  if (!d.missing.empty()) return false;
  CUdevice dev = 0;
  int can = 0;
  return d.device_get(&dev, device) == CUDA_SUCCESS &&
         d.attribute(&can, CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, dev) == CUDA_SUCCESS &&
         can != 0;
}

void memops_async(const std::vector<MemOp>& ops, cudaStream_t stream) {
  const Driver& d = driver();
  FASTCOMMS_CHECK(d.missing.empty(), kCudaError, "the CUDA driver has no entry point ", d.missing);
  std::vector<CUstreamBatchMemOpParams> params;
  params.reserve(std::min(ops.size(), kBatch));
  for (size_t i = 0; i < ops.size(); i += kBatch) {
    params.clear();
    for (size_t j = i; j < std::min(ops.size(), i + kBatch); ++j) {
      CUstreamBatchMemOpParams p{};
      if (ops[j].kind == MemOp::kWrite) {
        p.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
        p.writeValue.address = reinterpret_cast<CUdeviceptr>(ops[j].address);
        p.writeValue.value64 = ops[j].value;
        p.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;  // fenced (NOTE [memop barrier])
      } else {
        p.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
        p.waitValue.address = reinterpret_cast<CUdeviceptr>(ops[j].address);
        p.waitValue.value64 = ops[j].value;
        p.waitValue.flags = CU_STREAM_WAIT_VALUE_EQ |
                            (ops[j].kind == MemOp::kWaitEqFlush ? CU_STREAM_WAIT_VALUE_FLUSH : 0);
      }
      params.push_back(p);
    }
    const CUresult r = d.batch(reinterpret_cast<CUstream>(stream),
                               static_cast<unsigned>(params.size()), params.data(), 0);
    FASTCOMMS_CHECK(r == CUDA_SUCCESS, kCudaError, "cuStreamBatchMemOp failed with CUresult ",
                    static_cast<int>(r));
  }
}

void memop_barrier_async(const std::vector<uint64_t*>& remote, const std::vector<uint64_t*>& local,
                         int rank, uint64_t token, bool flush, cudaStream_t stream) {
  const int size = static_cast<int>(remote.size());
  std::vector<MemOp> ops;
  ops.reserve(3 * static_cast<size_t>(size));
  for (int k = 1; k < size; ++k) {  // rotated, as the kernel barrier
    const int q = (rank + k) % size;
    ops.push_back({MemOp::kWrite, remote[q], token});
  }
  const MemOp::Kind wait = flush ? MemOp::kWaitEqFlush : MemOp::kWaitEq;
  for (int k = 1; k < size; ++k) ops.push_back({wait, local[(rank + k) % size], token});
  for (int k = 1; k < size; ++k) ops.push_back({MemOp::kWrite, local[(rank + k) % size], 0});
  memops_async(ops, stream);
}

}  // namespace fastcomms::cuda
