// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// A torch.distributed (c10d) Backend over a fastcomms communicator, so a fastcomms process group
// is a plain torch ProcessGroup with this backend registered for the communicator's device.
//
// NOTE [c10d backend over a communicator]: torch's own checks take plain ProcessGroups only in
// places (`batch_isend_irecv` coalesces a batch only when `type(group) is ProcessGroup` and its
// backend says `supports_coalescing`; `pg._get_backend(device)` must find a backend). Python
// cannot subclass c10d's Backend (no constructor is bound), so the backend is this C++ class; the
// module shares torch's pybind11 (NOTE [one extension] in binding.hpp), so it derives from torch's
// Backend type and torch's Python sees it as one.
//
// NOTE [process group fast path]: the hottest collectives (all_reduce, all_gather_into_tensor,
// reduce_scatter_tensor: what DDP and FSDP2 issue per bucket and per layer; all_to_all_single
// with equal splits, as sequence and expert parallelism issue it) go straight to the C++
// communicator (measured on one H200: about 13 us of host time per call through Python against
// 8 us for the communicator's own call, docs/benchmarks.md). The backend reads the TorchComm's
// `_fast` on every call (a reconfigure replaces it): the C++ communicator (fastcomms._C.Comm), or
// None for a Python backend's communicator or one awaiting its first reconfigure; Python pre- and
// post-hooks see the call here too (NOTE [hooks on the fast path] in py_common.hpp). Then, and for
// the calls this path does not cover (several tensors, a PREMUL_SUM factor held in a tensor), the
// call goes to the Python object `impl` (fastcomms.device_mesh's ops over the communicator), method
// by method. The work keeps the op's tensors as the Python path does (a dropped unfinished work
// parks them, NOTE [python tensors outlive their op]), and errors reach Python as the same
// exceptions (NOTE [error mapping]).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "binding.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

using C10dWorkPtr = c10::intrusive_ptr<c10d::Work>;

// A Work made in Python lives as long as its Python object: this holder keeps that object (as
// torch's own Python process groups do) and forwards to it.
class HeldWork final : public c10d::Work {
 public:
  explicit HeldWork(py::object py_work)
      : work_(py_work.cast<C10dWorkPtr>()), py_work_(std::move(py_work)) {}
  ~HeldWork() override {
    if (usable()) {
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
  C10dWorkPtr work_;
  py::object py_work_;
};

// NOTE [process group fast path]: the communicator's work, with what get_future returns.
class FastWork final : public c10d::Work {
 public:
  FastWork(PyWork w, std::vector<at::Tensor> result)
      : w_(std::make_unique<PyWork>(std::move(w))), result_(std::move(result)) {}
  ~FastWork() override {
    if (!usable()) {  // the interpreter is gone: left to the exit
      (void)w_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    w_.reset();  // an unfinished op's tensors are parked
  }
  bool wait(std::chrono::milliseconds) override {
    try {
      if (usable() && PyGILState_Check()) {
        py::gil_scoped_release release;  // a caller holding the GIL: the abort hooks may need it
        w_->wait_nogil();
      } else {
        w_->wait_nogil();
      }
      return true;
    } catch (const Error& e) {
      if (!usable()) throw std::runtime_error(e.what());
      py::gil_scoped_acquire gil;
      set_python_error(e);  // the exception fastcomms raises for it
      throw py::error_already_set();
    }
  }
  bool isCompleted() override { return w_->work->is_completed(); }
  bool isSuccess() const override { return w_->work->is_completed(); }
  // As the Python path's work: waited (a CUDA op: the caller's stream waits), then done.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    wait(std::chrono::milliseconds(0));
    auto fut =
        c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    fut->markCompleted(c10::IValue(result_));
    return fut;
  }

 private:
  std::unique_ptr<PyWork> w_;
  std::vector<at::Tensor> result_;
};

// Ops issued through the fast path (the tests check which path a call took).
std::atomic<uint64_t> fast_calls{0};

// torch's reduction as ours, or nullopt where the Python path decides (it knows every op and
// says what is wrong with the others): UNUSED, or PREMUL_SUM with a factor held in a tensor.
std::optional<ReduceOp> fast_red(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM:
      return ReduceOp{RedOpType::kSum};
    case c10d::ReduceOp::AVG:
      return ReduceOp{RedOpType::kAvg};
    case c10d::ReduceOp::PRODUCT:
      return ReduceOp{RedOpType::kProduct};
    case c10d::ReduceOp::MIN:
      return ReduceOp{RedOpType::kMin};
    case c10d::ReduceOp::MAX:
      return ReduceOp{RedOpType::kMax};
    case c10d::ReduceOp::BAND:
      return ReduceOp{RedOpType::kBand};
    case c10d::ReduceOp::BOR:
      return ReduceOp{RedOpType::kBor};
    case c10d::ReduceOp::BXOR:
      return ReduceOp{RedOpType::kBxor};
    case c10d::ReduceOp::PREMUL_SUM: {
      const auto* s = dynamic_cast<const c10d::NCCLPreMulSumSupplement*>(op.supplement_.get());
      if (s == nullptr || s->tensor_factor.defined()) return std::nullopt;
      return ReduceOp{RedOpType::kPremulSum, s->double_factor};
    }
    default:
      return std::nullopt;
  }
}

enum class FastOp { kAllReduce, kAllGatherSingle, kReduceScatterSingle, kAllToAllSingle };

// NOTE [hooks on the fast path]: a fast call's tensors and reduction, for Python pre-hooks.
struct FastFrontend : HookFrontend {
  const at::Tensor* a = nullptr;  // all_reduce's tensor, else the output
  const at::Tensor* b = nullptr;  // the input (undefined for all_reduce)
  std::optional<ReduceOp> red;    // the reducing ops' reduction

