// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
//
// fastcomms._c10d: a torch.distributed (c10d) Backend whose every method forwards to a Python
// object (fastcomms.device_mesh's ops over a communicator), so a fastcomms process group is a
// plain torch ProcessGroup with this backend registered for the communicator's device.
//
// NOTE [c10d backend over python]: torch's own checks take plain ProcessGroups only in places
// (`batch_isend_irecv` coalesces a batch only when `type(group) is ProcessGroup` and its
// backend says `supports_coalescing`; `pg._get_backend(device)` must find a backend). Python
// cannot subclass c10d's Backend (no constructor is bound), so this module does it in C++. It is
// built against the pybind11 that torch ships (torch's include folder comes first), not the one
// fastcomms._C uses: the Backend and Work objects cross into torch's own Python types, which
// pybind11 shares only between modules built with the same pybind11 internals. It includes
// nothing of fastcomms: the Python object does the work.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <string>
#include <utility>
#include <vector>

#include "python_state.hpp"

namespace py = pybind11;

namespace {

using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// A Work made in Python lives as long as its Python object: this holder keeps that object (as
// torch's own Python process groups do) and forwards to it.
class HeldWork final : public c10d::Work {
 public:
  explicit HeldWork(py::object py_work)
      : work_(py_work.cast<WorkPtr>()), py_work_(std::move(py_work)) {}
  ~HeldWork() override {
    if (fastcomms::python::usable()) {
      py::gil_scoped_acquire gil;
      py_work_ = py::object();
    } else {
      py_work_.release();
    }
  }
  bool wait(std::chrono::milliseconds timeout) override { return work_->wait(timeout); }
  bool isCompleted() override { return work_->isCompleted(); }
  bool isSuccess() const override { return work_->isSuccess(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return work_->getFuture(); }

 private:
  WorkPtr work_;
  py::object py_work_;
};

class ForwardingBackend final : public c10d::Backend {
 public:
  ForwardingBackend(int rank, int size, py::object impl)
      : c10d::Backend(rank, size), impl_(std::move(impl)) {}

  ~ForwardingBackend() override {
    if (fastcomms::python::usable()) {
      py::gil_scoped_acquire gil;
      impl_ = py::object();
    } else {
      impl_.release();  // the interpreter is finalizing or gone: left to the exiting process
    }
  }

  py::object impl() const { return impl_; }

  const std::string getBackendName() const override { return "fastcomms"; }
  bool supportsCoalescing() const override { return true; }

  void startCoalescing() override { call_void("_start_coalescing"); }
  WorkPtr endCoalescing() override { return call("_end_coalescing"); }

  WorkPtr broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    return call("broadcast", t, o);
  }
  WorkPtr allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return call("allreduce", t, o);
  }
  WorkPtr allreduce_coalesced(std::vector<at::Tensor>& t,
                              const c10d::AllreduceCoalescedOptions& o) override {
    return call("allreduce_coalesced", t, o);
  }
  WorkPtr reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return call("reduce", t, o);
  }
  WorkPtr allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                    const c10d::AllgatherOptions& o) override {
    return call("allgather", out, in, o);
  }
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in,
                          const c10d::AllgatherOptions& o) override {
    return call("_allgather_base", out, in, o);
  }
  WorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::AllgatherOptions& o) override {
    return call("allgather_into_tensor_coalesced", out, in, o);
  }
  WorkPtr gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                 const c10d::GatherOptions& o) override {
    return call("gather", out, in, o);
  }
  WorkPtr scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                  const c10d::ScatterOptions& o) override {
    return call("scatter", out, in, o);
  }
  WorkPtr reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                         const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter", out, in, o);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                               const c10d::ReduceScatterOptions& o) override {
    return call("_reduce_scatter_base", out, in, o);
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter_tensor_coalesced", out, in, o);
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    return call("alltoall_base", out, in, out_splits, in_splits, o);
  }
  WorkPtr alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                   const c10d::AllToAllOptions& o) override {
    return call("alltoall", out, in, o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    call_void("monitored_barrier", o.timeout, wait_all_ranks);
  }
  WorkPtr send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return call("send", t, dst, tag);
  }
  WorkPtr recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return call("recv", t, src, tag);
  }
  WorkPtr recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return call("recv_anysource", t, tag);
  }
  WorkPtr barrier(const c10d::BarrierOptions& o) override { return call("barrier", o); }
  void setTimeout(std::chrono::milliseconds timeout) override { call_void("set_timeout", timeout); }
  void abort() override { call_void("abort"); }
  void shutdown() override { call_void("shutdown"); }

 private:
  template <typename... Args>
  WorkPtr call(const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    return c10::make_intrusive<HeldWork>(impl_.attr(name)(std::forward<Args>(args)...));
  }
  template <typename... Args>
  void call_void(const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    impl_.attr(name)(std::forward<Args>(args)...);
  }

  py::object impl_;
};

}  // namespace

PYBIND11_MODULE(_c10d, m) {
  m.doc() = "fastcomms' c10d Backend over a Python object (internal; see fastcomms.device_mesh)";
  // A Python type for the backend, derived from torch's Backend type, so a backend torch hands
  // out (pg._get_backend(device)) is seen as ours (isinstance) and names its communicator.
  py::class_<ForwardingBackend, c10d::Backend, c10::intrusive_ptr<ForwardingBackend>>(
      m, "ForwardingBackend")
      .def_property_readonly("impl", &ForwardingBackend::impl)
      .def(
          "get_comm", [](const ForwardingBackend& b) { return b.impl().attr("comm"); },
          "The fastcomms TorchComm this backend runs on (torchcomms' _BackendWrapper.get_comm).");
  m.def(
      "make_backend",
      [](int rank, int size, py::object impl) {
        return c10::make_intrusive<ForwardingBackend>(rank, size, std::move(impl));
      },
      py::arg("rank"), py::arg("size"), py::arg("impl"),
      "A c10d Backend whose methods call impl's methods of the same names (allreduce(tensors, "
      "opts), send(tensors, dst, tag), _start_coalescing(), _end_coalescing(), ...).");
}
