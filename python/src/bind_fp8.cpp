// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// FP8 on the wire (issue 38): the C++ host implementation and the CUDA kernels as plain calls
// (fp8_quantize / fp8_dequantize in tensors.cpp, which the Ulysses op's FP8 overloads run too),
// for the tests (tests/python/test_fp8*.py) and the MoE collective path. The caller allocates:
// q's dtype is the wire format, out's the output dtype; rows run over the last dimension; every
// tensor contiguous, on one device.
#include "binding.hpp"
#include "fastcomms/ulysses/fp8.hpp"
#include "fp8_rows.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {

void bind_fp8(py::module_& m) {
  m.def("_fp8_quantize", [](const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
    py::gil_scoped_release release;
    fp8_quantize("_fp8_quantize", x, q, scales);
  });
  m.def("_fp8_dequantize",
        [](const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out) {
          py::gil_scoped_release release;
          fp8_dequantize("_fp8_dequantize", q, scales, out);
        });
  m.def("_fp8_has_cuda_kernels", &has_fp8_device_kernels);
}

}  // namespace fastcomms::python
