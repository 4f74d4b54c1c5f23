// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// NOTE [nccl seam]: every NCCL call and every CUDA runtime call the nccl backend makes goes
// through NcclApi, so the backend's host logic (error mapping, the watchdog and its timeouts and
// aborts, asynchronous errors, split, group calls, finalize) runs against a fake on a machine
// with no GPU (tests/host/fake_nccl.hpp). The real implementation forwards one call to one call
// and holds no state; whatever the backend decides stays in the backend, never in an
// implementation of this interface. Windows (backends/ipc) and the cuda_collective Ulysses
// transport make their own CUDA calls and are not behind the seam.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <cstddef>
#include <memory>
#include <string>
#include <utility>

namespace fastcomms::nccl_backend {

/// NCCL and the CUDA runtime, as far as the nccl backend uses them. Each member is the C call of
/// the same name in snake case, with the same arguments and result.
///
/// Thread safety: an implementation may be called from any thread, from several at once (the
/// backend's watchdog polls while ops are issued); NCCL's group calls keep their state per thread,
/// as NCCL does. Ownership: shared by the backends and works made over it; it outlives them all.
class NcclApi {
 public:
  virtual ~NcclApi() = default;

  // ---- NCCL ----------------------------------------------------------------------------------
  virtual ncclResult_t get_version(int* version) = 0;
  virtual const char* get_error_string(ncclResult_t result) = 0;
  virtual const char* get_last_error(ncclComm_t comm) = 0;
  virtual ncclResult_t get_unique_id(ncclUniqueId* id) = 0;
  virtual ncclResult_t comm_init_rank_config(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                             int rank, ncclConfig_t* config) = 0;
  virtual ncclResult_t comm_split(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                  ncclConfig_t* config) = 0;
  virtual ncclResult_t comm_abort(ncclComm_t comm) = 0;
  virtual ncclResult_t comm_destroy(ncclComm_t comm) = 0;
  virtual ncclResult_t comm_get_async_error(ncclComm_t comm, ncclResult_t* async_error) = 0;
  virtual ncclResult_t comm_register(ncclComm_t comm, void* buff, size_t size, void** handle) = 0;
  virtual ncclResult_t comm_deregister(ncclComm_t comm, void* handle) = 0;
  virtual ncclResult_t red_op_create_pre_mul_sum(ncclRedOp_t* op, void* scalar,
                                                 ncclDataType_t datatype,
                                                 ncclScalarResidence_t residence,
                                                 ncclComm_t comm) = 0;
  virtual ncclResult_t red_op_destroy(ncclRedOp_t op, ncclComm_t comm) = 0;
  virtual ncclResult_t group_start() = 0;
  virtual ncclResult_t group_end() = 0;
  virtual ncclResult_t all_reduce(const void* sendbuff, void* recvbuff, size_t count,
                                  ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream) = 0;
  virtual ncclResult_t broadcast(const void* sendbuff, void* recvbuff, size_t count,
                                 ncclDataType_t datatype, int root, ncclComm_t comm,
                                 cudaStream_t stream) = 0;
  virtual ncclResult_t reduce(const void* sendbuff, void* recvbuff, size_t count,
                              ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                              cudaStream_t stream) = 0;
  virtual ncclResult_t all_gather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                  ncclDataType_t datatype, ncclComm_t comm,
                                  cudaStream_t stream) = 0;
  virtual ncclResult_t reduce_scatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) = 0;
  virtual ncclResult_t send(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                            ncclComm_t comm, cudaStream_t stream) = 0;
  virtual ncclResult_t recv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                            ncclComm_t comm, cudaStream_t stream) = 0;

  // ---- CUDA runtime --------------------------------------------------------------------------
  virtual const char* cuda_get_error_name(cudaError_t error) = 0;
  virtual const char* cuda_get_error_string(cudaError_t error) = 0;
  virtual cudaError_t cuda_get_last_error() = 0;
  virtual cudaError_t cuda_get_device(int* device) = 0;
  virtual cudaError_t cuda_set_device(int device) = 0;
  virtual cudaError_t cuda_device_get_stream_priority_range(int* least, int* greatest) = 0;
  virtual cudaError_t cuda_stream_create_with_priority(cudaStream_t* stream, unsigned int flags,
                                                       int priority) = 0;
  virtual cudaError_t cuda_stream_destroy(cudaStream_t stream) = 0;
  virtual cudaError_t cuda_stream_synchronize(cudaStream_t stream) = 0;
  virtual cudaError_t cuda_stream_wait_event(cudaStream_t stream, cudaEvent_t event,
                                             unsigned int flags) = 0;
  virtual cudaError_t cuda_stream_is_capturing(cudaStream_t stream,
                                               cudaStreamCaptureStatus* status) = 0;
  virtual cudaError_t cuda_thread_exchange_stream_capture_mode(cudaStreamCaptureMode* mode) = 0;
  virtual cudaError_t cuda_event_create_with_flags(cudaEvent_t* event, unsigned int flags) = 0;
  virtual cudaError_t cuda_event_destroy(cudaEvent_t event) = 0;
  virtual cudaError_t cuda_event_record(cudaEvent_t event, cudaStream_t stream) = 0;
  virtual cudaError_t cuda_event_query(cudaEvent_t event) = 0;
  virtual cudaError_t cuda_malloc(void** ptr, size_t size) = 0;
  virtual cudaError_t cuda_free(void* ptr) = 0;
  virtual cudaError_t cuda_memset_async(void* ptr, int value, size_t count,
                                        cudaStream_t stream) = 0;
  virtual cudaError_t cuda_memcpy_async(void* dst, const void* src, size_t count,
                                        cudaMemcpyKind kind, cudaStream_t stream) = 0;
  virtual cudaError_t cuda_host_alloc(void** ptr, size_t size, unsigned int flags) = 0;
  virtual cudaError_t cuda_free_host(void* ptr) = 0;
};

/// The real NCCL and CUDA runtime (one process-wide instance; it holds no state).
std::shared_ptr<NcclApi> real_nccl_api();

}  // namespace fastcomms::nccl_backend
