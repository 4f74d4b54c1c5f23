// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// What the components of fastcomms._C share that needs no torch (NOTE [one extension] in
// binding.hpp): the interpreter's state, the communicator and Ulysses transport objects Python
// holds, stores from Python, the caller's stream and the error mapping. The torch side is
// tensors.hpp.
#include <pybind11/pybind11.h>

#include <chrono>
#include <memory>
#include <optional>

#include "fastcomms/core/communicator.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/core/window.hpp"
#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/transport.hpp"

namespace fastcomms::python {

/// Whether this thread may take the GIL: not once the interpreter is finalizing (Python ends a
/// thread other than the finalizing one that asks for it, and the unwind through a destructor
/// terminates the process). A reference dropped then is left to the exiting process.
inline bool usable() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsInitialized() && !Py_IsFinalizing();
#else
  return Py_IsInitialized() && !_Py_IsFinalizing();
#endif
}

/// NOTE [error mapping]: sets the Python exception fastcomms raises for `e` (errors.cpp; the
/// classes exist once bind_errors ran). GIL held.
void set_python_error(const Error& e);

/// The caller's current torch stream on `d` (a cudaStream_t), or null for CPU (tensors.cpp).
void* current_stream(const Device& d);

/// Releases the tensors of parked ops that have finished (NOTE [python tensors outlive their op]
/// in tensors.cpp); GIL held.
void release_finished();

/// A torch.distributed.Store (any Python object with its methods) as a fastcomms Store
/// (bind_store.cpp).
std::shared_ptr<Store> py_store(pybind11::object store);

/// NOTE [hooks on the fast path]: what a C++ path of the extension that issues an op without
/// Python (the process group's fast path, bind_c10d.cpp) hands the communicator as
/// CallOptions::frontend, so that Python pre-hooks still get the call's argument objects and
/// the path stays on while they are registered. Inside this extension OpInfo::frontend is one of
/// these or null (the Python path's calls find their arguments on their thread: NOTE [one hook
/// registry] in fastcomms/_ops.py). `args` builds, with the GIL held and only for a hook that asks,
/// the tuple fastcomms._ops.fast_pre_args reads: (tensor or output, input or None, reduction as
/// (RedOpType, factor) or None).
struct HookFrontend {
  static constexpr uint64_t kTag = 0x66632d686f6f6b73ULL;  // "fc-hooks"
  uint64_t tag = kTag;
  pybind11::object (*args)(const HookFrontend&) = nullptr;
};

/// Whether an op's frontend is a fast path's HookFrontend.
inline bool is_hook_frontend(const void* frontend) {
  const auto* f = static_cast<const HookFrontend*>(frontend);
  return f != nullptr && f->tag == HookFrontend::kTag && f->args != nullptr;
}

/// The Python arguments of a fast-path op's frontend, or None for an op without one (GIL held).
inline pybind11::object frontend_args(const void* frontend) {
  if (!is_hook_frontend(frontend)) return pybind11::none();
  const auto* f = static_cast<const HookFrontend*>(frontend);
  return f->args(*f);
}

/// The name under which a backend written in Python lends itself (NOTE [python backend
/// trampoline] in bind_pybackend.cpp): a layer that issues ops from C++ refuses its communicator.
inline constexpr const char* kLentPythonBackend = "python_backend";

/// The communicator Python holds (fastcomms._C.Comm; TorchComm._c).
struct PyComm {
  std::shared_ptr<Communicator> comm;

  CallOptions opts(bool async_op, std::optional<std::chrono::milliseconds> timeout,
                   std::optional<Hints> hints) const {
    CallOptions o;
    o.async_op = async_op;
    o.stream = stream();
    if (timeout) o.options.timeout = *timeout;
    if (hints) o.options.hints = *hints;
    return o;
  }
  // CUDA backends order an op on the caller's current torch stream (NOTE [nccl backend streams]).
  void* stream() const { return current_stream(comm->device()); }
};

/// A window from Python (fastcomms._C.Window, made by bind_window.cpp; the device API of
/// bind_device_window.cpp reaches the same C++ window): ops enqueue on the caller's current torch
/// stream; map_remote tensors keep the window alive.
struct PyWindow {
  std::shared_ptr<Window> w;
  Device device;
};

/// A Ulysses transport from Python (fastcomms.ulysses holds one per lane). CUDA calls are
/// enqueued on the caller's current torch stream; empty_output() tensors keep their buffer's
/// backing alive on their own.
struct PyTransport {
  UlyssesTransportPtr t;
  Device device;
  UlyssesTransport& get() const {
    FASTCOMMS_CHECK(t != nullptr, kInvalidArgument, "UlyssesGroup: the group was destroyed");
    return *t;
  }
};

/// The class `name` of `m` that an earlier bind_* function made, to add methods to it.
template <typename T>
pybind11::class_<T> reopen(pybind11::module_& m, const char* name) {
  return pybind11::reinterpret_borrow<pybind11::class_<T>>(m.attr(name));
}

}  // namespace fastcomms::python
