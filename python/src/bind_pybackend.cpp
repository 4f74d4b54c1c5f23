// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Backends written in Python (fastcomms.register_backend, torchcomms' protocol) under the C++
// communicator (NOTE [python backend trampoline]).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "binding.hpp"
#include "fastcomms/core/log.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

// NOTE [python backend trampoline]: a backend written in Python is a C++ Backend like any other
// (PyBackend), so its communicator is the C++ communicator: one hook registry, one op-id
// sequence, the argument checks, the flight recorder, the NaN check and clog, as torchcomms
// brings Python backends in through a trampoline. Each op calls the backend's method of the
// same name in torchcomms' order (all_reduce(tensor, op, async_op), ...) with the caller's own
// tensor objects, which the Python methods' calls hand over as CallTensors (tensors.hpp); the
// library's C++ paths (the process group's fast path, compiled calls, Ulysses transports) stay
// off for such a communicator (TorchComm._refresh_fast, Comm.select_transport), and a call that
// comes without its tensors is refused. A method returns None when the op is done, or an
// object with wait() (and optionally is_completed()), which becomes a PythonWork; a sync op is
// waited for by the communicator, as every backend's is. A method the backend lacks raises
// kUnsupported naming it; an exception the backend raises reaches the caller as itself.

// Python objects dropped on a thread without the GIL, released by the next thread that has it
// (drop_orphans): a thread without the GIL never waits for it here, since it may hold a lock a
// thread with the GIL waits for (the flight recorder drops works under its own).
std::mutex orphans_mu;
std::vector<PyObject*> orphans;

void drop_orphans() {  // GIL held
  std::vector<PyObject*> gone;
  {
    std::lock_guard<std::mutex> lock(orphans_mu);
    gone.swap(orphans);
  }
  for (PyObject* o : gone) Py_DECREF(o);
}

// A Python object C++ holds: dropped at once where the thread has the GIL, else later (above);
// left alone once Python is gone.
struct Held {
  py::object o;
  explicit Held(py::object x) : o(std::move(x)) {}
  Held(const Held&) = delete;
  Held& operator=(const Held&) = delete;
  ~Held() {
    if (!usable() || !PyGILState_Check()) {
      PyObject* p = o.release().ptr();
      if (usable() && p != nullptr) {
        std::lock_guard<std::mutex> lock(orphans_mu);
        orphans.push_back(p);
      }
      return;
    }
    o = py::object();
  }
};

// What a Python backend's method returned, as a Work: None is done; an object with wait() is
// done once waited for (wait() calls it once, the communicator's wait of a sync op included), or
// when its is_completed() says so; TorchWork._set_status (torchcomms', for works that finish out
// of band) overrides that until the next wait. is_completed() is asked only on a thread that has
// the GIL (a thread without it, the flight recorder's under its lock, reads "in progress" until
// then), and one that raises reads "in progress" too (logged): the state is polled from places
// where no Python error can be raised.
class PythonWork final : public Work {
 public:
  explicit PythonWork(py::object r) : done_(r.is_none()), r_(std::move(r)) {}
  WorkStatus status() const override {
    if (const int s = set_.load(); s >= 0) return static_cast<WorkStatus>(s);
    if (done_.load()) return WorkStatus::kCompleted;
    if (!usable() || !PyGILState_Check()) return WorkStatus::kInProgress;
    try {
      const py::object is_completed = py::getattr(r_.o, "is_completed", py::none());
      if (!is_completed.is_none() && py::bool_(is_completed())) {
        done_ = true;
        return WorkStatus::kCompleted;
      }
    } catch (py::error_already_set& e) {
      FASTCOMMS_LOG(kError, "a Python backend's work raised in is_completed(): ", e.what());
    }
    return WorkStatus::kInProgress;
  }
  void wait() override {
    if (!done_.load()) {
      py::gil_scoped_acquire gil;
      drop_orphans();
      r_.o.attr("wait")();
    }
    done_ = true;  // a work without is_completed is complete once waited for
    set_ = -1;     // as torchcomms' Python work: COMPLETED once waited
  }
  // The backend's methods got the tensors themselves: nothing to keep for a dropped work (as the
  // Python work it was before the trampoline).
  bool tensors_released() const override { return true; }
  // torchcomms' Python work: complete only as COMPLETED (a status set to ERROR is not complete).
  bool is_completed() const override { return status() == WorkStatus::kCompleted; }
  void set_status(WorkStatus s) { set_ = static_cast<int>(s); }

