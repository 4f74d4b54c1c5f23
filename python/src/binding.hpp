// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// The extension module fastcomms._C, one per component: each bind_<component>.cpp adds its
// names to the module and is called with one line from the PYBIND11_MODULE in binding.cpp
// (NOTE [one extension]). Nothing here includes torch: a component that needs tensors includes
// tensors.hpp itself.
//
// NOTE [one extension]: fastcomms' Python names come from one extension module, built with the
// pybind11 that torch ships in its include folder, so the module shares pybind11's type tables
// with torch: a torch.distributed ProcessGroup reaches C++ as itself, the c10d backend derives
// from torch's Backend type (bind_c10d.cpp), and no capsule carries an object between two
// modules. The files call down only: binding.cpp calls the bind_* functions; each bind_* file
// uses the shared pieces of py_common.hpp / tensors.hpp (errors.cpp, tensors.cpp), never another
// bind_* file. A class that several components extend (Comm) is made by one (bind_comm.cpp, the
// first called) and reopened by the others (`reopen<T>(m, "Comm")`, py_common.hpp).
#include <pybind11/pybind11.h>

namespace fastcomms::python {

/// The exception classes and the one mapping of C++ errors to them (NOTE [error mapping]).
void bind_errors(pybind11::module_& m);
/// Stores: torch.distributed.Store objects as fastcomms stores, the authenticated store.
void bind_store(pybind11::module_& m);
/// The communicator (Comm), its works, enums and the backend registry.
void bind_comm(pybind11::module_& m);
/// Backends written in Python under the C++ communicator (NOTE [python backend trampoline]).
void bind_pybackend(pybind11::module_& m);
/// Hooks on a communicator (pre, post, abort) and the op ids Python backends draw.
void bind_hooks(pybind11::module_& m);
/// The NaN check, a C++ hook (NOTE [NaN check on the device]).
void bind_nan_check(pybind11::module_& m);
/// Windows (Comm.new_window, Window).
void bind_window(pybind11::module_& m);
/// Ulysses transports (UlyssesTransport, select_transport, geometry) and their async helpers.
void bind_ulysses(pybind11::module_& m);
/// The Ulysses op (NOTE [ulysses op in c++]) and its Python entry points.
void bind_ulysses_op(pybind11::module_& m);
/// FP8 quantize/dequantize of rows, for the tests.
void bind_fp8(pybind11::module_& m);
/// The kernel of a compiled communicator call (NOTE [compiled calls in C++]).
void bind_compiled(pybind11::module_& m);
/// The c10d Backend over a communicator (NOTE [c10d backend over a communicator]).
void bind_c10d(pybind11::module_& m);
/// The device API of windows (get_device_window, register_local_buffer, store windows, ...).
void bind_device_window(pybind11::module_& m);
/// device_alltoallv_single's entry points (NOTE [device all-to-all-v]) and the MoE row kernels
/// (NOTE [moe row kernels]).
void bind_device_a2a(pybind11::module_& m);

}  // namespace fastcomms::python
