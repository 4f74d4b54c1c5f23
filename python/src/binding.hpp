// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// What the translation units of fastcomms._C share (binding.cpp, ulysses_op.cpp): tensors as
// views, the caller's stream, the Python side of a Ulysses transport, and the one mapping of C++
// errors to Python exceptions (NOTE [error mapping]).
#include <pybind11/pybind11.h>
#include <torch/extension.h>

#include <memory>

#include "fastcomms/core/tensor.hpp"
#include "fastcomms/core/window.hpp"
#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/transport.hpp"

namespace fastcomms::python {

/// `t` as a non-owning view (dense, on cpu or cuda; anything else raises kInvalidArgument).
TensorView view(const at::Tensor& t);
/// Our dtype as torch's.
at::ScalarType to_scalar_type(DType d);
/// The caller's current torch stream on `d` (a cudaStream_t), or null for CPU.
void* current_stream(const Device& d);

/// Releases the tensors of parked ops that have finished (NOTE [python tensors outlive their op]
/// in binding.cpp); GIL held.
void release_finished();

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

/// The byte all-to-all of a hierarchical group over a torch.distributed ProcessGroup (its capsule
/// from fastcomms._c10d._process_group_capsule): alltoall_base of uint8 tensors; on CUDA ordered
/// after the exchange's stream and before what follows on it, on a torch stream of the pool.
ByteExchange process_group_exchange(const pybind11::capsule& pg);

/// The C++ window behind a fastcomms._C.Window object (raises TypeError for anything else).
std::shared_ptr<Window> window_of(const pybind11::object& w);
/// The device API of windows (get_device_window, register_local_buffer, ...):
/// bind_device_window.cpp.
void bind_device_window(pybind11::module_& m);

/// Registers the Ulysses op (NOTE [ulysses op in c++]) and its Python entry points on `m`.
void bind_ulysses_op(pybind11::module_& m);
/// Registers device_alltoallv_single's entry points on `m` (after fastcomms._C.Comm exists).
void bind_device_a2a(pybind11::module_& m);

}  // namespace fastcomms::python
