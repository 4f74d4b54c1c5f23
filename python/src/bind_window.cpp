// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Windows from Python (fastcomms.TorchCommWindow over fastcomms._C.Window): ops enqueue on the
// caller's current torch stream; a remote tensor keeps its window alive.
#include <pybind11/stl.h>

#include <memory>
#include <vector>

#include "binding.hpp"
#include "fastcomms/core/window.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {

void bind_window(py::module_& m) {
  py::class_<PyWindow>(m, "Window")
      .def("register_buffer",
           [](PyWindow& w, at::Tensor t) {
             void* p = t.data_ptr();
             const int64_t bytes = t.numel() * t.element_size();
             py::gil_scoped_release release;
             w.w->register_buffer(p, bytes);
           })
      .def("deregister",
           [](PyWindow& w) {
             py::gil_scoped_release release;
             w.w->deregister();
           })
      .def("bytes", [](const PyWindow& w) { return w.w->bytes(); })
      .def("put",
           [](PyWindow& w, at::Tensor src, int dst, int64_t offset_bytes) {
             w.w->put(src.data_ptr(), src.numel() * src.element_size(), dst, offset_bytes,
                      current_stream(w.device));
           })
      .def("signal", [](PyWindow& w, int peer) { w.w->signal(peer, current_stream(w.device)); })
      .def("wait_signal",
           [](PyWindow& w, int peer, int64_t timeout_ms) {
             w.w->wait_signal(peer, std::chrono::milliseconds(timeout_ms),
                              current_stream(w.device));
           })
      .def("check_errors", [](PyWindow& w) { w.w->check_errors(); })
      .def("remote", [](PyWindow& w, int q, std::vector<int64_t> shape, at::Tensor like) {
        void* p = w.w->remote(q);
        auto keep = w.w;
        return torch::from_blob(
            p, shape, [keep](void*) {},
            at::TensorOptions().dtype(like.scalar_type()).device(like.device()));
      });

  reopen<PyComm>(m, "Comm").def("new_window", [](PyComm& c) {
    std::shared_ptr<Window> w;
    {
      py::gil_scoped_release release;
      w = c.comm->new_window();
    }
    return PyWindow{std::move(w), c.comm->device()};
  });
}

}  // namespace fastcomms::python
