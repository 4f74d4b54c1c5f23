// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The Python binding: the only translation unit that includes torch. Tensors become non-owning
// TensorViews; every Work returned to Python keeps its tensors alive until it completes; C++
// errors map to Python exceptions here, in one place.
#include <atomic>
#include <variant>

#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>
#include <torch/library.h>
#include <torch/version.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include "binding.hpp"
#include "fast_ops.hpp"
#include "fastcomms/core/auth_store.hpp"
#include "fastcomms/core/communicator.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/core/window.hpp"
#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/fp8.hpp"
#include "fastcomms/ulysses/hierarchical.hpp"
#include "fastcomms/ulysses/transport.hpp"
#include "python_state.hpp"

#include <ATen/core/stack.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/VariableTypeUtils.h>
#ifdef FASTCOMMS_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;
using namespace fastcomms;

namespace {

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kFloat:
      return DType::kFloat32;
    case at::kDouble:
      return DType::kFloat64;
    case at::kFloat8_e4m3fn:
      return DType::kFloat8E4M3FN;
    case at::kFloat8_e5m2:
      return DType::kFloat8E5M2;
    case at::kChar:
      return DType::kInt8;
    case at::kByte:
      return DType::kUInt8;
    case at::kInt:
      return DType::kInt32;
    case at::kLong:
      return DType::kInt64;
    case at::kBool:
      return DType::kBool;
    default:
      throw Error(ErrorCode::kTypeError,
                  std::string("fastcomms: a tensor of dtype ") + c10::toString(t) +
                      " cannot be communicated; expected one of float16, bfloat16, float32, "
                      "float64, float8_e4m3fn, float8_e5m2, int8, uint8, int32, int64, bool "
                      "(a complex tensor can travel as torch.view_as_real(t))");
  }
}

}  // namespace

namespace fastcomms::python {

TensorView view(const at::Tensor& t) {
  // A meta, sparse or other non-memory tensor has no bytes to move: refuse it here, once, before
  // any pointer is read (data_ptr() of a meta tensor is null).
  FASTCOMMS_CHECK(t.layout() == at::kStrided, kInvalidArgument,
                  "fastcomms: tensors must be dense (strided layout), got a tensor of layout ",
                  c10::toString(t.layout()), " with shape ", t.sizes());
  FASTCOMMS_CHECK(t.is_cpu() || t.is_cuda(), kInvalidArgument,
                  "fastcomms: tensors must live on cpu or cuda, got a ", t.device().str(),
                  " tensor of shape ", t.sizes(),
                  t.is_meta() ? " (meta tensors carry no data; use a FakeTensor mode or "
                                "torch.compile to trace shapes)"
                              : "");
  TensorView v;
  // An empty tensor's data_ptr() is null; its storage still says where it lives (an empty
  // empty_output() buffer must still be recognised as the window it is).
  v.data = t.numel() == 0 && t.has_storage() && t.storage().data() != nullptr
               ? static_cast<char*>(const_cast<void*>(t.storage().data())) +
                     t.storage_offset() * static_cast<int64_t>(t.itemsize())
               : t.data_ptr();
  v.dtype = to_dtype(t.scalar_type());
  v.shape.assign(t.sizes().begin(), t.sizes().end());
  v.strides.assign(t.strides().begin(), t.strides().end());
  v.device = t.is_cuda() ? Device{DeviceType::kCUDA, t.device().index()} : Device{};
  return v;
}

at::ScalarType to_scalar_type(DType d) {
  switch (d) {
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat64:
      return at::kDouble;
    case DType::kFloat8E4M3FN:
      return at::kFloat8_e4m3fn;
    case DType::kFloat8E5M2:
      return at::kFloat8_e5m2;
    case DType::kInt8:
      return at::kChar;
    case DType::kUInt8:
      return at::kByte;
    case DType::kInt32:
      return at::kInt;
    case DType::kInt64:
      return at::kLong;
    case DType::kBool:
      return at::kBool;
  }
  throw Error(ErrorCode::kInternal, "fastcomms: a dtype without a torch counterpart");
}

}  // namespace fastcomms::python

namespace {
using python::view;

std::vector<TensorView> views(const std::vector<at::Tensor>& ts) {
  std::vector<TensorView> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(view(t));
  return out;
}

#ifdef FASTCOMMS_WITH_CUDA
// NOTE [torch streams through c10]: the binding reaches torch's CUDA streams and events through
// c10's device-generic interface (the implementation libtorch_cuda registers for DeviceType::CUDA:
// c10::Stream, c10::Event, c10::DeviceGuard), so it includes no CUDA layer, neither ours nor
// torch's c10/cuda; its CUDA runtime calls are cudaGetDeviceCount and cudaStreamIsCapturing. A
// CUDA tensor exists only where torch registered its real CUDA implementation.
bool torch_has_cuda() { return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA); }

// The caller's current torch stream on CUDA device `d`.
c10::Stream torch_current_stream(c10::DeviceIndex d) {
  return c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)
      ->getStream(c10::Device(c10::DeviceType::CUDA, d));
}
#endif

}  // namespace

namespace fastcomms::python {
// The caller's current torch stream on `d` (a cudaStream_t), or null for CPU.
void* current_stream(const Device& d) {
#ifdef FASTCOMMS_WITH_CUDA
  if (d.type == DeviceType::kCUDA)
    return torch_current_stream(static_cast<c10::DeviceIndex>(d.index)).native_handle();
#endif
  (void)d;
  return nullptr;
}
}  // namespace fastcomms::python

namespace {
using python::current_stream;

// A torch.distributed.Store (any Python object with its methods) as a fastcomms Store.
class PyStore : public Store {
 public:
  explicit PyStore(py::object store) : store_(std::move(store)) {}
  ~PyStore() override {
    if (!python::usable()) {  // the interpreter is finalizing: left to the exiting process
      store_.release();
      return;
    }
    py::gil_scoped_acquire gil;
    store_ = py::object();
  }
  void set(const std::string& key, const std::vector<uint8_t>& value) override {
    py::gil_scoped_acquire gil;
    store_.attr("set")(key, py::bytes(reinterpret_cast<const char*>(value.data()), value.size()));
  }
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override {
    wait({key}, timeout);
    py::gil_scoped_acquire gil;
    const std::string v = store_.attr("get")(key).cast<std::string>();
    return std::vector<uint8_t>(v.begin(), v.end());
  }
  int64_t add(const std::string& key, int64_t delta) override {
    py::gil_scoped_acquire gil;
    return store_.attr("add")(key, delta).cast<int64_t>();
  }
  bool check(const std::vector<std::string>& keys) override {
    py::gil_scoped_acquire gil;
    return store_.attr("check")(keys).cast<bool>();
  }
  bool delete_key(const std::string& key) override {
    py::gil_scoped_acquire gil;
    return store_.attr("delete_key")(key).cast<bool>();
  }

