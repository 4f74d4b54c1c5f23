// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [nccl seam]: the real NcclApi, one call to one call; no logic lives here.
#include "backends/nccl/nccl_api.hpp"

namespace fastcomms::nccl_backend {
namespace {

class RealNcclApi final : public NcclApi {
 public:
  ncclResult_t get_version(int* version) override { return ncclGetVersion(version); }
  const char* get_error_string(ncclResult_t result) override { return ncclGetErrorString(result); }
  const char* get_last_error(ncclComm_t comm) override { return ncclGetLastError(comm); }
  ncclResult_t get_unique_id(ncclUniqueId* id) override { return ncclGetUniqueId(id); }
  ncclResult_t comm_init_rank_config(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                     ncclConfig_t* config) override {
    return ncclCommInitRankConfig(comm, nranks, id, rank, config);
  }
  ncclResult_t comm_split(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                          ncclConfig_t* config) override {
    return ncclCommSplit(comm, color, key, newcomm, config);
  }
  ncclResult_t comm_abort(ncclComm_t comm) override { return ncclCommAbort(comm); }
  ncclResult_t comm_destroy(ncclComm_t comm) override { return ncclCommDestroy(comm); }
  ncclResult_t comm_get_async_error(ncclComm_t comm, ncclResult_t* async_error) override {
    return ncclCommGetAsyncError(comm, async_error);
  }
  ncclResult_t comm_register(ncclComm_t comm, void* buff, size_t size, void** handle) override {
    return ncclCommRegister(comm, buff, size, handle);
  }
  ncclResult_t comm_deregister(ncclComm_t comm, void* handle) override {
    return ncclCommDeregister(comm, handle);
  }
  ncclResult_t red_op_create_pre_mul_sum(ncclRedOp_t* op, void* scalar, ncclDataType_t datatype,
                                         ncclScalarResidence_t residence,
                                         ncclComm_t comm) override {
    return ncclRedOpCreatePreMulSum(op, scalar, datatype, residence, comm);
  }
  ncclResult_t red_op_destroy(ncclRedOp_t op, ncclComm_t comm) override {
    return ncclRedOpDestroy(op, comm);
  }
  ncclResult_t group_start() override { return ncclGroupStart(); }
  ncclResult_t group_end() override { return ncclGroupEnd(); }
  ncclResult_t all_reduce(const void* sendbuff, void* recvbuff, size_t count,
                          ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                          cudaStream_t stream) override {
    return ncclAllReduce(sendbuff, recvbuff, count, datatype, op, comm, stream);
  }
  ncclResult_t broadcast(const void* sendbuff, void* recvbuff, size_t count,
                         ncclDataType_t datatype, int root, ncclComm_t comm,
                         cudaStream_t stream) override {
    return ncclBroadcast(sendbuff, recvbuff, count, datatype, root, comm, stream);
  }
  ncclResult_t reduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                      ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) override {
    return ncclReduce(sendbuff, recvbuff, count, datatype, op, root, comm, stream);
  }
  ncclResult_t all_gather(const void* sendbuff, void* recvbuff, size_t sendcount,
                          ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) override {
    return ncclAllGather(sendbuff, recvbuff, sendcount, datatype, comm, stream);
  }
  ncclResult_t reduce_scatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                              ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                              cudaStream_t stream) override {
    return ncclReduceScatter(sendbuff, recvbuff, recvcount, datatype, op, comm, stream);
  }
  ncclResult_t send(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                    ncclComm_t comm, cudaStream_t stream) override {
    return ncclSend(sendbuff, count, datatype, peer, comm, stream);
  }
  ncclResult_t recv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                    ncclComm_t comm, cudaStream_t stream) override {
    return ncclRecv(recvbuff, count, datatype, peer, comm, stream);
  }

  const char* cuda_get_error_name(cudaError_t error) override { return cudaGetErrorName(error); }
  const char* cuda_get_error_string(cudaError_t error) override {
    return cudaGetErrorString(error);
  }
  cudaError_t cuda_get_last_error() override { return cudaGetLastError(); }
  cudaError_t cuda_get_device(int* device) override { return cudaGetDevice(device); }
  cudaError_t cuda_set_device(int device) override { return cudaSetDevice(device); }
  cudaError_t cuda_device_get_stream_priority_range(int* least, int* greatest) override {
    return cudaDeviceGetStreamPriorityRange(least, greatest);
  }
  cudaError_t cuda_stream_create_with_priority(cudaStream_t* stream, unsigned int flags,
                                               int priority) override {
    return cudaStreamCreateWithPriority(stream, flags, priority);
  }
  cudaError_t cuda_stream_destroy(cudaStream_t stream) override {
    return cudaStreamDestroy(stream);
  }
  cudaError_t cuda_stream_synchronize(cudaStream_t stream) override {
    return cudaStreamSynchronize(stream);
  }
  cudaError_t cuda_stream_wait_event(cudaStream_t stream, cudaEvent_t event,
                                     unsigned int flags) override {
    return cudaStreamWaitEvent(stream, event, flags);
  }
  cudaError_t cuda_stream_is_capturing(cudaStream_t stream,
                                       cudaStreamCaptureStatus* status) override {
    return cudaStreamIsCapturing(stream, status);
  }
  cudaError_t cuda_thread_exchange_stream_capture_mode(cudaStreamCaptureMode* mode) override {
    return cudaThreadExchangeStreamCaptureMode(mode);
  }
  cudaError_t cuda_event_create_with_flags(cudaEvent_t* event, unsigned int flags) override {
    return cudaEventCreateWithFlags(event, flags);
  }
  cudaError_t cuda_event_destroy(cudaEvent_t event) override { return cudaEventDestroy(event); }
  cudaError_t cuda_event_record(cudaEvent_t event, cudaStream_t stream) override {
    return cudaEventRecord(event, stream);
  }
  cudaError_t cuda_event_query(cudaEvent_t event) override { return cudaEventQuery(event); }
  cudaError_t cuda_malloc(void** ptr, size_t size) override { return cudaMalloc(ptr, size); }
  cudaError_t cuda_free(void* ptr) override { return cudaFree(ptr); }
  cudaError_t cuda_memset_async(void* ptr, int value, size_t count, cudaStream_t stream) override {
    return cudaMemsetAsync(ptr, value, count, stream);
  }
  cudaError_t cuda_memcpy_async(void* dst, const void* src, size_t count, cudaMemcpyKind kind,
                                cudaStream_t stream) override {
    return cudaMemcpyAsync(dst, src, count, kind, stream);
  }
  cudaError_t cuda_host_alloc(void** ptr, size_t size, unsigned int flags) override {
    return cudaHostAlloc(ptr, size, flags);
  }
  cudaError_t cuda_free_host(void* ptr) override { return cudaFreeHost(ptr); }
};

}  // namespace

std::shared_ptr<NcclApi> real_nccl_api() {
  static const std::shared_ptr<NcclApi> api = std::make_shared<RealNcclApi>();
  return api;
}

}  // namespace fastcomms::nccl_backend
