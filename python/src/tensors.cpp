// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Tensors for fastcomms._C's components (tensors.hpp): views of torch tensors, the caller's torch
// stream, and the Work Python holds. Every tensor an op uses stays referenced until the op is
// complete (NOTE [python tensors outlive their op]).
#include "tensors.hpp"

#include <string>

#include "fastcomms/ulysses/fp8.hpp"
#include "fp8_rows.hpp"

#ifdef FASTCOMMS_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

namespace fastcomms::python {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat:
      return DType::kFloat32;
    case at::kDouble:
      return DType::kFloat64;
    case at::kFloat8_e4m3fn:
      return DType::kFloat8E4M3FN;
    case at::kFloat8_e5m2:
      return DType::kFloat8E5M2;
    case at::kChar:
      return DType::kInt8;
    case at::kByte:
      return DType::kUInt8;
    case at::kInt:
      return DType::kInt32;
    case at::kLong:
      return DType::kInt64;
    case at::kBool:
      return DType::kBool;
    default:
      throw Error(ErrorCode::kTypeError,
                  std::string("fastcomms: a tensor of dtype ") + c10::toString(t) +
                      " cannot be communicated; expected one of float16, bfloat16, float32, "
                      "float64, float8_e4m3fn, float8_e5m2, int8, uint8, int32, int64, bool "
                      "(a complex tensor can travel as torch.view_as_real(t))");
  }
}

TensorView view(const at::Tensor& t) {
  // A meta, sparse or other non-memory tensor has no bytes to move: refuse it here, once, before
  // any pointer is read (data_ptr() of a meta tensor is null).
  FASTCOMMS_CHECK(t.layout() == at::kStrided, kInvalidArgument,
                  "fastcomms: tensors must be dense (strided layout), got a tensor of layout ",
                  c10::toString(t.layout()), " with shape ", t.sizes());
  FASTCOMMS_CHECK(t.is_cpu() || t.is_cuda(), kInvalidArgument,
                  "fastcomms: tensors must live on cpu or cuda, got a ", t.device().str(),
                  " tensor of shape ", t.sizes(),
                  t.is_meta() ? " (meta tensors carry no data; use a FakeTensor mode or "
                                "torch.compile to trace shapes)"
                              : "");
  TensorView v;
  // An empty tensor's data_ptr() is null; its storage still says where it lives (an empty
  // empty_output() buffer must still be recognised as the window it is).
  v.data = t.numel() == 0 && t.has_storage() && t.storage().data() != nullptr
               ? static_cast<char*>(const_cast<void*>(t.storage().data())) +
                     t.storage_offset() * static_cast<int64_t>(t.itemsize())
               : t.data_ptr();
  v.dtype = to_dtype(t.scalar_type());
  v.shape.assign(t.sizes().begin(), t.sizes().end());
  v.strides.assign(t.strides().begin(), t.strides().end());
  v.device = t.is_cuda() ? Device{DeviceType::kCUDA, t.device().index()} : Device{};
  return v;
}

at::ScalarType to_scalar_type(DType d) {
  switch (d) {
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat64:
      return at::kDouble;
    case DType::kFloat8E4M3FN:
      return at::kFloat8_e4m3fn;
    case DType::kFloat8E5M2:
      return at::kFloat8_e5m2;
    case DType::kInt8:
      return at::kChar;
    case DType::kUInt8:
      return at::kByte;
    case DType::kInt32:
      return at::kInt;
    case DType::kInt64:
      return at::kLong;
    case DType::kBool:
      return at::kBool;
  }
  throw Error(ErrorCode::kInternal, "fastcomms: a dtype without a torch counterpart");
}

std::vector<TensorView> views(const std::vector<at::Tensor>& ts) {
  std::vector<TensorView> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(view(t));
  return out;
}