 private:
  py::object store_;
};

// NOTE [python tensors outlive their op]: an op's tensors stay referenced until the op is
// complete, whatever Python drops. They are released on a Python thread only: a tensor whose
// Python object died while C++ still held it is released through the interpreter (with the GIL),
// which a backend's worker thread must never need (a communicator's destructor joins that thread
// with the GIL held). So a dropped, unfinished PyWork parks its tensors here, and calls from
// Python release the finished ones. Internal buffers ride on the C++ Work instead (NOTE [work
// keeps its buffers]). Never destroyed: nothing is released after the interpreter is gone.
struct Parked {
  WorkPtr work;
  std::vector<at::Tensor> keep;
};
std::vector<Parked>& parked() {
  static auto* v = new std::vector<Parked>;  // guarded by the GIL
  return *v;
}

bool capturing() {
#ifdef FASTCOMMS_WITH_CUDA
  // Querying an event while a stream of this thread captures a CUDA graph would invalidate it.
  // The devices are counted by the CUDA runtime, not through c10: where no GPU is present torch
  // may install a fake CUDA guard (c10::impl::ensureCUDADeviceGuardSet, seen under
  // torch.compile on CPU) that counts devices but has no streams ("Backend doesn't support
  // getting stream native handle" from every op once a work was parked).
  static const int n = [] {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
      (void)cudaGetLastError();
      return 0;
    }
    return count;
  }();
  if (n == 0 || !torch_has_cuda()) return false;
  for (c10::DeviceIndex d = 0; d < n; ++d) {
    cudaStreamCaptureStatus s = cudaStreamCaptureStatusNone;
    auto stream = static_cast<cudaStream_t>(torch_current_stream(d).native_handle());
    if (cudaStreamIsCapturing(stream, &s) == cudaSuccess && s != cudaStreamCaptureStatusNone)
      return true;
  }
#endif
  return false;
}

// Releases the tensors of parked ops that have finished (GIL held).
void release_parked() {
  auto& v = parked();
  if (v.empty() || capturing()) return;
  std::erase_if(v, [](const Parked& p) { return p.work->tensors_released(); });
}

}  // namespace

// NOTE [python tensors outlive their op]: for the other translation units of the module.
void python::release_finished() { release_parked(); }

namespace {

// A Work from Python, with the tensors its op uses.
struct PyWork {
  WorkPtr work;
  std::vector<at::Tensor> keep;
  // NOTE [process abort]: set where the communicator aborts the process on an op's error
  std::shared_ptr<ProcessAbort> abort_on_error;
  PyWork(WorkPtr w, std::vector<at::Tensor> k) : work(std::move(w)), keep(std::move(k)) {}
  PyWork(PyWork&&) = default;
  PyWork& operator=(PyWork&&) = default;
  // No status query here: this may run while a stream captures a CUDA graph, where querying
  // an event would invalidate the capture; release_parked() checks later, outside captures.
  ~PyWork() {
    if (work && !keep.empty()) parked().push_back({std::move(work), std::move(keep)});
  }
  void wait() {
    py::gil_scoped_release release;  // also lets the abort hooks take the GIL
    try {
      work->wait();
    } catch (const Error& e) {
      if (abort_on_error && ProcessAbort::applies(e.code()))
        abort_on_error->abort_process(e.what());
      throw;
    }
  }
};

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
  template <typename Fn>
  PyWork run(std::vector<at::Tensor> keep, Fn&& fn) {
    WorkPtr w;
    {
      py::gil_scoped_release release;
      w = fn();
    }
    release_parked();
    PyWork pw(std::move(w), std::move(keep));
    pw.abort_on_error = comm->process_abort_on_error();
    return pw;
  }
};

ReduceOp to_op(RedOpType t, double factor) { return ReduceOp{t, factor}; }

// NOTE [device factor]: PREMUL_SUM's factor as Python passes it, a number or a one-element tensor.
using Factor = std::variant<double, at::Tensor>;

// The op for reducing `like`; a tensor factor is read where the op runs. A floating factor of
// another dtype is cast to `like`'s on the caller's stream (a kernel, no host sync; the op's
// stream waits on the caller's), and a CUDA factor for a CPU op is copied to the host, as
// torchcomms' gloo does. The tensor the op reads goes into `keep`, held for the op.
ReduceOp to_op(RedOpType t, const Factor& f, const at::Tensor& like,
               std::vector<at::Tensor>& keep) {
  if (const double* d = std::get_if<double>(&f)) return ReduceOp{t, *d};
  at::Tensor x = std::get<at::Tensor>(f);
  if (t != RedOpType::kPremulSum) return ReduceOp{t};
  if (like.is_cpu() && x.is_cuda()) x = x.cpu();
  if (x.is_floating_point() && x.scalar_type() != like.scalar_type() && x.device() == like.device())
    x = x.to(like.scalar_type());
  keep.push_back(x);
  return ReduceOp::premul_sum(view(x));
}

UlyssesArgs ulysses_args(int mode, std::optional<std::vector<int64_t>> seq,
                         std::optional<std::vector<int64_t>> heads, int64_t kv_replicas,
                         bool async_op = false) {
  UlyssesArgs a;
  a.mode = mode;
  a.kv_replicas = kv_replicas;
  a.seq_splits = std::move(seq);
  a.head_splits = std::move(heads);
  a.async_op = async_op;
  return a;
}

std::array<int64_t, 4> shape4(const std::vector<int64_t>& shape) {
  FASTCOMMS_CHECK(shape.size() == 4, kInvalidArgument,
                  "all_to_all_4d: x must be 4-D (b, s, h, d), got ", shape.size(), " dims");
  return {shape[0], shape[1], shape[2], shape[3]};
}

using python::PyTransport;

// One Ulysses call on `stream` (default: the caller's current torch stream of x's device), the
// GIL released while it is issued; the Work keeps x and out.
PyWork transport_call(UlyssesTransport& tr, const at::Tensor& x, const at::Tensor& out,
                      const UlyssesArgs& args, std::optional<void*> stream = std::nullopt) {
  const TensorView xv = view(x), ov = view(out);
  const auto on = stream ? *stream : current_stream(xv.device);
  WorkPtr w;
  {
    py::gil_scoped_release release;
    w = tr.all_to_all_4d(xv, ov, args, on);
  }
  release_parked();
  return PyWork(std::move(w), {x, out});
}

