// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// FP8 on the wire (issue 38): the C++ host implementation and the CUDA kernels, for the tests
// (tests/python/test_fp8*.py). The caller allocates: q's dtype is the wire format, out's the
// output dtype; rows run over the last dimension; every tensor contiguous, on one device. CPU
// tensors take the host implementation, CUDA tensors the kernels on the caller's current stream
// (kUnsupported in a build without CUDA).
#include "binding.hpp"
#include "fastcomms/ulysses/fp8.hpp"
#include "tensors.hpp"

#ifdef FASTCOMMS_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#endif

namespace py = pybind11;

namespace fastcomms::python {

void bind_fp8(py::module_& m) {
  auto fp8_check = [](const char* what, const at::Tensor& wide, const at::Tensor& q,
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
    FASTCOMMS_CHECK(wide.device() == q.device() && wide.device() == scales.device(),
                    kInvalidArgument, what, ": tensors on ", wide.device().str(), ", ",
                    q.device().str(), " and ", scales.device().str(), ", expected one device");
    FASTCOMMS_CHECK(wide.is_contiguous() && q.is_contiguous() && scales.is_contiguous(),
                    kInvalidArgument, what, ": tensors must be contiguous");
    FASTCOMMS_CHECK(wide.is_cpu() || wide.is_cuda(), kInvalidArgument, what,
                    ": tensors must live on cpu or cuda, got ", wide.device().str());
  };
  m.def("_fp8_quantize", [fp8_check](const at::Tensor& x, const at::Tensor& q,
                                     const at::Tensor& scales) {
    fp8_check("_fp8_quantize", x, q, scales);
    const DType in = to_dtype(x.scalar_type()), wire = to_dtype(q.scalar_type());
    const int64_t rows = scales.numel(), d = x.size(-1);
    if (x.is_cpu()) {
      py::gil_scoped_release release;
      fp8_quantize_rows(x.data_ptr(), in, rows, d, q.data_ptr(), wire, scales.data_ptr<float>());
      return;
    }
#ifdef FASTCOMMS_WITH_CUDA
    c10::DeviceGuard guard(x.device());
    fp8_quantize_rows_device(x.data_ptr(), in, rows, d, q.data_ptr(), wire,
                             scales.data_ptr<float>(),
                             current_stream(Device{DeviceType::kCUDA, x.device().index()}));
#else
    throw Error(ErrorCode::kUnsupported, "_fp8_quantize: this build has no CUDA");
#endif
  });
  m.def("_fp8_dequantize",
        [fp8_check](const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out) {
          fp8_check("_fp8_dequantize", out, q, scales);
          const DType wire = to_dtype(q.scalar_type()), dt = to_dtype(out.scalar_type());
          const int64_t rows = scales.numel(), d = out.size(-1);
          if (out.is_cpu()) {
            py::gil_scoped_release release;
            fp8_dequantize_rows(q.data_ptr(), wire, scales.data_ptr<float>(), rows, d,
                                out.data_ptr(), dt);
            return;
          }
#ifdef FASTCOMMS_WITH_CUDA
          c10::DeviceGuard guard(out.device());
          fp8_dequantize_rows_device(
              q.data_ptr(), wire, scales.data_ptr<float>(), rows, d, out.data_ptr(), dt,
              current_stream(Device{DeviceType::kCUDA, out.device().index()}));
#else
    throw Error(ErrorCode::kUnsupported, "_fp8_dequantize: this build has no CUDA");
#endif
        });
  m.def("_fp8_has_cuda_kernels", &has_fp8_device_kernels);
}

}  // namespace fastcomms::python