#ifdef FASTCOMMS_WITH_CUDA
// NOTE [torch streams through c10]: the binding reaches torch's CUDA streams and events through
// c10's device-generic interface (the implementation libtorch_cuda registers for DeviceType::CUDA:
// c10::Stream, c10::Event, c10::DeviceGuard), so it includes no CUDA layer, neither ours nor
// torch's c10/cuda; its CUDA runtime calls are cudaGetDeviceCount and cudaStreamIsCapturing. A
// CUDA tensor exists only where torch registered its real CUDA implementation.
bool torch_has_cuda() { return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA); }

// The caller's current torch stream on CUDA device `d`.
c10::Stream torch_current_stream(c10::DeviceIndex d) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
      ->getStream(c10::Device(c10::DeviceType::CUDA, d));
}

c10::Stream torch_stream(const py::handle& s) {
  return c10::Stream::unpack3(s.attr("stream_id").cast<int64_t>(),
                              static_cast<c10::DeviceIndex>(s.attr("device_index").cast<int64_t>()),
                              static_cast<c10::DeviceType>(s.attr("device_type").cast<int64_t>()));
}
#endif

void* current_stream(const Device& d) {
#ifdef FASTCOMMS_WITH_CUDA
  if (d.type == DeviceType::kCUDA)
    return torch_current_stream(static_cast<c10::DeviceIndex>(d.index)).native_handle();
#endif
  (void)d;
  return nullptr;
}

namespace {

// NOTE [python tensors outlive their op]: an op's tensors stay referenced until the op is
// complete, whatever Python drops. They are released on a Python thread only: a tensor whose
// Python object died while C++ still held it is released through the interpreter (with the GIL),
// which a backend's worker thread must never need (a communicator's destructor joins that thread
// with the GIL held). So a dropped, unfinished PyWork parks its tensors here, and calls from
// Python release the finished ones. Internal buffers ride on the C++ Work instead (NOTE [work
// keeps its buffers]). Never destroyed: nothing is released after the interpreter is gone.
struct Parked {
  WorkPtr work;
  std::vector<at::Tensor> keep;
};
std::vector<Parked>& parked() {
  static auto* v = new std::vector<Parked>;  // guarded by the GIL
  return *v;
}

}  // namespace

bool stream_capturing() {
#ifdef FASTCOMMS_WITH_CUDA
  // Querying an event while a stream of this thread captures a CUDA graph would invalidate it.
  // The devices are counted by the CUDA runtime, not through c10: where no GPU is present torch
  // may install a fake CUDA guard (c10::impl::ensureCUDADeviceGuardSet, seen under
  // torch.compile on CPU) that counts devices but has no streams ("Backend doesn't support
  // getting stream native handle" from every op once a work was parked).
  static const int n = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return count;
  }();
  if (n == 0 || !torch_has_cuda()) return false;
  for (c10::DeviceIndex d = 0; d < n; ++d) {
    cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
    auto stream = static_cast<cudaStream_t>(torch_current_stream(d).native_handle());
    if (cudaStreamIsCapturing(stream, &s) == cudaSuccess && s != cudaStreamCaptureStatusNone)
      return true;
  }
#endif
  return false;
}

// Releases the tensors of parked ops that have finished (GIL held).
void release_finished() {
  auto& v = parked();
  if (v.empty() || stream_capturing()) return;
  std::erase_if(v, [](const Parked& p) { return p.work->tensors_released(); });
}

// No status query here: this may run while a stream captures a CUDA graph, where querying an
// event would invalidate the capture; release_finished() checks later, outside captures.
PyWork::~PyWork() {
  if (work && !keep.empty()) parked().push_back({std::move(work), std::move(keep)});
}

void PyWork::wait_nogil() {
  try {
    work->wait();
  } catch (const Error& e) {
    if (abort_on_error && ProcessAbort::applies(e.code())) abort_on_error->abort_process(e.what());
    throw;
  }
  work->waited();  // NOTE [wait observers]
}

void PyWork::wait() {
  py::gil_scoped_release release;  // also lets the abort hooks take the GIL
  wait_nogil();
}

