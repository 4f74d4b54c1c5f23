// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Hooks on a communicator from Python (NOTE [one hook registry] in fastcomms/_comm.py): pre and
// post hooks see the op's name, id and async flag; abort hooks run before an abort; a Python
// backend draws its op ids from the same counter (NOTE [op ids]). Each registration returns its
// remover.
#include <pybind11/functional.h>

#include <memory>
#include <string>

#include "binding.hpp"
#include "py_common.hpp"

namespace py = pybind11;

namespace fastcomms::python {

void bind_hooks(py::module_& m) {
  reopen<PyComm>(m, "Comm")
      .def("register_pre_hook",
           [](PyComm& c, py::function fn) {
             auto h =
                 std::make_shared<RemovableHandle>(c.comm->register_pre_hook([fn](const OpInfo& i) {
                   py::gil_scoped_acquire gil;
                   fn(std::string(op_name(i.op)), i.op_id, i.async_op);
                 }));
             return py::cpp_function([h] { h->remove(); });
           })
      .def("register_post_hook",
           [](PyComm& c, py::function fn) {
             auto h = std::make_shared<RemovableHandle>(
                 c.comm->register_post_hook([fn](const OpInfo& i) {
                   py::gil_scoped_acquire gil;
                   fn(std::string(op_name(i.op)), i.op_id, i.async_op);
                 }));
             return py::cpp_function([h] { h->remove(); });
           })
      .def_static("next_op_id", &next_op_id)  // NOTE [op ids]: Python backends draw from it
      .def("register_abort_hook", [](PyComm& c, py::function fn) {
        auto h = std::make_shared<RemovableHandle>(c.comm->register_abort_hook([fn] {
          py::gil_scoped_acquire gil;
          fn();
        }));
        return py::cpp_function([h] { h->remove(); });
      });
}

}  // namespace fastcomms::python
