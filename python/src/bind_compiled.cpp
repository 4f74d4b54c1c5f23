// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The kernel of ``fastcomms::comm_call_``, the node a compiled communicator call becomes (NOTE
// [compiled calls in C++]).
#include <pybind11/stl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#include <torch/library.h>

#include <atomic>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "binding.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

// NOTE [compiled calls in C++]: the kernel of ``fastcomms::comm_call_``, the node a compiled
// communicator call becomes (NOTE [compiled communicator methods], _compiled.py). A call that
// needs nothing of Python (a built-in backend's communicator: its ``TorchComm._fast`` is set,
// NOTE [process group fast path]; synchronous; no per-call hints or timeout; one of the methods
// below) runs here, on the C++ communicator, as the eager method's own binding runs it (same
// checks, errors and parked tensors). Python hooks stay on it: the call hands them its arguments
// (CompiledFrontend, NOTE [hooks on the fast path]), from which they get the same
// ``<Op>PreHookArgs`` as the eager call's. Every other call goes to the Python kernel,
// ``_compiled._comm_call_``. A Python kernel behind the dispatcher cost about as
// much again as the eager call itself (the 2-core CPU machine: 70 against 22 us;
// docs/benchmarks.md).
std::atomic<uint64_t> compiled_fast_calls{0};
py::object* comm_call_python = nullptr;  // _compiled._comm_call_ (kept for the process)

// NOTE [hooks on the fast path]: a compiled call's arguments as it passes them, for Python
// pre-hooks (fastcomms._ops.fast_pre_args makes the method's arguments of them).
struct CompiledFrontend : HookFrontend {
  const std::vector<at::Tensor>* o;
  const std::vector<at::Tensor>* i;
  const std::vector<int64_t>* n;
  const std::vector<double>* f;
  CompiledFrontend(const std::vector<at::Tensor>& o_, const std::vector<at::Tensor>& i_,
                   const std::vector<int64_t>& n_, const std::vector<double>& f_)
      : o(&o_), i(&i_), n(&n_), f(&f_) {
    args = [](const HookFrontend& h) -> py::object {
      const auto& c = static_cast<const CompiledFrontend&>(h);
      return py::make_tuple(*c.o, *c.i, *c.n, *c.f);
    };
  }
};

// The eager method's C++ call for `method` (its tensors as the compiled call passes them: the
// written, the read; its integers and floats without their pad), or nullopt where this kernel
// does not run that method.
std::optional<PyWork> compiled_issue(PyComm& c, const std::string& method,
                                     const std::vector<at::Tensor>& o,
                                     const std::vector<at::Tensor>& i,
                                     const std::vector<int64_t>& n, const std::vector<double>& f) {
  CallOptions opts = c.opts(false, std::nullopt, std::nullopt);
  const CompiledFrontend frontend(o, i, n, f);
  opts.frontend = &frontend;
  const auto red = [&] { return ReduceOp{static_cast<RedOpType>(n.at(0)), f.at(0)}; };
  const auto peer = [&](size_t k) { return static_cast<int>(n.at(k)); };  // a root or a source
  std::vector<at::Tensor> keep = o;
  keep.insert(keep.end(), i.begin(), i.end());
  const auto run = [&](auto&& fn) -> std::optional<PyWork> { return issue(c, keep, fn); };
  Communicator& cm = *c.comm;
  if (method == "all_reduce") return run([&] { return cm.all_reduce(view(o.at(0)), red(), opts); });
  if (method == "broadcast") return run([&] { return cm.broadcast(view(o.at(0)), peer(0), opts); });
  if (method == "reduce")
    return run([&] { return cm.reduce(view(o.at(0)), peer(1), red(), opts); });
  if (method == "recv") return run([&] { return cm.recv(view(o.at(0)), peer(0), opts); });
  if (method == "all_gather_single")
    return run([&] { return cm.all_gather_single(view(o.at(0)), view(i.at(0)), opts); });
  if (method == "reduce_scatter_single")
    return run([&] { return cm.reduce_scatter_single(view(o.at(0)), view(i.at(0)), red(), opts); });
  if (method == "all_to_all_single")
    return run([&] { return cm.all_to_all_single(view(o.at(0)), view(i.at(0)), opts); });
  if (method == "all_to_all_v_single") {  // ints: how many output splits, they, the input splits
    const auto half = static_cast<std::ptrdiff_t>(n.at(0));
    FASTCOMMS_CHECK(half >= 0 && half < static_cast<std::ptrdiff_t>(n.size()), kInternal,
                    "comm_call_: all_to_all_v_single's ints do not hold ", half, " output splits");
    const std::vector<int64_t> outs(n.begin() + 1, n.begin() + 1 + half),
        ins(n.begin() + 1 + half, n.end());
    return run(
        [&] { return cm.all_to_all_v_single(view(o.at(0)), view(i.at(0)), outs, ins, opts); });
  }
  if (method == "all_gather" || method == "all_gather_v") {
    const bool v = method == "all_gather_v";
    return run([&] {
      return v ? cm.all_gather_v(views(o), view(i.at(0)), opts)
               : cm.all_gather(views(o), view(i.at(0)), opts);
    });
  }
  if (method == "reduce_scatter" || method == "reduce_scatter_v") {
    const bool v = method == "reduce_scatter_v";
    return run([&] {
      return v ? cm.reduce_scatter_v(view(o.at(0)), views(i), red(), opts)
               : cm.reduce_scatter(view(o.at(0)), views(i), red(), opts);
    });
  }
  if (method == "all_to_all") return run([&] { return cm.all_to_all(views(o), views(i), opts); });
  return std::nullopt;
}