  FastFrontend(const at::Tensor& a_, const at::Tensor& b_, std::optional<ReduceOp> r)
      : a(&a_), b(&b_), red(r) {
    args = [](const HookFrontend& h) -> py::object {
      const auto& f = static_cast<const FastFrontend&>(h);
      py::object red = py::none();
      if (f.red) red = py::make_tuple(py::cast(f.red->type), f.red->factor);
      py::object b = f.b->defined() ? py::cast(*f.b) : py::none();
      return py::make_tuple(py::cast(*f.a), b, red);
    };
  }
};

class ForwardingBackend final : public c10d::Backend {
 public:
  ForwardingBackend(int rank, int size, py::object impl)
      : c10d::Backend(rank, size), impl_(std::move(impl)) {
    comm_ = py::getattr(impl_, "comm", py::none());  // the TorchComm whose `_fast` calls read
  }

  ~ForwardingBackend() override {
    if (usable()) {
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
  C10dWorkPtr endCoalescing() override { return call("_end_coalescing"); }

  C10dWorkPtr broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    return call("broadcast", t, o);
  }
  C10dWorkPtr allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    if (t.size() == 1)
      if (auto w = fast(FastOp::kAllReduce, t[0], at::Tensor(), &o.reduceOp, t)) return w;
    return call("allreduce", t, o);
  }
  C10dWorkPtr allreduce_coalesced(std::vector<at::Tensor>& t,
                                  const c10d::AllreduceCoalescedOptions& o) override {
    return call("allreduce_coalesced", t, o);
  }
  C10dWorkPtr reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    return call("reduce", t, o);
  }
  C10dWorkPtr allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                        const c10d::AllgatherOptions& o) override {
    return call("allgather", out, in, o);
  }
  C10dWorkPtr _allgather_base(at::Tensor& out, at::Tensor& in,
                              const c10d::AllgatherOptions& o) override {
    if (auto w = fast(FastOp::kAllGatherSingle, out, in, nullptr, {out})) return w;
    return call("_allgather_base", out, in, o);
  }
  C10dWorkPtr allgather_into_tensor_coalesced(std::vector<at::Tensor>& out,
                                              std::vector<at::Tensor>& in,
                                              const c10d::AllgatherOptions& o) override {
    return call("allgather_into_tensor_coalesced", out, in, o);
  }
  C10dWorkPtr gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in,
                     const c10d::GatherOptions& o) override {
    return call("gather", out, in, o);
  }
  C10dWorkPtr scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                      const c10d::ScatterOptions& o) override {
    return call("scatter", out, in, o);
  }
  C10dWorkPtr reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in,
                             const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter", out, in, o);
  }
  C10dWorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                   const c10d::ReduceScatterOptions& o) override {
    if (auto w = fast(FastOp::kReduceScatterSingle, out, in, &o.reduceOp, {out})) return w;
    return call("_reduce_scatter_base", out, in, o);
  }
  C10dWorkPtr reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out,
                                              std::vector<at::Tensor>& in,
                                              const c10d::ReduceScatterOptions& o) override {
    return call("reduce_scatter_tensor_coalesced", out, in, o);
  }
  C10dWorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& out_splits,
                            std::vector<int64_t>& in_splits,
                            const c10d::AllToAllOptions& o) override {
    if (out_splits.empty() && in_splits.empty())
      if (auto w = fast(FastOp::kAllToAllSingle, out, in, nullptr, {out})) return w;
    return call("alltoall_base", out, in, out_splits, in_splits, o);
  }
  C10dWorkPtr alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in,
                       const c10d::AllToAllOptions& o) override {
    return call("alltoall", out, in, o);
  }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all_ranks) override {
    call_void("monitored_barrier", o.timeout, wait_all_ranks);
  }
  C10dWorkPtr send(std::vector<at::Tensor>& t, int dst, int tag) override {
    return call("send", t, dst, tag);
  }
  C10dWorkPtr recv(std::vector<at::Tensor>& t, int src, int tag) override {
    return call("recv", t, src, tag);
  }
  C10dWorkPtr recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    return call("recv_anysource", t, tag);
  }
  C10dWorkPtr barrier(const c10d::BarrierOptions& o) override { return call("barrier", o); }
  void setTimeout(std::chrono::milliseconds timeout) override { call_void("set_timeout", timeout); }
  void abort() override { call_void("abort"); }
  void shutdown() override { call_void("shutdown"); }

 private:
  // NOTE [process group fast path]: the op on the C++ communicator, or null for the Python path.
  C10dWorkPtr fast(FastOp op, const at::Tensor& a, const at::Tensor& b, const c10d::ReduceOp* r,
                   std::vector<at::Tensor> result) {
    std::optional<ReduceOp> red = ReduceOp{RedOpType::kSum};
    if (r != nullptr && !(red = fast_red(*r))) return nullptr;
    py::gil_scoped_acquire gil;
    py::object handle = py::getattr(comm_, "_fast", py::none());
    if (handle.is_none()) return nullptr;
    const PyComm& c = handle.cast<const PyComm&>();
    CallOptions o = c.opts(true, std::nullopt, std::nullopt);
    const bool reduces = op == FastOp::kAllReduce || op == FastOp::kReduceScatterSingle;
    const FastFrontend frontend(a, b, reduces ? red : std::nullopt);
    o.frontend = &frontend;
    fast_calls.fetch_add(1, std::memory_order_relaxed);
    try {
      PyWork w = [&] {
        switch (op) {
          case FastOp::kAllReduce:
            return issue(c, {a}, [&] { return c.comm->all_reduce(view(a), *red, o); });
          case FastOp::kAllGatherSingle:
            return issue(c, {a, b}, [&] { return c.comm->all_gather_single(view(a), view(b), o); });
          case FastOp::kReduceScatterSingle:
            return issue(c, {a, b},
                         [&] { return c.comm->reduce_scatter_single(view(a), view(b), *red, o); });
          case FastOp::kAllToAllSingle:
            break;
        }
        return issue(c, {a, b}, [&] { return c.comm->all_to_all_single(view(a), view(b), o); });
      }();
      return c10::make_intrusive<FastWork>(std::move(w), std::move(result));
    } catch (const Error& e) {
      set_python_error(e);  // the op's error, as fastcomms raises it
      throw py::error_already_set();
    }
  }

  template <typename... Args>
  C10dWorkPtr call(const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    return c10::make_intrusive<HeldWork>(impl_.attr(name)(std::forward<Args>(args)...));
  }
  template <typename... Args>
  void call_void(const char* name, Args&&... args) {
    py::gil_scoped_acquire gil;
    impl_.attr(name)(std::forward<Args>(args)...);
  }

  py::object impl_;
  py::object comm_;  // the TorchComm (None: no fast path)
};

}  // namespace

