// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// What the torch-facing components of fastcomms._C share (tensors.cpp): tensors as views, the
// caller's torch stream, and the Work Python holds with the tensors of its op.
#include <torch/extension.h>

#include <memory>
#include <utility>
#include <vector>

#include "fastcomms/core/tensor.hpp"
#include "fastcomms/core/work.hpp"
#include "py_common.hpp"

#ifdef FASTCOMMS_WITH_CUDA
#include <c10/core/Stream.h>
#endif

namespace fastcomms::python {

/// `t` as a non-owning view (dense, on cpu or cuda; anything else raises kInvalidArgument).
TensorView view(const at::Tensor& t);
std::vector<TensorView> views(const std::vector<at::Tensor>& ts);
/// Torch's dtype as ours (kTypeError for one fastcomms cannot carry), and ours as torch's.
DType to_dtype(at::ScalarType t);
at::ScalarType to_scalar_type(DType d);

#ifdef FASTCOMMS_WITH_CUDA
/// Whether torch registered its CUDA implementation (NOTE [torch streams through c10]).
bool torch_has_cuda();
/// The caller's current torch stream on CUDA device `d`.
c10::Stream torch_current_stream(c10::DeviceIndex d);
/// The c10::Stream of a torch.Stream from Python (torch.cuda.Stream among them).
c10::Stream torch_stream(const pybind11::handle& s);
#endif
/// Whether the current torch stream of a CUDA device is capturing a CUDA graph (where querying
/// an event or syncing would invalidate the capture). False without CUDA.
bool stream_capturing();

/// A Work from Python (fastcomms._C.Work), with the tensors its op uses (NOTE [python tensors
/// outlive their op] in tensors.cpp: a dropped, unfinished one parks them).
struct PyWork {
  WorkPtr work;
  std::vector<at::Tensor> keep;
  // NOTE [process abort]: set where the communicator aborts the process on an op's error
  std::shared_ptr<ProcessAbort> abort_on_error;
  PyWork(WorkPtr w, std::vector<at::Tensor> k) : work(std::move(w)), keep(std::move(k)) {}
  PyWork(PyWork&&) = default;
  PyWork& operator=(PyWork&&) = default;
  ~PyWork();
  /// Waits without the GIL (the abort hooks may need it); GIL held on entry.
  void wait();
  /// Waits, the GIL neither needed nor released (the c10d backend's works).
  void wait_nogil();
};

/// The PyWork of an op issued on `c`, keeping `keep` (GIL held).
inline PyWork issued(const PyComm& c, WorkPtr w, std::vector<at::Tensor> keep) {
  release_finished();
  PyWork pw(std::move(w), std::move(keep));
  pw.abort_on_error = c.comm->process_abort_on_error();
  return pw;
}

/// Issues `fn` (a WorkPtr()) on `c` with the GIL released; the Work keeps `keep`. GIL held.
template <typename Fn>
PyWork issue(const PyComm& c, std::vector<at::Tensor> keep, Fn&& fn) {
  WorkPtr w;
  {
    pybind11::gil_scoped_release release;
    w = fn();
  }
  return issued(c, std::move(w), std::move(keep));
}

/// NOTE [python backend trampoline]: what the Python methods' calls (bind_comm.cpp) hand the
/// communicator as CallOptions::frontend: the call's torch tensors, in the order its Backend call
/// lists its views (a list's tensors, then the tensor beside it; a reduction's factor tensor
/// last), so a backend written in Python (bind_pybackend.cpp) is called with the caller's own
/// tensor objects. Hooks see it as OpInfo::frontend and ignore it (it is no HookFrontend).
struct CallTensors {
  static constexpr uint64_t kTag = 0x66632d74656e736fULL;  // "fc-tenso"
  uint64_t tag = kTag;
  const std::vector<at::Tensor>* tensors = nullptr;
};

/// issue(), the call's tensors `keep` handed to fn as its CallOptions' frontend (NOTE [python
/// backend trampoline]): fn(const CallOptions&) issues the op with the options of
/// (async_op, timeout, hints).
template <typename Fn>
PyWork issue(const PyComm& c, std::vector<at::Tensor> keep, bool async_op,
             std::optional<std::chrono::milliseconds> timeout, std::optional<Hints> hints,
             Fn&& fn) {
  CallOptions o = c.opts(async_op, timeout, std::move(hints));
  const CallTensors rec{CallTensors::kTag, &keep};
  o.frontend = &rec;
  WorkPtr w;
  {
    pybind11::gil_scoped_release release;
    w = fn(static_cast<const CallOptions&>(o));
  }
  return issued(c, std::move(w), std::move(keep));
}

/// A Ulysses call on `stream` (default: the caller's current torch stream of x's device), the
/// GIL released while it is issued; the Work keeps x and out.
PyWork transport_call(UlyssesTransport& tr, const at::Tensor& x, const at::Tensor& out,
                      const UlyssesArgs& args, std::optional<void*> stream = std::nullopt);

}  // namespace fastcomms::python