// A window from Python (fastcomms.TorchCommWindow); ops enqueue on the caller's current torch
// stream; map_remote tensors keep the window alive.
struct PyWindow {
  std::shared_ptr<Window> w;
  Device device;
};
}  // namespace
// For other binding files (bind_device_window.cpp): the C++ window behind a fastcomms._C.Window.
std::shared_ptr<Window> fastcomms::python::window_of(const py::object& w) {
  return w.cast<PyWindow&>().w;
}
namespace {

#ifdef FASTCOMMS_WITH_CUDA
// NOTE [async result waits]: the work torch's registry holds for an AsyncCollectiveTensor of
// an async Ulysses call, recording an event on the comm stream after the call.
// blockCurrentStream() makes the calling thread's current stream wait for it (no host block);
// wait() does too, after waiting for the event on the host, so it is right from whichever
// thread torch calls it. A Python Work subclass cannot override blockCurrentStream, whose
// default calls wait() on another thread, so this one is C++.
class StreamEventWork final : public c10d::Work {
 public:
  explicit StreamEventWork(c10::Event ev) : ev_(std::move(ev)) {}
  bool wait(std::chrono::milliseconds) override {
    if (PyGILState_Check()) {  // the host wait must not hold the interpreter
      py::gil_scoped_release release;
      ev_.synchronize();
    } else {
      ev_.synchronize();
    }
    order();
    return true;
  }
  void blockCurrentStream() override { order(); }
  bool isCompleted() override { return ev_.query(); }

 private:
  void order() { ev_.block(torch_current_stream(ev_.device_index())); }
  c10::Event ev_;
};

// The c10::Stream of a torch.Stream from Python (torch.cuda.Stream among them): its stream_id,
// device_index and device_type.
c10::Stream torch_stream(const py::handle& s) {
  return c10::Stream::unpack3(s.attr("stream_id").cast<int64_t>(),
                              static_cast<c10::DeviceIndex>(s.attr("device_index").cast<int64_t>()),
                              static_cast<c10::DeviceType>(s.attr("device_type").cast<int64_t>()));
}

void register_stream_completion(const at::Tensor& t, const c10::Stream& stream) {
  FASTCOMMS_CHECK(t.is_cuda(), kInvalidArgument, "_register_stream_completion: a CUDA tensor");
  c10::Event ev(c10::DeviceType::CUDA);
  ev.record(stream);
  c10d::register_work(t, c10::make_intrusive<StreamEventWork>(std::move(ev)));
}

// `side` starts after the work the caller's current stream holds so far.
void order_after_current(c10::DeviceIndex device, const c10::Stream& side) {
  c10::Event ev(c10::DeviceType::CUDA);  // released once the wait is done with it
  ev.record(torch_current_stream(device));
  ev.block(side);
}
#endif

// NOTE [error mapping]: set by the module's init, used by its exception translator and the
// process group fast path (the one mapping of C++ errors to Python exceptions).
void (*set_python_error)(const Error& e) = nullptr;

}  // namespace