// NOTE [errors through torch's dispatcher]: the kernel runs under torch's entry points (torch.ops,
// compiled code), which turn a C++ exception into a Python one with torch's own translator and
// pybind11 translators, not ours: a fastcomms::Error became a plain RuntimeError under torch
// 2.15. Errors leave the kernel as torch's python_error holding the exact Python exception (NOTE
// [error mapping]), which every torch restores as it is, so a compiled call raises what the eager
// call raises.
template <typename Fn>
void python_errors(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    py::gil_scoped_acquire gil;
    set_python_error(e);
    python_error err;
    err.persist();
    throw err;
  } catch (py::error_already_set& e) {
    py::gil_scoped_acquire gil;
    e.restore();
    python_error err;
    err.persist();
    throw err;
  }
}

// comm_call_(Tensor order, PyObject comm, str method, Tensor(a!)[] mutated, Tensor[] inputs,
// SymInt[] ints, float[] floats, str hints, float timeout_s, bool async_op) -> (Tensor, Tensor)
void comm_call_body(torch::jit::Stack* stack);
void comm_call_kernel(const c10::OperatorHandle& /*op*/, torch::jit::Stack* stack) {
  python_errors([stack] { comm_call_body(stack); });
}

void comm_call_body(torch::jit::Stack* stack) {
  constexpr size_t kArgs = 10;
  const auto a = torch::jit::last(stack, kArgs);
  const at::Tensor order = a[0].toTensor();
  const std::string method = a[2].toStringRef();
  const std::vector<at::Tensor> mutated = a[3].toTensorVector();
  const std::vector<at::Tensor> inputs = a[4].toTensorVector();
  const bool plain = a[7].toStringRef().empty() && a[8].toDouble() < 0 && !a[9].toBool();
  py::gil_scoped_acquire gil;
  const py::handle comm(a[1].toPyObject());
  PyComm* c = nullptr;
  if (plain && !mutated.empty()) {
    const py::object fast = comm.attr("_fast");
    if (!fast.is_none()) c = fast.cast<PyComm*>();
  }
  std::optional<PyWork> issued;
  if (c != nullptr) {
    std::vector<int64_t> n = a[5].toIntVector();
    std::vector<double> f = a[6].toDoubleVector();
    if (!n.empty() && !f.empty()) {  // (always: each list ends with a pad, dropped here;
      n.pop_back();                  // NOTE [compiled communicator methods], "Kept")
      f.pop_back();
      issued = compiled_issue(*c, method, mutated, inputs, n, f);
    }
  }
  if (!issued) {  // the Python kernel
    py::object res = (*comm_call_python)(order, comm, method, mutated, inputs, a[5].toIntVector(),
                                         a[6].toDoubleVector(), a[7].toStringRef(), a[8].toDouble(),
                                         a[9].toBool());
    auto [token, done] = res.cast<std::tuple<at::Tensor, at::Tensor>>();
    torch::jit::drop(stack, kArgs);
    torch::jit::push(stack, std::move(token), std::move(done));
    return;
  }
  compiled_fast_calls.fetch_add(1, std::memory_order_relaxed);
  issued.reset();  // a synchronous call's work: dropped as the eager method's TorchWork is
  for (const auto& t : mutated) torch::autograd::increment_version(t);
  torch::jit::drop(stack, kArgs);
  torch::jit::push(stack, at::empty({0}, order.options()), at::empty({0}, order.options()));
}
}  // namespace

void bind_compiled(py::module_& m) {
  // NOTE [compiled calls in C++]: called by _compiled.py after it defines the op
  m.def(
      "_register_comm_call",
      [](py::object python_kernel) {
        if (comm_call_python != nullptr) {  // _compiled run again (after a failed import)
          *comm_call_python = std::move(python_kernel);
          return;
        }
        comm_call_python = new py::object(std::move(python_kernel));  // kept for the process
        static auto* lib =
            new torch::Library(torch::Library::IMPL, "fastcomms",
                               c10::DispatchKey::CompositeExplicitAutograd, __FILE__, __LINE__);
        lib->impl("comm_call_", torch::CppFunction::makeFromBoxedFunction<&comm_call_kernel>());
      },
      "Registers comm_call_'s kernel (NOTE [compiled calls in C++])");
  m.def(
      "_compiled_fast_calls", [] { return compiled_fast_calls.load(); },
      "Compiled communicator calls comm_call_'s C++ kernel ran itself");
}

}  // namespace fastcomms::python
