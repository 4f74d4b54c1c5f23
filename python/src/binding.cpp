// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The extension module fastcomms._C: one line per component (NOTE [one extension] in
// binding.hpp), and what the build was made against.
#include <pybind11/pybind11.h>
#include <torch/version.h>

#include "binding.hpp"

namespace py = pybind11;
namespace fp = fastcomms::python;

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcomms C++ core (internal; use the fastcomms package)";
  m.attr("__version__") = FASTCOMMS_VERSION;  // the VERSION file, through CMake
  m.def("build_info", [] {
    py::dict d;
    d["version"] = FASTCOMMS_VERSION;
    d["torch"] = TORCH_VERSION;  // torch/version.h of the torch built against
    d["cuda"] = FASTCOMMS_BUILD_CUDA;
    d["cuda_archs"] = FASTCOMMS_BUILD_CUDA_ARCHS;
    d["nccl"] = FASTCOMMS_BUILD_NCCL;
    return d;
  });
  fp::bind_errors(m);  // first: every other component raises these
  fp::bind_store(m);
  fp::bind_comm(m);  // before the components that add methods to Comm
  fp::bind_pybackend(m);
  fp::bind_hooks(m);
  fp::bind_nan_check(m);
  fp::bind_window(m);
  fp::bind_ulysses(m);
  fp::bind_ulysses_op(m);
  fp::bind_fp8(m);
  fp::bind_compiled(m);
  fp::bind_c10d(m);
  fp::bind_device_window(m);
  fp::bind_device_a2a(m);
}
