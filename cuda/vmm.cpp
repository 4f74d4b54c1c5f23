// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [vmm windows] (fastcomms/cuda/vmm.hpp). Driver calls go through entry points the runtime
// hands out, so nothing links libcuda.
#include "fastcomms/cuda/vmm.hpp"

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <cstdint>

#include "detail/driver_entry.hpp"
#include "fastcomms/cuda/check.hpp"
#include "fastcomms/cuda/runtime.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::cuda {
namespace {

// The driver entry points this file calls: (driver function, Driver member).
// clang-format off
#define FASTCOMMS_VMM_DRIVER_ENTRIES(X)                                                             \
  X(cuGetErrorString, get_error_string)                                                             \
  X(cuDeviceGet, device_get)                                                                        \
  X(cuDeviceGetAttribute, device_get_attribute)                                                     \
  X(cuMemGetAllocationGranularity, granularity)                                                     \
  X(cuMemCreate, create)                                                                            \
  X(cuMemRelease, release)                                                                          \
  X(cuMemAddressReserve, reserve)                                                                   \
  X(cuMemAddressFree, address_free)                                                                 \
  X(cuMemMap, map)                                                                                  \
  X(cuMemUnmap, unmap)                                                                              \
  X(cuMemSetAccess, set_access)                                                                     \
  X(cuMemExportToShareableHandle, export_handle)                                                    \
  X(cuMemImportFromShareableHandle, import_handle)
// clang-format on

struct Driver {
#define FASTCOMMS_VMM_DRIVER_MEMBER(fn, member) decltype(&::fn) member = nullptr;
  FASTCOMMS_VMM_DRIVER_ENTRIES(FASTCOMMS_VMM_DRIVER_MEMBER)
#undef FASTCOMMS_VMM_DRIVER_MEMBER
  std::string missing;  // the first entry point not found (empty: all found)
};

const Driver& driver() {
  static const Driver d = [] {
    Driver v;
#define FASTCOMMS_VMM_DRIVER_LOAD(fn, member) detail::load_driver_entry(#fn, v.member, v.missing);
    FASTCOMMS_VMM_DRIVER_ENTRIES(FASTCOMMS_VMM_DRIVER_LOAD)
#undef FASTCOMMS_VMM_DRIVER_LOAD
    return v;
  }();
  return d;
}
#undef FASTCOMMS_VMM_DRIVER_ENTRIES

void check(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return;
  const char* s = nullptr;
  if (driver().get_error_string) driver().get_error_string(r, &s);
  throw Error(ErrorCode::kCudaError, fastcomms::detail::cat(call, " failed: ", s ? s : "error ",
                                                            s ? "" : std::to_string(r)));
}
#define FASTCOMMS_CU_CHECK(call) check((call), #call)

const Driver& checked_driver() {
  const Driver& d = driver();
  FASTCOMMS_CHECK(d.missing.empty(), kCudaError, "the CUDA driver has no entry point ", d.missing);
  return d;
}

CUmemAllocationProp properties(CUdevice dev) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = dev;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

CUdevice driver_device(int device) {
  DeviceGuard guard(device);
  FASTCOMMS_CUDA_CHECK(cudaFree(nullptr));  // the primary context is current from here
  CUdevice dev = 0;
  FASTCOMMS_CU_CHECK(checked_driver().device_get(&dev, device));
  return dev;
}

}  // namespace

std::pair<char*, size_t> allocation_of(const void* ptr, const std::string& where) {
  static const auto get_range = [] {
    decltype(&::cuMemGetAddressRange) fn = nullptr;
    std::string missing;
    detail::load_driver_entry("cuMemGetAddressRange", fn, missing);
    return fn;
  }();
  FASTCOMMS_CHECK(get_range != nullptr, kCudaError, where,
                  "the driver does not provide cuMemGetAddressRange");
  CUdeviceptr base = 0;
  size_t size = 0;
  const CUresult rc = get_range(&base, &size, reinterpret_cast<CUdeviceptr>(ptr));
  FASTCOMMS_CHECK(rc == CUDA_SUCCESS, kInvalidArgument, where, "the buffer at ", ptr,
                  " is not device memory of this process (cuMemGetAddressRange error ",
                  static_cast<int>(rc), ")");
  return {reinterpret_cast<char*>(base), size};
}

bool vmm_supported(int device, std::string* why) {
  try {
    const Driver& d = driver();
    if (!d.missing.empty()) {
      if (why) *why = "the CUDA driver has no entry point " + d.missing;
      return false;
    }
    const CUdevice dev = driver_device(device);
    int vmm = 0, fd = 0;
    FASTCOMMS_CU_CHECK(
        d.device_get_attribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
    FASTCOMMS_CU_CHECK(d.device_get_attribute(
        &fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev));
    if (!vmm || !fd) {
      if (why)
        *why = fastcomms::detail::cat(
            "cuda:", device, " lacks ",
            !vmm ? "virtual memory management" : "POSIX file-descriptor memory handles");
      return false;
    }
    return true;
  } catch (const Error& e) {
    if (why) *why = e.what();
    return false;
  }
}

VmmMapping::~VmmMapping() {
  const Driver& d = driver();
  if (ptr_ != 0 && d.unmap != nullptr) {
    (void)d.unmap(ptr_, size_);
    (void)d.address_free(ptr_, size_);
  }
  if (handle_ != 0 && d.release != nullptr) (void)d.release(handle_);
}

void VmmMapping::map(unsigned long long handle, size_t bytes, int device) {
  const Driver& d = checked_driver();
  handle_ = handle;
  size_ = bytes;
  // Reserve address space, map the handle there, grant the device read-write; a failure undoes
  // what was done (the destructor releases the handle).
  CUdeviceptr ptr = 0;
  FASTCOMMS_CU_CHECK(d.reserve(&ptr, bytes, 0, 0, 0));
  CUresult r = d.map(ptr, bytes, 0, handle, 0);
  if (r == CUDA_SUCCESS) {
    CUmemAccessDesc access{};
    access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    access.location.id = driver_device(device);
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    r = d.set_access(ptr, bytes, &access, 1);
    if (r != CUDA_SUCCESS) (void)d.unmap(ptr, bytes);
  }
  if (r != CUDA_SUCCESS) {
    (void)d.address_free(ptr, bytes);
    check(r, "cuMemMap/cuMemSetAccess");
  }
  ptr_ = ptr;
}

VmmBuffer::VmmBuffer(size_t bytes, int device) {
  const Driver& d = checked_driver();
  DeviceGuard guard(device);
  const CUmemAllocationProp prop = properties(driver_device(device));
  size_t gran = 0;
  FASTCOMMS_CU_CHECK(d.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  if (gran == 0) gran = size_t{2} << 20;
  const size_t size = (std::max<size_t>(bytes, 1) + gran - 1) / gran * gran;
  CUmemGenericAllocationHandle h = 0;
  FASTCOMMS_CU_CHECK(d.create(&h, size, &prop, 0));
  map(h, size, device);
}

int VmmBuffer::export_fd() const {
  int fd = -1;
  FASTCOMMS_CU_CHECK(
      checked_driver().export_handle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  return fd;
}

VmmImport::VmmImport(int fd, size_t bytes, int device) {
  const Driver& d = checked_driver();
  DeviceGuard guard(device);
  (void)driver_device(device);  // the primary context is current
  CUmemGenericAllocationHandle h = 0;
  FASTCOMMS_CU_CHECK(d.import_handle(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  map(h, bytes, device);
}

}  // namespace fastcomms::cuda
