// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [error mapping]: the one place C++ errors become Python exceptions: the module's exception
// translator and set_python_error (for the paths that set a Python error themselves: the c10d
// backend, compiled calls under torch's dispatcher) share one switch.
#include <c10/util/Exception.h>

#include <string>

#include "binding.hpp"
#include "py_common.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {
// The classes, made by bind_errors and kept for the process's lifetime, as the module keeps them.
PyObject* aborted_error = nullptr;
PyObject* backend_error = nullptr;
PyObject* unsupported_error = nullptr;
PyObject* invalid_argument = nullptr;
PyObject* type_error = nullptr;
PyObject* timeout_error = nullptr;
}  // namespace

void set_python_error(const Error& e) {
  switch (e.code()) {
    case ErrorCode::kInvalidArgument:
      PyErr_SetString(invalid_argument, e.what());
      return;
    case ErrorCode::kTypeError:
      PyErr_SetString(type_error, e.what());
      return;
    case ErrorCode::kTimeout:
      PyErr_SetString(timeout_error, e.what());
      return;
    case ErrorCode::kAborted:
      PyErr_SetString(aborted_error, e.what());
      return;
    case ErrorCode::kUnsupported:
      PyErr_SetString(unsupported_error, e.what());
      return;
    default:
      PyErr_SetString(backend_error, e.what());
      return;
  }
}

void bind_errors(py::module_& m) {
  const auto make = [&m](const char* name, py::handle bases) {
    py::object cls = py::reinterpret_steal<py::object>(
        PyErr_NewException((std::string("fastcomms._C.") + name).c_str(), bases.ptr(), nullptr));
    m.attr(name) = cls;
    return cls.release().ptr();
  };
  aborted_error = make("AbortedError", PyExc_RuntimeError);
  backend_error = make("BackendError", PyExc_RuntimeError);
  unsupported_error = make("UnsupportedError", PyExc_RuntimeError);
  // Argument, type and timeout errors are ValueError / TypeError / TimeoutError as Python code
  // expects, and RuntimeError too, as torchcomms raises (its C++ throws std::runtime_error), so
  // code written against either catches them. They keep the builtin names (fastcomms._C.ValueError
  // ...), so a traceback or a check of the class name reads as before.
  const auto both = [&make](const char* name, PyObject* base) {
    return make(name, py::make_tuple(py::handle(base), py::handle(PyExc_RuntimeError)));
  };
  invalid_argument = both("ValueError", PyExc_ValueError);
  type_error = both("TypeError", PyExc_TypeError);
  timeout_error = both("TimeoutError", PyExc_TimeoutError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      set_python_error(e);
    } catch (const c10::ValueError& e) {
      // The Ulysses op's kernels raise torch's kinds for torch's own entry points (NOTE [ulysses
      // op errors] in ulysses_op.cpp); from ours they read as every other fastcomms error.
      PyErr_SetString(invalid_argument, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(type_error, e.what_without_backtrace());
    }
  });
}

}  // namespace fastcomms::python