void bind_c10d(py::module_& m) {
  // A Python type for the backend, derived from torch's Backend type, so a backend torch hands
  // out (pg._get_backend(device)) is seen as ours (isinstance) and names its communicator.
  py::class_<ForwardingBackend, c10d::Backend, c10::intrusive_ptr<ForwardingBackend>>(
      m, "ForwardingBackend")
      .def_property_readonly("impl", &ForwardingBackend::impl)
      .def(
          "get_comm",
          [](const ForwardingBackend& b) -> py::object { return b.impl().attr("comm"); },
          "The fastcomms TorchComm this backend runs on (torchcomms' _BackendWrapper.get_comm).");
  m.def(
      "make_backend",
      [](int rank, int size, py::object impl) {
        return c10::make_intrusive<ForwardingBackend>(rank, size, std::move(impl));
      },
      py::arg("rank"), py::arg("size"), py::arg("impl"),
      "A c10d Backend over impl.comm (NOTE [c10d backend over a communicator]); the calls the "
      "communicator does not run directly call impl's methods of the same names (allreduce("
      "tensors, opts), send(tensors, dst, tag), _start_coalescing(), _end_coalescing(), ...).");
  m.def(
      "_fast_calls", [] { return fast_calls.load(); }, "Ops the process group fast path issued");
}

}  // namespace fastcomms::python