// NOTE [process group fast path] (src/fast_ops.hpp): the work the c10d backend holds.
namespace fastcomms::python {
struct FastWork {
  PyWork pw;
};
}  // namespace fastcomms::python
namespace {

// torch's reduction as ours (the backend passes every kind but UNUSED).
RedOpType fast_red(c10d::ReduceOp::RedOpType r) {
  switch (r) {
    case c10d::ReduceOp::AVG:
      return RedOpType::kAvg;
    case c10d::ReduceOp::PRODUCT:
      return RedOpType::kProduct;
    case c10d::ReduceOp::MIN:
      return RedOpType::kMin;
    case c10d::ReduceOp::MAX:
      return RedOpType::kMax;
    case c10d::ReduceOp::BAND:
      return RedOpType::kBand;
    case c10d::ReduceOp::BOR:
      return RedOpType::kBor;
    case c10d::ReduceOp::BXOR:
      return RedOpType::kBxor;
    case c10d::ReduceOp::PREMUL_SUM:
      return RedOpType::kPremulSum;
    default:
      return RedOpType::kSum;
  }
}

// Ops issued through the fast path (the tests check which path a call took).
std::atomic<uint64_t> fast_calls{0};

python::FastWork* fast_issue(void* comm, python::FastOp op, const at::Tensor& a,
                             const at::Tensor& b, c10d::ReduceOp::RedOpType red, double factor) {
  PyComm& c = *static_cast<PyComm*>(comm);
  const auto o = [&c] { return c.opts(true, std::nullopt, std::nullopt); };
  fast_calls.fetch_add(1, std::memory_order_relaxed);
  try {
    switch (op) {
      case python::FastOp::kAllReduce:
        return new python::FastWork{c.run(
            {a}, [&] { return c.comm->all_reduce(view(a), to_op(fast_red(red), factor), o()); })};
      case python::FastOp::kAllGatherSingle:
        return new python::FastWork{
            c.run({a, b}, [&] { return c.comm->all_gather_single(view(a), view(b), o()); })};
      case python::FastOp::kReduceScatterSingle:
        return new python::FastWork{c.run({a, b}, [&] {
          return c.comm->reduce_scatter_single(view(a), view(b), to_op(fast_red(red), factor), o());
        })};
      case python::FastOp::kAllToAllSingle:
        return new python::FastWork{
            c.run({a, b}, [&] { return c.comm->all_to_all_single(view(a), view(b), o()); })};
    }
    PyErr_SetString(PyExc_RuntimeError, "fastcomms: unknown fast-path op");
  } catch (const Error& e) {
    set_python_error(e);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

bool fast_wait(python::FastWork* w, python::FastError* err) {
  try {
    w->pw.work->wait();
    return true;
  } catch (const Error& e) {
    if (w->pw.abort_on_error && ProcessAbort::applies(e.code()))
      w->pw.abort_on_error->abort_process(e.what());  // NOTE [process abort], as PyWork::wait
    err->code = static_cast<int>(e.code());
    err->message = e.what();
  } catch (const std::exception& e) {
    err->code = -1;
    err->message = e.what();
  }
  return false;
}

// NOTE [compiled calls in C++]: the kernel of ``fastcomms::comm_call_``, the node a compiled
// communicator call becomes (NOTE [compiled communicator methods], _compiled.py). A call that
// needs nothing of Python (a C++ communicator without Python hooks or observers: its
// ``TorchComm._fast`` is set, NOTE [process group fast path]; synchronous; no per-call hints or
// timeout; one of the methods below) runs here, on the C++ communicator, as the eager method's
// own binding runs it (same checks, errors and parked tensors). Every other call goes to the
// Python kernel, ``_compiled._comm_call_``. A Python kernel behind the dispatcher cost about as
// much again as the eager call itself (the 2-core CPU machine: 70 against 22 us;
// docs/benchmarks.md).
std::atomic<uint64_t> compiled_fast_calls{0};
py::object* comm_call_python = nullptr;  // _compiled._comm_call_ (kept for the process)

// The eager method's C++ call for `method` (its tensors as the compiled call passes them: the
// written, the read; its integers and floats without their pad), or nullopt where this kernel
// does not run that method.
std::optional<PyWork> compiled_issue(PyComm& c, const std::string& method,
                                     const std::vector<at::Tensor>& o,
                                     const std::vector<at::Tensor>& i,
                                     const std::vector<int64_t>& n, const std::vector<double>& f) {
  const CallOptions opts = c.opts(false, std::nullopt, std::nullopt);
  const auto red = [&] { return to_op(static_cast<RedOpType>(n.at(0)), f.at(0)); };
  const auto peer = [&](size_t k) { return static_cast<int>(n.at(k)); };  // a root or a source
  std::vector<at::Tensor> keep = o;
  keep.insert(keep.end(), i.begin(), i.end());
  const auto run = [&](auto&& fn) -> std::optional<PyWork> { return c.run(keep, fn); };
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
  if (method == "all_to_all_v_single") {  // ints: the output splits, then the input splits
    const auto half = static_cast<std::ptrdiff_t>(n.size() / 2);
    const std::vector<int64_t> outs(n.begin(), n.begin() + half), ins(n.begin() + half, n.end());
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
// pybind11, not ours: a fastcomms::Error became a plain RuntimeError under torch 2.15, and a Python
// error raised by the Python kernel relies on the two pybind11 builds agreeing. Both leave the
// kernel as torch's python_error holding the exact Python exception (NOTE [error mapping]), which
// every torch restores as it is, so a compiled call raises what the eager call raises.
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
    if (!fast.is_none()) c = fast.cast<py::capsule>().get_pointer<PyComm>();
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

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcomms C++ core (internal; use the fastcomms package)";

  // NOTE [error mapping]: the one place C++ errors become Python exceptions.
  static py::exception<Error> aborted_error(m, "AbortedError", PyExc_RuntimeError);
  static py::exception<Error> backend_error(m, "BackendError", PyExc_RuntimeError);
  static py::exception<Error> unsupported_error(m, "UnsupportedError", PyExc_RuntimeError);
  // Argument, type and timeout errors are ValueError / TypeError / TimeoutError as Python code
  // expects, and RuntimeError too, as torchcomms raises (its C++ throws std::runtime_error), so
  // code written against either catches them. They keep the builtin names (fastcomms._C.ValueError
  // ...), so a traceback or a check of the class name reads as before.
  auto both = [&m](const char* name, PyObject* base) {
    py::object cls = py::reinterpret_steal<py::object>(PyErr_NewException(
        (std::string("fastcomms._C.") + name).c_str(),
        py::make_tuple(py::handle(base), py::handle(PyExc_RuntimeError)).ptr(), nullptr));
    m.attr(name) = cls;
    return cls.release().ptr();  // kept for the process's lifetime, as the module keeps it
  };
  static PyObject* invalid_argument = both("ValueError", PyExc_ValueError);
  static PyObject* type_error = both("TypeError", PyExc_TypeError);
  static PyObject* timeout_error = both("TimeoutError", PyExc_TimeoutError);
  set_python_error = [](const Error& e) {
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
        py::set_error(aborted_error, e.what());
        return;
      case ErrorCode::kUnsupported:
        py::set_error(unsupported_error, e.what());
        return;
      default:
        py::set_error(backend_error, e.what());
        return;
    }
  };
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
  // NOTE [process group fast path] (src/fast_ops.hpp)
  static const python::FastOps fast_ops = [] {
    python::FastOps o;
    o.issue = &fast_issue;
    o.wait = &fast_wait;
    o.completed = [](python::FastWork* w) { return w->pw.work->is_completed(); };
    o.release = [](python::FastWork* w) { delete w; };
    o.set_error = [](const python::FastError& e) {
      if (e.code < 0)
        PyErr_SetString(PyExc_RuntimeError, e.message.c_str());
      else
        set_python_error(Error(static_cast<ErrorCode>(e.code), e.message));
    };
    return o;
  }();
  m.attr("_fast_ops") = py::capsule(&fast_ops, python::kFastOpsCapsule);
  m.def(
      "_fast_calls", [] { return fast_calls.load(); }, "Ops the process group fast path issued");
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

  py::enum_<RedOpType>(m, "RedOpType")
      .value("SUM", RedOpType::kSum)
      .value("PRODUCT", RedOpType::kProduct)
      .value("MIN", RedOpType::kMin)
      .value("MAX", RedOpType::kMax)
      .value("BAND", RedOpType::kBand)
      .value("BOR", RedOpType::kBor)
      .value("BXOR", RedOpType::kBxor)
      .value("AVG", RedOpType::kAvg)
      .value("PREMUL_SUM", RedOpType::kPremulSum);
  py::enum_<WorkStatus>(m, "WorkStatus")
      .value("NOT_STARTED", WorkStatus::kNotStarted)
      .value("INPROGRESS", WorkStatus::kInProgress)
      .value("COMPLETED", WorkStatus::kCompleted)
      .value("TIMEDOUT", WorkStatus::kTimedOut)
      .value("ERROR", WorkStatus::kError);

  py::class_<PyWork>(m, "Work")
      .def("wait", &PyWork::wait)
      .def("is_completed", [](const PyWork& w) { return w.work->is_completed(); })
      .def("status", [](const PyWork& w) { return w.work->status(); })
      // The transport is done with the op's tensors and buffers (NOTE [dropped async results]);
      // a CPU Ulysses call may still have its unpack to run in wait().
      .def("_tensors_released", [](const PyWork& w) { return w.work->tensors_released(); });

  m.def("is_backend_built", &is_backend_registered);
  m.def("built_backends", &registered_backends);
  // NVML's answer pair by pair, or (None, why) when it cannot answer (never a guess).
  m.def("nvlink_matrix", [](const std::vector<int>& devices) {
    py::gil_scoped_release release;
    return nvlink_matrix(devices);
  });
  m.def("nvlink_decision", &nvlink_decision, py::arg("who"), py::arg("probe"));
  m.def("has_transport", &has_transport);
  // The geometry of a call from shapes alone (fake tensors, the torch.distributed path):
  // (out_shape, seq_splits, head_splits, max_out_bytes), validated like the call.
#ifdef FASTCOMMS_WITH_CUDA
  // NOTE [async result waits] (StreamEventWork above), for the Python async paths
  m.def("_register_stream_completion", [](const at::Tensor& t, py::handle stream) {
    register_stream_completion(t, torch_stream(stream));
  });
#endif
  m.attr("__version__") = FASTCOMMS_VERSION;  // the VERSION file, through CMake
  m.def("build_info", [] {
    py::dict d;
    d["version"] = FASTCOMMS_VERSION;
    d["torch"] = TORCH_VERSION;  // torch/version.h of the torch built against
    d["cuda"] = FASTCOMMS_BUILD_CUDA;
    d["cuda_archs"] = FASTCOMMS_BUILD_CUDA_ARCHS;
    d["nccl"] = FASTCOMMS_BUILD_NCCL;
    return d;
  });
  // NOTE [authenticated rendezvous]: the store wrapper, for the tests' forged-value checks.
  m.def("_auth_store_set",
        [](py::object store, const std::string& secret, const std::string& key, py::bytes value) {
          const std::string v = value;
          AuthStore(std::make_shared<PyStore>(std::move(store)), secret)
              .set(key, std::vector<uint8_t>(v.begin(), v.end()));
        });
  m.def("_auth_store_get", [](py::object store, const std::string& secret, const std::string& key) {
    const auto v = AuthStore(std::make_shared<PyStore>(std::move(store)), secret).get(key);
    return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
  });
  m.def(
      "ulysses_geometry",
      [](const std::vector<int64_t>& shape, int64_t element_size, int mode,
         std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads,
         int rank, int size, int64_t kv_replicas) {
        const auto p = plan::make_ulysses_plan(ulysses_request(
            shape4(shape), element_size, ulysses_args(mode, seq, heads, kv_replicas), rank, size,
            "ulysses", plan::Path::kCollective));
        return py::make_tuple(std::vector<int64_t>(p.out_shape.begin(), p.out_shape.end()),
                              p.seq_splits, p.head_splits, p.max_out_bytes);
      },
      py::arg("shape"), py::arg("element_size"), py::arg("mode"), py::arg("seq"), py::arg("heads"),
      py::arg("rank"), py::arg("size"), py::arg("kv_replicas") = 1);

  py::class_<PyTransport>(m, "UlyssesTransport")
      .def_property_readonly("kind", [](const PyTransport& t) { return t.get().kind(); })
      .def(
          "output_shape",
          [](const PyTransport& t, const std::vector<int64_t>& shape, int64_t element_size,
             int mode, std::optional<std::vector<int64_t>> seq,
             std::optional<std::vector<int64_t>> heads, int64_t kv_replicas) {
            const auto o = t.get().output_shape(shape4(shape), element_size,
                                                ulysses_args(mode, seq, heads, kv_replicas));
            return std::vector<int64_t>(o.begin(), o.end());
          },
          py::arg("shape"), py::arg("element_size"), py::arg("mode"), py::arg("seq"),
          py::arg("heads"), py::arg("kv_replicas") = 1)
      .def(
          "max_out_bytes",
          [](const PyTransport& t, const std::vector<int64_t>& shape, int64_t element_size,
             int mode, std::optional<std::vector<int64_t>> seq,
             std::optional<std::vector<int64_t>> heads, int64_t kv_replicas) {
            return t.get().max_out_bytes(shape4(shape), element_size,
                                         ulysses_args(mode, seq, heads, kv_replicas));
          },
          py::arg("shape"), py::arg("element_size"), py::arg("mode"), py::arg("seq"),
          py::arg("heads"), py::arg("kv_replicas") = 1)
      .def(
          "all_to_all_4d",
          [](const PyTransport& t, at::Tensor x, at::Tensor out, int mode,
             std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads,
             bool async_op, int64_t kv_replicas) {
            return transport_call(t.get(), x, out,
                                  ulysses_args(mode, seq, heads, kv_replicas, async_op));
          },
          py::arg("x"), py::arg("out"), py::arg("mode"), py::arg("seq"), py::arg("heads"),
          py::arg("async_op"), py::arg("kv_replicas") = 1)
#ifdef FASTCOMMS_WITH_CUDA
      // NOTE [host cost per call]: an async CUDA call in one step: `side` waits for the caller's
      // current stream, x and out are recorded as used there (the caching allocator keeps them
      // until it is done), the call runs on `side`, and its completion is registered with
      // torch's work registry for out (NOTE [async result waits]).
      .def(
          "all_to_all_4d_on",
          [](const PyTransport& t, at::Tensor x, at::Tensor out, py::handle side, int mode,
             std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads,
             int64_t kv_replicas) {
            UlyssesTransport& tr = t.get();
            FASTCOMMS_CHECK(x.is_cuda() && out.is_cuda() && x.device() == out.device(),
                            kInvalidArgument,
                            "all_to_all_4d_async: the async CUDA call needs x and out on one "
                            "CUDA device, got ",
                            x.device().str(), " and ", out.device().str());
            const c10::Stream s = torch_stream(side);
            FASTCOMMS_CHECK(s.device() == x.device(), kInvalidArgument,
                            "all_to_all_4d_async: the side stream is on ", s.device().str(),
                            ", x on ", x.device().str());
            c10::DeviceGuard guard(x.device());
            order_after_current(x.device().index(), s);
            x.record_stream(s);
            out.record_stream(s);
            PyWork w = transport_call(tr, x, out, ulysses_args(mode, seq, heads, kv_replicas),
                                      s.native_handle());
            register_stream_completion(out, s);
            return w;
          },
          py::arg("x"), py::arg("out"), py::arg("side"), py::arg("mode"), py::arg("seq"),
          py::arg("heads"), py::arg("kv_replicas") = 1)
#endif
      .def("empty_output",
           [](const PyTransport& t, std::vector<int64_t> shape, int64_t bytes,
              at::Tensor like) -> std::optional<at::Tensor> {
             std::shared_ptr<void> buf;
             {
               py::gil_scoped_release release;
               buf = t.get().empty_output(bytes);
             }
             if (!buf) return std::nullopt;
             // The buffer lives on the transport's device (`like` gives the dtype only).
             FASTCOMMS_CHECK(t.device.type == DeviceType::kCUDA, kInternal,
                             "empty_output: a buffer from a transport without a CUDA device");
             return torch::from_blob(
                 buf.get(), shape, [buf](void*) {},
                 at::TensorOptions().dtype(like.scalar_type()).device(at::kCUDA, t.device.index));
           })
      .def("async_lane",
           [](const PyTransport& t) {
             py::gil_scoped_release release;
             return PyTransport{t.get().async_lane(), t.device};
           })
      .def("memory_stats",
           [](const PyTransport& t) {
             const UlyssesMemoryStats s = t.t ? t.t->memory_stats() : UlyssesMemoryStats{};
             return py::make_tuple(s.device_bytes, s.calls);
           })
      .def("check_errors", [](const PyTransport& t) { t.get().check_errors(); })
      .def("tune", [](const PyTransport& t, const std::string& knob,
                      const std::string& value) { t.get().tune(knob, value); })
      .def("destroy", [](PyTransport& t) {
        if (!t.t) return;
        py::gil_scoped_release release;
        t.t->destroy();
        t.t.reset();
      });

  py::class_<PyWindow>(m, "Window")
      .def("register_buffer",
           [](PyWindow& w, at::Tensor t) {
             void* p = t.data_ptr();
             const int64_t bytes = t.numel() * t.element_size();
             py::gil_scoped_release release;
             w.w->register_buffer(p, bytes);
           })
      .def("deregister",
           [](PyWindow& w) {
             py::gil_scoped_release release;
             w.w->deregister();
           })
      .def("bytes", [](const PyWindow& w) { return w.w->bytes(); })
      .def("put",
           [](PyWindow& w, at::Tensor src, int dst, int64_t offset_bytes) {
             w.w->put(src.data_ptr(), src.numel() * src.element_size(), dst, offset_bytes,
                      current_stream(w.device));
           })
      .def("signal", [](PyWindow& w, int peer) { w.w->signal(peer, current_stream(w.device)); })
      .def("wait_signal",
           [](PyWindow& w, int peer, int64_t timeout_ms) {
             w.w->wait_signal(peer, std::chrono::milliseconds(timeout_ms),
                              current_stream(w.device));
           })
      .def("check_errors", [](PyWindow& w) { w.w->check_errors(); })
      .def("remote", [](PyWindow& w, int q, std::vector<int64_t> shape, at::Tensor like) {
        void* p = w.w->remote(q);
        auto keep = w.w;
        return torch::from_blob(
            p, shape, [keep](void*) {},
            at::TensorOptions().dtype(like.scalar_type()).device(like.device()));
      });

  // NOTE [persistent all-gather]: the handle keeps its output tensor alive until freed.
  struct PyAllGatherP {
    std::shared_ptr<AllGatherP> h;
    at::Tensor output;
  };
  py::class_<PyAllGatherP>(m, "AllGatherP")
      .def("output", [](const PyAllGatherP& p) { return p.output; })
      .def("freed", [](const PyAllGatherP& p) { return p.h->freed(); })
      .def("registered", [](const PyAllGatherP& p) { return p.h->registered(); });

  using Ms = std::optional<std::chrono::milliseconds>;
  using H = std::optional<Hints>;
  py::class_<PyComm>(m, "Comm")
      .def(py::init([](const std::string& backend, int rank, int size, const std::string& device,
                       int device_index, py::object store, std::chrono::milliseconds timeout,
                       bool abort_process, const std::string& name, Hints hints) {
        CommOptions o;
        o.store = std::make_shared<PyStore>(std::move(store));
        o.timeout = timeout;
        o.abort_process_on_timeout_or_error = abort_process;
        o.name = name;
        o.hints = std::move(hints);
        const Device dev = device == "cuda" ? Device{DeviceType::kCUDA, device_index} : Device{};
        py::gil_scoped_release release;
        return PyComm{Communicator::create(backend, rank, size, dev, o)};
      }))
      // NOTE [process group fast path]: this communicator for fastcomms._c10d (not owned: the
      // TorchComm keeps this object, and the capsule, together)
      .def("_native", [](PyComm& c) { return py::capsule(&c, python::kFastCommCapsule); })
      .def("rank", [](const PyComm& c) { return c.comm->rank(); })
      .def("size", [](const PyComm& c) { return c.comm->size(); })
      .def("name", [](const PyComm& c) { return c.comm->name(); })
      .def("backend", [](const PyComm& c) { return c.comm->backend_name(); })
      .def("backend_version", [](const PyComm& c) { return c.comm->backend_version(); })
      .def("timeout", [](const PyComm& c) { return c.comm->options().timeout; })
      .def("hints", [](const PyComm& c) { return c.comm->options().hints; })
      .def("set_timeout", [](PyComm& c, std::chrono::milliseconds t) { c.comm->set_timeout(t); })
      .def("set_hints", [](PyComm& c, const Hints& h) { c.comm->set_hints(h); })
      .def("abort",
           [](PyComm& c) {
             py::gil_scoped_release release;
             c.comm->abort();
           })
      .def("is_aborted", [](const PyComm& c) { return c.comm->is_aborted(); })
      .def("finalize",
           [](PyComm& c) {
             py::gil_scoped_release release;
             c.comm->finalize();
           })
      .def("send",
           [](PyComm& c, at::Tensor t, int dst, bool a, Ms to, H h) {
             return c.run({t}, [&] { return c.comm->send(view(t), dst, c.opts(a, to, h)); });
           })
      .def("recv",
           [](PyComm& c, at::Tensor t, int src, bool a, Ms to, H h) {
             return c.run({t}, [&] { return c.comm->recv(view(t), src, c.opts(a, to, h)); });
           })
      .def("batch",
           [](PyComm& c, std::vector<std::tuple<bool, at::Tensor, int>> ops, bool a, Ms to, H h) {
             std::vector<P2POp> p;
             std::vector<at::Tensor> keep;
             for (auto& [is_send, t, peer] : ops) {
               p.push_back({is_send ? P2POp::Kind::kSend : P2POp::Kind::kRecv, view(t), peer});
               keep.push_back(t);
             }
             return c.run(keep, [&] { return c.comm->batch_p2p(p, c.opts(a, to, h)); });
           })
      .def("broadcast",
           [](PyComm& c, at::Tensor t, int root, bool a, Ms to, H h) {
             return c.run({t}, [&] { return c.comm->broadcast(view(t), root, c.opts(a, to, h)); });
           })
      .def("all_reduce",
           [](PyComm& c, at::Tensor t, RedOpType op, Factor f, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep{t};
             const ReduceOp r = to_op(op, f, t, keep);
             return c.run(keep, [&] { return c.comm->all_reduce(view(t), r, c.opts(a, to, h)); });
           })
      .def("reduce",
           [](PyComm& c, at::Tensor t, int root, RedOpType op, Factor f, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep{t};
             const ReduceOp r = to_op(op, f, t, keep);
             return c.run(keep, [&] { return c.comm->reduce(view(t), root, r, c.opts(a, to, h)); });
           })
      .def("all_gather",
           [](PyComm& c, std::vector<at::Tensor> outs, at::Tensor in, bool v, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep = outs;
             keep.push_back(in);
             return c.run(keep, [&] {
               return v ? c.comm->all_gather_v(views(outs), view(in), c.opts(a, to, h))
                        : c.comm->all_gather(views(outs), view(in), c.opts(a, to, h));
             });
           })
      .def("all_gather_single",
           [](PyComm& c, at::Tensor out, at::Tensor in, bool a, Ms to, H h) {
             return c.run({out, in}, [&] {
               return c.comm->all_gather_single(view(out), view(in), c.opts(a, to, h));
             });
           })
      .def("reduce_scatter",
           [](PyComm& c, at::Tensor out, std::vector<at::Tensor> ins, RedOpType op, Factor f,
              bool v, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep = ins;
             keep.push_back(out);
             const ReduceOp r = to_op(op, f, out, keep);
             return c.run(keep, [&] {
               return v ? c.comm->reduce_scatter_v(view(out), views(ins), r, c.opts(a, to, h))
                        : c.comm->reduce_scatter(view(out), views(ins), r, c.opts(a, to, h));
             });
           })
      .def(
          "reduce_scatter_single",
          [](PyComm& c, at::Tensor out, at::Tensor in, RedOpType op, Factor f, bool a, Ms to, H h) {
            std::vector<at::Tensor> keep{out, in};
            const ReduceOp r = to_op(op, f, out, keep);
            return c.run(keep, [&] {
              return c.comm->reduce_scatter_single(view(out), view(in), r, c.opts(a, to, h));
            });
          })
      .def("all_to_all_single",
           [](PyComm& c, at::Tensor out, at::Tensor in, bool a, Ms to, H h) {
             return c.run({out, in}, [&] {
               return c.comm->all_to_all_single(view(out), view(in), c.opts(a, to, h));
             });
           })
      .def("all_to_all_v_single",
           [](PyComm& c, at::Tensor out, at::Tensor in, std::vector<int64_t> out_s,
              std::vector<int64_t> in_s, bool a, Ms to, H h) {
             return c.run({out, in}, [&] {
               return c.comm->all_to_all_v_single(view(out), view(in), out_s, in_s,
                                                  c.opts(a, to, h));
             });
           })
      .def("all_to_all",
           [](PyComm& c, std::vector<at::Tensor> outs, std::vector<at::Tensor> ins, bool a, Ms to,
              H h) {
             std::vector<at::Tensor> keep = outs;
             keep.insert(keep.end(), ins.begin(), ins.end());
             return c.run(keep, [&] {
               return c.comm->all_to_all(views(outs), views(ins), c.opts(a, to, h));
             });
           })
      .def("barrier",
           [](PyComm& c, bool a, Ms to, H h) {
             return c.run({}, [&] { return c.comm->barrier(c.opts(a, to, h)); });
           })
      .def(
          "scatter",
          [](PyComm& c, at::Tensor out, std::vector<at::Tensor> ins, int root, bool a, Ms to, H h) {
            std::vector<at::Tensor> keep = ins;
            keep.push_back(out);
            return c.run(keep, [&] {
              return c.comm->scatter(view(out), views(ins), root, c.opts(a, to, h));
            });
          })
      .def(
          "gather",
          [](PyComm& c, std::vector<at::Tensor> outs, at::Tensor in, int root, bool a, Ms to, H h) {
            std::vector<at::Tensor> keep = outs;
            keep.push_back(in);
            return c.run(keep, [&] {
              return c.comm->gather(views(outs), view(in), root, c.opts(a, to, h));
            });
          })
      .def("gather_single",
           [](PyComm& c, at::Tensor out, at::Tensor in, int root, bool a, Ms to, H h) {
             return c.run({out, in}, [&] {
               return c.comm->gather_single(view(out), view(in), root, c.opts(a, to, h));
             });
           })
      .def("split",
           [](PyComm& c, std::vector<int> ranks, const std::string& name,
              std::optional<std::chrono::milliseconds> timeout,
              std::optional<Hints> hints) -> std::optional<PyComm> {
             CommOptions o = c.comm->options();
             if (timeout) o.timeout = *timeout;
             if (hints) o.hints = *hints;
             std::shared_ptr<Communicator> sub;
             {
               py::gil_scoped_release release;
               sub = c.comm->split(ranks, name, &o);
             }
             if (!sub) return std::nullopt;
             return PyComm{sub};
           })
      .def("register_pre_hook",
           [](PyComm& c, py::function fn) {
             auto h =
                 std::make_shared<RemovableHandle>(c.comm->register_pre_hook([fn](const OpInfo& i) {
                   py::gil_scoped_acquire gil;
                   fn(std::string(op_name(i.op)), i.op_id, i.async_op);
                 }));
             return py::cpp_function([h] { h->remove(); });
           })
      .def("register_post_hook",
           [](PyComm& c, py::function fn) {
             auto h = std::make_shared<RemovableHandle>(
                 c.comm->register_post_hook([fn](const OpInfo& i) {
                   py::gil_scoped_acquire gil;
                   fn(std::string(op_name(i.op)), i.op_id, i.async_op);
                 }));
             return py::cpp_function([h] { h->remove(); });
           })
      .def_static("next_op_id", &next_op_id)  // NOTE [op ids]: Python backends draw from it
      .def("register_abort_hook",
           [](PyComm& c, py::function fn) {
             auto h = std::make_shared<RemovableHandle>(c.comm->register_abort_hook([fn] {
               py::gil_scoped_acquire gil;
               fn();
             }));
             return py::cpp_function([h] { h->remove(); });
           })
      // torchcomms' TorchCommNCCL.get_nccl_comm_ptr(): the ncclComm_t as an int (0 once aborted
      // or finalized); nvlink gives its inner nccl communicator's. Other backends' objects have
      // no such attribute in torchcomms: AttributeError.
      .def("get_nccl_comm_ptr",
           [](PyComm& c) -> int64_t {
             const std::string b = c.comm->backend_name();
             if (b != "nccl" && b != "nvlink")
               throw py::attribute_error(fastcomms::detail::cat(
                   "[rank ", c.comm->rank(), "/", c.comm->size(), " ", c.comm->name(),
                   " get_nccl_comm_ptr] the '", b,
                   "' backend has no NCCL communicator: get_nccl_comm_ptr is an attribute of "
                   "the nccl backend's object (and nvlink's) only"));
             return reinterpret_cast<int64_t>(c.comm->lend(kLentNcclComm).get());
           })
      .def("tensor_register",
           [](PyComm& c, at::Tensor t) {
             const TensorView v = view(t);
             py::gil_scoped_release release;
             c.comm->tensor_register(v);
           })
      .def("tensor_deregister",
           [](PyComm& c, at::Tensor t) {
             const TensorView v = view(t);
             py::gil_scoped_release release;
             c.comm->tensor_deregister(v);
           })
      // NOTE [persistent all-gather]
      .def("all_gather_p_init",
           [](PyComm& c, at::Tensor out, Ms to, H h) {
             const TensorView v = view(out);
             const CallOptions o = c.opts(false, to, h);
             std::shared_ptr<AllGatherP> p;
             {
               py::gil_scoped_release release;
               p = c.comm->all_gather_p_init(v, o);
             }
             return PyAllGatherP{std::move(p), std::move(out)};
           })
      .def("all_gather_p_exec",
           [](PyComm& c, PyAllGatherP& p, at::Tensor in, bool a, Ms to, H h) {
             return c.run({p.output, in}, [&] {
               return c.comm->all_gather_p_exec(*p.h, view(in), c.opts(a, to, h));
             });
           })
      .def("all_gather_p_free",
           [](PyComm& c, PyAllGatherP& p) {
             {
               py::gil_scoped_release release;
               c.comm->all_gather_p_free(*p.h);
             }
             p.output = at::Tensor();
           })
      .def("new_window",
           [](PyComm& c) {
             std::shared_ptr<Window> w;
             {
               py::gil_scoped_release release;
               w = c.comm->new_window();
             }
             return PyWindow{std::move(w), c.comm->device()};
           })
      .def("select_transport", [](PyComm& c, const std::string& transport, bool require_nvlink) {
        TransportInit init;
        init.rank = c.comm->rank();
        init.size = c.comm->size();
        init.device = c.comm->device();
        const std::string key = fastcomms::detail::cat("ulysses/", c.comm->next_key_id());
        init.store = std::make_shared<PrefixStore>(key, c.comm->key_space());
        init.name = c.comm->name();
        init.timeout = c.comm->options().timeout;
        init.comm = c.comm;
        TransportChoice choice;
        {
          py::gil_scoped_release release;
          choice = select_transport(init, transport, require_nvlink);
        }
        return py::make_tuple(PyTransport{choice.transport, init.device}, choice.kind,
                              choice.reason);
      });

  // A Ulysses transport for a group that is not a fastcomms communicator (a torch.distributed
  // ProcessGroup): the caller gathered every rank's "host|device" (`who`) and passes a store
  // the ranks share. The transport is None when the collective path is chosen (the caller runs
  // it with torch ops).
  // A hierarchical group (ranks on several hosts) also needs `gather` (an all-gather of one str
  // per rank over the group: the hosts' verdicts) and `pg` (the group's capsule, the exchange
  // between hosts); `store` is then shared by the ranks of this rank's host.
  m.def(
      "select_transport",
      [](int rank, int size, int device_index, py::object store, const std::string& name,
         std::chrono::milliseconds timeout, const std::string& transport, bool require_nvlink,
         std::vector<std::string> who, py::object gather, py::object pg) {
        TransportInit init;
        init.rank = rank;
        init.size = size;
        init.device = device_index >= 0 ? Device{DeviceType::kCUDA, device_index} : Device{};
        if (!store.is_none()) init.store = std::make_shared<PyStore>(std::move(store));
        init.name = name;
        init.timeout = timeout;
        if (!gather.is_none()) {
          // Released under the GIL whichever thread drops the last copy.
          std::shared_ptr<py::object> held(new py::object(std::move(gather)), [](py::object* o) {
            py::gil_scoped_acquire gil;
            delete o;
          });
          init.gather = [held](const std::string& mine) {
            py::gil_scoped_acquire gil;
            return (*held)(mine).cast<std::vector<std::string>>();
          };
        }
        if (!pg.is_none()) init.exchange = python::process_group_exchange(pg.cast<py::capsule>());
        TransportChoice choice;
        {
          py::gil_scoped_release release;
          choice = select_transport(init, transport, require_nvlink, std::move(who));
        }
        return py::make_tuple(
            choice.transport ? py::cast(PyTransport{choice.transport, init.device}) : py::none(),
            choice.kind, choice.reason);
      },
      py::arg("rank"), py::arg("size"), py::arg("device_index"), py::arg("store"), py::arg("name"),
      py::arg("timeout"), py::arg("transport"), py::arg("require_nvlink"), py::arg("who"),
      py::arg("gather") = py::none(), py::arg("pg") = py::none());
  m.def("host_name", &fastcomms::host_name,
        "This process's host for the Ulysses transport choice (FASTCOMMS_HOST_ID, tests only, "
        "else the host name).");

  // ---- FP8 on the wire (issue 38): the C++ host implementation and the CUDA kernels, for the
  // tests (tests/python/test_fp8*.py). The caller allocates: q's dtype is the wire format, out's
  // the output dtype; rows run over the last dimension; every tensor contiguous, on one device.
  // CPU tensors take the host implementation, CUDA tensors the kernels on the caller's current
  // stream (kUnsupported in a build without CUDA).
  auto fp8_check = [](const char* what, const at::Tensor& wide, const at::Tensor& q,
                      const at::Tensor& scales) {
    FASTCOMMS_CHECK(wide.dim() >= 1, kInvalidArgument, what,
                    ": tensors need at least one dimension, got a 0-d tensor");
    FASTCOMMS_CHECK(q.sizes() == wide.sizes(), kInvalidArgument, what, ": q has shape ", q.sizes(),
                    ", expected ", wide.sizes());
    FASTCOMMS_CHECK(scales.sizes() == wide.sizes().slice(0, wide.dim() - 1), kInvalidArgument, what,
                    ": scales has shape ", scales.sizes(), ", expected ",
                    wide.sizes().slice(0, wide.dim() - 1));
    FASTCOMMS_CHECK(scales.scalar_type() == at::kFloat, kTypeError, what,
                    ": scales must be float32, got ", c10::toString(scales.scalar_type()));
    FASTCOMMS_CHECK(wide.device() == q.device() && wide.device() == scales.device(),
                    kInvalidArgument, what, ": tensors on ", wide.device().str(), ", ",
                    q.device().str(), " and ", scales.device().str(), ", expected one device");
    FASTCOMMS_CHECK(wide.is_contiguous() && q.is_contiguous() && scales.is_contiguous(),
                    kInvalidArgument, what, ": tensors must be contiguous");
    FASTCOMMS_CHECK(wide.is_cpu() || wide.is_cuda(), kInvalidArgument, what,
                    ": tensors must live on cpu or cuda, got ", wide.device().str());
  };
  m.def("_fp8_quantize", [fp8_check](const at::Tensor& x, const at::Tensor& q,
                                     const at::Tensor& scales) {
    fp8_check("_fp8_quantize", x, q, scales);
    const DType in = to_dtype(x.scalar_type()), wire = to_dtype(q.scalar_type());
    const int64_t rows = scales.numel(), d = x.size(-1);
    if (x.is_cpu()) {
      py::gil_scoped_release release;
      fp8_quantize_rows(x.data_ptr(), in, rows, d, q.data_ptr(), wire, scales.data_ptr<float>());
      return;
    }
#ifdef FASTCOMMS_WITH_CUDA
    c10::DeviceGuard guard(x.device());
    fp8_quantize_rows_device(x.data_ptr(), in, rows, d, q.data_ptr(), wire,
                             scales.data_ptr<float>(),
                             current_stream(Device{DeviceType::kCUDA, x.device().index()}));
#else
    throw Error(ErrorCode::kUnsupported, "_fp8_quantize: this build has no CUDA");
#endif
  });
  m.def("_fp8_dequantize",
        [fp8_check](const at::Tensor& q, const at::Tensor& scales, const at::Tensor& out) {
          fp8_check("_fp8_dequantize", out, q, scales);
          const DType wire = to_dtype(q.scalar_type()), dt = to_dtype(out.scalar_type());
          const int64_t rows = scales.numel(), d = out.size(-1);
          if (out.is_cpu()) {
            py::gil_scoped_release release;
            fp8_dequantize_rows(q.data_ptr(), wire, scales.data_ptr<float>(), rows, d,
                                out.data_ptr(), dt);
            return;
          }
#ifdef FASTCOMMS_WITH_CUDA
          c10::DeviceGuard guard(out.device());
          fp8_dequantize_rows_device(
              q.data_ptr(), wire, scales.data_ptr<float>(), rows, d, out.data_ptr(), dt,
              current_stream(Device{DeviceType::kCUDA, out.device().index()}));
#else
    throw Error(ErrorCode::kUnsupported, "_fp8_dequantize: this build has no CUDA");
#endif
        });
  m.def("_fp8_has_cuda_kernels", &has_fp8_device_kernels);

  python::bind_ulysses_op(m);
  python::bind_device_window(m);
  python::bind_device_a2a(m);
}