 private:
  mutable std::atomic<bool> done_;
  std::atomic<int> set_{-1};
  Held r_;
};

class PyBackend final : public Backend {
 public:
  // GIL held. `options` is the CommOptions the backend was set up with (split copies it),
  // `reduce_op` fastcomms.ReduceOp (the reductions the backend gets).
  // `shared_store`: new_comm was given a store its ranks share.
  PyBackend(py::object impl, std::string name, py::object options, py::object reduce_op,
            bool shared_store)
      : impl_(std::move(impl)),
        name_(std::move(name)),
        options_(std::move(options)),
        reduce_op_(std::move(reduce_op)),
        shared_store_(shared_store) {}

  const py::object& impl() const { return impl_.o; }

  std::string name() const override { return name_; }
  std::string version() const override {
    py::gil_scoped_acquire gil;
    const py::object get = py::getattr(impl_.o, "get_backend_version", py::none());
    return get.is_none() ? "python" : py::str(get()).cast<std::string>();
  }
  // Every op: one the backend lacks raises naming its method, when called.
  Capabilities capabilities() const override {
    Capabilities c;
    c.ops = (uint64_t{1} << static_cast<int>(OpKind::kCount)) - 1;
    c.ops &= ~(uint64_t{1} << static_cast<int>(OpKind::kNewWindow));
    c.cpu_tensors = c.cuda_tensors = c.self_p2p = true;
    return c;
  }

  WorkPtr send(const TensorView&, int dst, const OpContext& ctx) override {
    return call(ctx, "send", [&](const Ts& t) { return py::make_tuple(t.at(0), dst); });
  }
  WorkPtr recv(const TensorView&, int src, const OpContext& ctx) override {
    return call(ctx, "recv", [&](const Ts& t) { return py::make_tuple(t.at(0), src); });
  }
  // torchcomms' BatchSendRecv: the ops as (is_send, tensor, peer), in the batch's order.
  WorkPtr batch_p2p(const std::vector<P2POp>& ops, const OpContext& ctx) override {
    return call(ctx, "batch_op_issue", [&](const Ts& t) {
      py::list l;
      for (size_t i = 0; i < ops.size(); ++i)
        l.append(py::make_tuple(ops[i].kind == P2POp::Kind::kSend, t.at(i), ops[i].peer));
      return py::make_tuple(l);
    });
  }
  WorkPtr broadcast(const TensorView&, int root, const OpContext& ctx) override {
    return call(ctx, "broadcast", [&](const Ts& t) { return py::make_tuple(t.at(0), root); });
  }
  WorkPtr all_reduce(const TensorView&, const ReduceOp& op, const OpContext& ctx) override {
    return call(ctx, "all_reduce",
                [&](const Ts& t) { return py::make_tuple(t.at(0), red(op, t)); });
  }
  WorkPtr reduce(const TensorView&, int root, const ReduceOp& op, const OpContext& ctx) override {
    return call(ctx, "reduce",
                [&](const Ts& t) { return py::make_tuple(t.at(0), root, red(op, t)); });
  }
  WorkPtr all_gather(const std::vector<TensorView>& outputs, const TensorView&,
                     const OpContext& ctx) override {
    const size_t n = outputs.size();
    return call(ctx, ctx.op == OpKind::kAllGatherV ? "all_gather_v" : "all_gather",
                [&](const Ts& t) { return py::make_tuple(slice(t, 0, n), t.at(n)); });
  }
  WorkPtr all_gather_single(const TensorView&, const TensorView&, const OpContext& ctx) override {
    return call(ctx, "all_gather_single",
                [&](const Ts& t) { return py::make_tuple(t.at(0), t.at(1)); });
  }
  WorkPtr reduce_scatter(const TensorView&, const std::vector<TensorView>& inputs,
                         const ReduceOp& op, const OpContext& ctx) override {
    const size_t n = inputs.size();
    return call(ctx, ctx.op == OpKind::kReduceScatterV ? "reduce_scatter_v" : "reduce_scatter",
                [&](const Ts& t) { return py::make_tuple(t.at(n), slice(t, 0, n), red(op, t)); });
  }
  WorkPtr reduce_scatter_single(const TensorView&, const TensorView&, const ReduceOp& op,
                                const OpContext& ctx) override {
    return call(ctx, "reduce_scatter_single",
                [&](const Ts& t) { return py::make_tuple(t.at(0), t.at(1), red(op, t)); });
  }
  // The even form arrives here with its splits resolved; the backend gets the call it was.
  WorkPtr all_to_all_v_single(const TensorView&, const TensorView&,
                              const std::vector<int64_t>& output_splits,
                              const std::vector<int64_t>& input_splits,
                              const OpContext& ctx) override {
    if (ctx.op == OpKind::kAllToAllSingle)
      return call(ctx, "all_to_all_single",
                  [&](const Ts& t) { return py::make_tuple(t.at(0), t.at(1)); });
    return call(ctx, "all_to_all_v_single", [&](const Ts& t) {
      return py::make_tuple(t.at(0), t.at(1), output_splits, input_splits);
    });
  }
  WorkPtr all_to_all(const std::vector<TensorView>& outputs, const std::vector<TensorView>& inputs,
                     const OpContext& ctx) override {
    const size_t n = outputs.size(), m = inputs.size();
    return call(ctx, "all_to_all",
                [&](const Ts& t) { return py::make_tuple(slice(t, 0, n), slice(t, n, n + m)); });
  }
  WorkPtr barrier(const OpContext& ctx) override {
    return call(ctx, "barrier", [](const Ts&) { return py::tuple(); });
  }
  WorkPtr scatter(const TensorView&, const std::vector<TensorView>& inputs, int root,
                  const OpContext& ctx) override {
    const size_t n = inputs.size();
    return call(ctx, "scatter",
                [&](const Ts& t) { return py::make_tuple(t.at(n), slice(t, 0, n), root); });
  }
  // gather_single arrives as a gather into views of its output; the backend gets the call it was.
  WorkPtr gather(const std::vector<TensorView>& outputs, const TensorView&, int root,
                 const OpContext& ctx) override {
    if (ctx.op == OpKind::kGatherSingle)
      return call(ctx, "gather_single",
                  [&](const Ts& t) { return py::make_tuple(t.at(0), t.at(1), root); });
    const size_t n = outputs.size();
    return call(ctx, "gather",
                [&](const Ts& t) { return py::make_tuple(slice(t, 0, n), t.at(n), root); });
  }

