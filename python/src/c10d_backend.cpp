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
// nothing of fastcomms: the Python object does the work, but for the collectives of NOTE
// [process group fast path] (src/fast_ops.hpp), which go to fastcomms._C's table directly.
#include <pybind11/chrono.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "fast_ops.hpp"
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

namespace fp = fastcomms::python;

// NOTE [process group fast path]: a work of fastcomms._C's table, with what get_future returns.
class FastC10dWork final : public c10d::Work {
 public:
  FastC10dWork(const fp::FastOps* ops, fp::FastWork* w, std::vector<at::Tensor> result)
      : ops_(ops), w_(w), result_(std::move(result)) {}
  ~FastC10dWork() override {
    if (!fastcomms::python::usable()) return;  // the interpreter is gone: left to the exit
    py::gil_scoped_acquire gil;
    ops_->release(w_);  // an unfinished op's tensors are parked in _C
  }
  bool wait(std::chrono::milliseconds) override {
    fp::FastError err;
    bool ok = false;
    if (fastcomms::python::usable() && PyGILState_Check()) {
      py::gil_scoped_release release;  // a caller holding the GIL: the abort hooks may need it
      ok = ops_->wait(w_, &err);
    } else {
      ok = ops_->wait(w_, &err);
    }
    if (ok) return true;
    if (!fastcomms::python::usable()) throw std::runtime_error(err.message);
    py::gil_scoped_acquire gil;
    ops_->set_error(err);  // the exception fastcomms raises for it
    throw py::error_already_set();
  }
  bool isCompleted() override { return ops_->completed(w_); }
  bool isSuccess() const override { return ops_->completed(w_); }
  // As the Python path's work: waited (a CUDA op: the caller's stream waits), then done.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    wait(std::chrono::milliseconds(0));
    auto fut =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    fut->markCompleted(c10::IValue(result_));
    return fut;
  }

 private:
  const fp::FastOps* ops_;
  fp::FastWork* w_;
  std::vector<at::Tensor> result_;
};

// Whether the table covers torch's reduction `op` (else the Python path decides: it knows every
// op and says what is wrong with the others); PREMUL_SUM's factor into `factor`.
bool fast_red(const c10d::ReduceOp& op, double* factor) {
  *factor = 1.0;
  if (op.op_ == c10d::ReduceOp::UNUSED) return false;
  if (op.op_ != c10d::ReduceOp::PREMUL_SUM) return true;
  const auto* s = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
  if (s == nullptr || s->tensor_factor.defined()) return false;  // a tensor factor: Python
  *factor = s->double_factor;
  return true;
}

class ForwardingBackend final : public c10d::Backend {
 public:
  ForwardingBackend(int rank, int size, py::object impl)
      : c10d::Backend(rank, size), impl_(std::move(impl)) {
    // NOTE [process group fast path]: the communicator whose `_fast` each call reads, and _C's
    // table (absent: every call takes the Python path)
    comm_ = py::getattr(impl_, "comm", py::none());
    py::object ops = py::module_::import("fastcomms._C").attr("_fast_ops");
    auto* table =
        static_cast<const fp::FastOps*>(PyCapsule_GetPointer(ops.ptr(), fp::kFastOpsCapsule));
    if (table == nullptr) {
      PyErr_Clear();
    } else if (table->abi == fp::FastOps::kAbi) {
      ops_ = table;
    }
  }

  ~ForwardingBackend() override {
    if (fastcomms::python::usable()) {
      py::gil_scoped_acquire gil;
      impl_ = py::object();
      comm_ = py::object();
    } else {
      impl_.release();  // the interpreter is finalizing or gone: left to the exiting process
      comm_.release();
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
    if (t.size() == 1)
      if (auto w = fast(fp::FastOp::kAllReduce, t[0], at::Tensor(), &o.reduceOp, t)) return w;
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
    if (auto w = fast(fp::FastOp::kAllGatherSingle, out, in, nullptr, {out})) return w;
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
    if (auto w = fast(fp::FastOp::kReduceScatterSingle, out, in, &o.reduceOp, {out})) return w;
    return call("_reduce_scatter_base", out, in, o);
  }
  WorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                                          const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter_tensor_coalesced", out, in, o);
  }
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                        std::vector<int64_t>& in_splits, const c10d::AllToAllOptions& o) override {
    if (out_splits.empty() && in_splits.empty())
      if (auto w = fast(fp::FastOp::kAllToAllSingle, out, in, nullptr, {out})) return w;
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
  // NOTE [process group fast path]: the op through _C's table, or null for the Python path.
  WorkPtr fast(fp::FastOp op, const at::Tensor& a, const at::Tensor& b, const c10d::ReduceOp* r,
               std::vector<at::Tensor> result) {
    if (ops_ == nullptr) return nullptr;
    double factor = 1.0;
    if (r != nullptr && !fast_red(*r, &factor)) return nullptr;
    const auto red = r != nullptr ? r->op_ : c10d::ReduceOp::SUM;
    py::gil_scoped_acquire gil;
    py::object handle = py::getattr(comm_, "_fast", py::none());
    if (handle.is_none()) return nullptr;
    void* comm = PyCapsule_GetPointer(handle.ptr(), fp::kFastCommCapsule);
    if (comm == nullptr) throw py::error_already_set();
    fp::FastWork* w = ops_->issue(comm, op, a, b, red, factor);
    if (w == nullptr) throw py::error_already_set();  // the op's error, as fastcomms raises it
    return c10::make_intrusive<FastC10dWork>(ops_, w, std::move(result));
  }

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
  py::object comm_;                   // the TorchComm (None: no fast path)
  const fp::FastOps* ops_ = nullptr;  // _C's table
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
  // NOTE [ulysses op in c++] (ulysses_op.cpp in fastcomms._C): a process group handed to _C,
  // which shares no pybind11 types with torch, as a capsule holding a reference to it.
  m.def("_process_group_capsule", [](const c10::intrusive_ptr<c10d::ProcessGroup>& pg) {
    return py::capsule(new c10::intrusive_ptr<c10d::ProcessGroup>(pg),
                       "fastcomms.c10d.ProcessGroup", [](PyObject* cap) {
                         delete static_cast<c10::intrusive_ptr<c10d::ProcessGroup>*>(
                             PyCapsule_GetPointer(cap, "fastcomms.c10d.ProcessGroup"));
                       });
  });
}