PyWork transport_call(UlyssesTransport& tr, const at::Tensor& x, const at::Tensor& out,
                      const UlyssesArgs& args, std::optional<void*> stream) {
  const TensorView xv = view(x), ov = view(out);
  const auto on = stream ? *stream : current_stream(xv.device);
  WorkPtr w;
  {
    py::gil_scoped_release release;
    w = tr.all_to_all_4d(xv, ov, args, on);
  }
  release_finished();
  return PyWork(std::move(w), {x, out});
}

// -- FP8 rows (bind_fp8.cpp's test entry points and the Ulysses op's FP8 overloads) ------------
namespace {
void fp8_check(const char* what, const at::Tensor& wide, const at::Tensor& q,
               const at::Tensor& scales) {
  FASTCOMMS_CHECK(wide.dim() >= 1, kInvalidArgument, what,
                  ": tensors need at least one dimension, got a 0-d tensor");
  FASTCOMMS_CHECK(q.sizes() == wide.sizes(), kInvalidArgument, what, ": q has shape ", q.sizes(),
                  ", expected ", wide.sizes());
  FASTCOMMS_CHECK(scales.sizes() == wide.sizes().slice(0, wide.dim() - 1), kInvalidArgument, what,
                  ": scales has shape ", scales.sizes(), ", expected ",
                  wide.sizes().slice(0, wide.dim() - 1));
  FASTCOMMS_CHECK(scales.scalar_type() == at::kFloat, kTypeError, what,
                  ": scales must be float32, got ", c10::toString(scales.scalar_type()));
  FASTCOMMS_CHECK(wide.device() == q.device() && wide.device() == scales.device(), kInvalidArgument,
                  what, ": tensors on ", wide.device().str(), ", ", q.device().str(), " and ",
                  scales.device().str(), ", expected one device");
  FASTCOMMS_CHECK(wide.is_contiguous() && q.is_contiguous() && scales.is_contiguous(),
                  kInvalidArgument, what, ": tensors must be contiguous");
  FASTCOMMS_CHECK(wide.is_cpu() || wide.is_cuda(), kInvalidArgument, what,
                  ": tensors must live on cpu or cuda, got ", wide.device().str());
}
}  // namespace

void fp8_quantize(const char* what, const at::Tensor& x, const at::Tensor& q,
                  const at::Tensor& scales) {
  fp8_check(what, x, q, scales);
  const DType in = to_dtype(x.scalar_type()), wire = to_dtype(q.scalar_type());
  const int64_t rows = scales.numel(), d = x.size(-1);
  if (x.is_cpu()) {
    fp8_quantize_rows(x.data_ptr(), in, rows, d, q.data_ptr(), wire, scales.data_ptr<float>());
    return;
  }
#ifdef FASTCOMMS_WITH_CUDA
  c10::DeviceGuard guard(x.device());
  fp8_quantize_rows_device(x.data_ptr(), in, rows, d, q.data_ptr(), wire, scales.data_ptr<float>(),
                           current_stream(Device{DeviceType::kCUDA, x.device().index()}));
#else
  throw Error(ErrorCode::kUnsupported, detail::cat(what, ": this build has no CUDA"));
#endif
}

void fp8_dequantize(const char* what, const at::Tensor& q, const at::Tensor& scales,
                    const at::Tensor& out) {
  fp8_check(what, out, q, scales);
  const DType wire = to_dtype(q.scalar_type()), dt = to_dtype(out.scalar_type());
  const int64_t rows = scales.numel(), d = out.size(-1);
  if (out.is_cpu()) {
    fp8_dequantize_rows(q.data_ptr(), wire, scales.data_ptr<float>(), rows, d, out.data_ptr(), dt);
    return;
  }
#ifdef FASTCOMMS_WITH_CUDA
  c10::DeviceGuard guard(out.device());
  fp8_dequantize_rows_device(q.data_ptr(), wire, scales.data_ptr<float>(), rows, d, out.data_ptr(),
                             dt, current_stream(Device{DeviceType::kCUDA, out.device().index()}));
#else
  throw Error(ErrorCode::kUnsupported, detail::cat(what, ": this build has no CUDA"));
#endif
}

}  // namespace fastcomms::python