  // torchcomms' protocol: backend.split(ranks, name, options) returns the new group's backend,
  // set up (None where this rank joins none); every rank gets the split's name, and options are
  // the parent's with that name (a member's: with the split's timeout and hints).
  std::unique_ptr<Backend> split(const std::vector<int>& ranks, const std::string& name,
                                 const BackendInit* init) override {
    py::gil_scoped_acquire gil;
    const py::object fn = py::getattr(impl_.o, "split", py::none());
    FASTCOMMS_CHECK(!fn.is_none(), kUnsupported, "backend '", name_, "' does not implement split");
    py::object options = py::module_::import("copy").attr("copy")(options_.o);
    options.attr("name") = name;
    if (init != nullptr) {
      options.attr("timeout") = init->options.timeout;
      options.attr("hints") = init->options.hints;
    }
    py::object sub = fn(ranks, name, options);
    if (init == nullptr || sub.is_none()) return nullptr;
    return std::make_unique<PyBackend>(std::move(sub), name_, std::move(options), reduce_op_.o,
                                       shared_store_);
  }

  std::shared_ptr<void> lend(const std::string& what) override {
    if (what != kLentPythonBackend) return nullptr;
    return std::shared_ptr<void>(this, [](void*) {});  // valid while the communicator is
  }

  // NOTE [call check]: without a store its ranks share, the communicator has nothing to compare
  // calls through (its store is this process's own), so it must not wait on it: the strict
  // check is left out, as a backend that checks in band leaves it.
  bool checks_calls(const OpContext&) const override { return !shared_store_; }

  void abort() override { optional_call("abort"); }
  void finalize() override { optional_call("finalize"); }

 private:
  using Ts = std::vector<at::Tensor>;

  // The call's tensors (NOTE [python backend trampoline]); refuses a call without them.
  const Ts& tensors(const OpContext& ctx) const {
    const auto* rec = static_cast<const CallTensors*>(ctx.frontend);
    FASTCOMMS_CHECK(rec != nullptr && rec->tag == CallTensors::kTag && rec->tensors != nullptr,
                    kUnsupported, ctx.prefix, "backend '", name_,
                    "' is written in Python and takes its communicator's own calls only; this "
                    "one came from a path of the library written in C++");
    return *rec->tensors;
  }

  // backend.<method>(*args(tensors), async_op) as a Work; the GIL taken for the call only.
  template <typename Args>
  WorkPtr call(const OpContext& ctx, const char* method, Args&& args) {
    const Ts& t = tensors(ctx);
    py::gil_scoped_acquire gil;
    drop_orphans();
    const py::object fn = py::getattr(impl_.o, method, py::none());
    FASTCOMMS_CHECK(!fn.is_none(), kUnsupported, ctx.prefix, "backend '", name_,
                    "' does not implement ", method);
    py::list a(args(t));
    a.append(ctx.async_op);
    return std::make_shared<PythonWork>(fn(*a));
  }

  static py::list slice(const Ts& t, size_t from, size_t to) {
    py::list l;
    for (size_t i = from; i < to; ++i) l.append(t.at(i));
    return l;
  }

  // The reduction as fastcomms.ReduceOp; a factor tensor is the call's last tensor.
  py::object red(const ReduceOp& r, const Ts& t) const {
    if (r.type != RedOpType::kPremulSum) return reduce_op_.o(r.type);
    if (r.has_factor_tensor()) return reduce_op_.o(r.type, t.back());
    return reduce_op_.o(r.type, r.factor);
  }

  void optional_call(const char* method) {
    py::gil_scoped_acquire gil;
    const py::object fn = py::getattr(impl_.o, method, py::none());
    if (!fn.is_none()) fn();
  }

  Held impl_;
  std::string name_;
  Held options_;
  Held reduce_op_;
  bool shared_store_;
};

}  // namespace

void bind_pybackend(py::module_& m) {
  reopen<PyComm>(m, "Comm")
      // `impl` is set up (init ran); `options` the fastcomms.CommOptions it was set up with.
      .def_static(
          "over_python_backend",
          [](py::object impl, const std::string& backend, py::object options,
             const std::string& device, int device_index, py::object reduce_op) {
            CommOptions o;
            o.name = options.attr("name").cast<std::string>();
            // (its tensors are viewed as every communicator's are: dense, CPU or CUDA)
            FASTCOMMS_CHECK(device == "cpu" || device == "cuda", kUnsupported, "[", o.name,
                            " new_comm] backend '", backend,
                            "' is written in Python, and such a communicator serves cpu or cuda "
                            "devices; got ",
                            device);
            o.timeout = options.attr("timeout").cast<std::chrono::milliseconds>();
            o.abort_process_on_timeout_or_error =
                options.attr("abort_process_on_timeout_or_error").cast<bool>();
            o.hints = options.attr("hints").cast<Hints>();
            const py::object store = options.attr("store");
            const int rank = impl.attr("get_rank")().cast<int>();
            const int size = impl.attr("get_size")().cast<int>();
            const std::string where = detail::cat("[rank ", rank, "/", size, " ", o.name,
                                                  "] new_comm: backend '", backend, "': ");
            FASTCOMMS_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, where,
                            "get_rank() and get_size() must give 0 <= rank < size, got rank ", rank,
                            " and size ", size);
            // The communicator's own key space, as create() gives a built-in backend's (NOTE
            // [store incarnations]): a name reused on the store reads none of its predecessor's
            // keys, and the ranks check their numbers. Without a store the ranks share none.
            std::shared_ptr<Store> keys;
            if (store.is_none()) {
              o.store = std::make_shared<MemoryStore>();
            } else {
              o.store = py_store(store);
              py::gil_scoped_release nogil;  // the roll call waits on the other ranks
              keys = Communicator::join_key_space(o, rank, size, where);
            }
            const Device dev =
                device == "cuda" ? Device{DeviceType::kCUDA, device_index} : Device{};
            auto b = std::make_unique<PyBackend>(std::move(impl), backend, std::move(options),
                                                 std::move(reduce_op), !store.is_none());
            return PyComm{std::make_shared<Communicator>(std::move(b), rank, size, dev,
                                                         std::move(o), std::move(keys))};
          })
      // The Python backend object under the communicator, or None (a built-in backend).
      .def("python_backend", [](const PyComm& c) -> py::object {
        if (auto* b = dynamic_cast<PyBackend*>(&c.comm->backend())) return b->impl();
        return py::none();
      });

  // torchcomms' TorchWork._set_status on a work a Python backend returned; false (nothing set)
  // on any other work, which fastcomms.TorchWork refuses.
  reopen<PyWork>(m, "Work").def("_set_status", [](PyWork& w, WorkStatus s) {
    auto* pw = dynamic_cast<PythonWork*>(w.work.get());
    if (pw != nullptr) pw->set_status(s);
    return pw != nullptr;
  });
}

}  // namespace fastcomms::python
