// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The Python binding: the only translation unit that includes torch. Tensors become non-owning
// TensorViews; every Work returned to Python keeps its tensors alive until it completes; C++
// errors map to Python exceptions here, in one place.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include "fastcomms/core/communicator.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/core/ulysses.hpp"
#include "fastcomms/error.hpp"
#ifdef FASTCOMMS_WITH_CUDA
#include <c10/cuda/CUDAStream.h>

#include "fastcomms/backends/nvlink_ulysses.hpp"
#include "fastcomms/backends/nvlink_window.hpp"
#include "fastcomms/cuda/nvml.hpp"
#endif
#ifdef FASTCOMMS_WITH_NCCL
#include "fastcomms/backends/cuda_ulysses.hpp"
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
                  std::string("fastcomms: unsupported dtype ") + c10::toString(t));
  }
}

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

std::vector<TensorView> views(const std::vector<at::Tensor>& ts) {
  std::vector<TensorView> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(view(t));
  return out;
}

// A torch.distributed.Store (any Python object with its methods) as a fastcomms Store.
class PyStore : public Store {
 public:
  explicit PyStore(py::object store) : store_(std::move(store)) {}
  ~PyStore() override {
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

// A Work from Python. The op's tensors are attached to the C++ Work itself (NOTE [work keeps its
// buffers]), so they outlive the transfer even when Python drops this handle unwaited.
struct PyWork {
  WorkPtr work;
  void wait() {
    py::gil_scoped_release release;
    work->wait();
  }
};

// Attaches `keep` to `w` (at::Tensor references; released wherever the Work dies, which torch
// allows from any thread).
void hold_tensors(const WorkPtr& w, std::vector<at::Tensor> keep) {
  if (w && !keep.empty()) w->hold(std::make_shared<const std::vector<at::Tensor>>(std::move(keep)));
}

struct PyComm {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<UlyssesGroup> ulysses;  // created on first use: plan cache and staging
#ifdef FASTCOMMS_WITH_NCCL
  std::shared_ptr<CudaUlyssesCollective> cuda_ulysses;  // the CUDA collective path, on first use
  CudaUlyssesCollective& cuda_group() {
    if (!cuda_ulysses) cuda_ulysses = std::make_shared<CudaUlyssesCollective>(comm);
    return *cuda_ulysses;
  }
#endif

  UlyssesGroup& group() {
    if (!ulysses) ulysses = std::make_shared<UlyssesGroup>(comm);
    return *ulysses;
  }

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
  void* stream() const {
#ifdef FASTCOMMS_WITH_CUDA
    if (comm->device().type == DeviceType::kCUDA)
      return c10::cuda::getCurrentCUDAStream(comm->device().index).stream();
#endif
    return nullptr;
  }
  template <typename Fn>
  PyWork run(std::vector<at::Tensor> keep, Fn&& fn) {
    WorkPtr w;
    {
      py::gil_scoped_release release;
      w = fn();
    }
    hold_tensors(w, std::move(keep));
    return PyWork{std::move(w)};
  }
};

ReduceOp to_op(RedOpType t, double factor) { return ReduceOp{t, factor}; }

UlyssesArgs ulysses_args(int mode, std::optional<std::vector<int64_t>> seq,
                         std::optional<std::vector<int64_t>> heads) {
  UlyssesArgs a;
  a.mode = mode;
  a.seq_splits = std::move(seq);
  a.head_splits = std::move(heads);
  return a;
}

#ifdef FASTCOMMS_WITH_CUDA
// The setup of an NVLink group or window (both option structs have these fields).
template <typename Options>
Options p2p_options(int rank, int size, int device, py::object store, const std::string& name,
                    std::chrono::milliseconds timeout) {
  Options o;
  o.rank = rank;
  o.size = size;
  o.device = device;
  o.store = std::make_shared<PyStore>(std::move(store));
  o.name = name;
  o.timeout = timeout;
  return o;
}

// The NVLink peer-to-peer group (backends/nvlink) from Python. Calls are enqueued on the caller's
// current torch stream; empty_output() buffers are tensors that keep the group alive, so a buffer
// never outlives its mapping.
struct PyNvlink {
  std::shared_ptr<NvlinkUlysses> g;
  int device = 0;
  NvlinkUlysses& get() {
    FASTCOMMS_CHECK(g != nullptr, kInvalidArgument, "UlyssesGroup: the group was destroyed");
    return *g;
  }
};
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastcomms C++ core (internal; use the fastcomms package)";

  // NOTE [error mapping]: the one place C++ errors become Python exceptions.
  static py::exception<Error> aborted_error(m, "AbortedError", PyExc_RuntimeError);
  static py::exception<Error> backend_error(m, "BackendError", PyExc_RuntimeError);
  static py::exception<Error> unsupported_error(m, "UnsupportedError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const Error& e) {
      switch (e.code()) {
        case ErrorCode::kInvalidArgument:
          PyErr_SetString(PyExc_ValueError, e.what());
          return;
        case ErrorCode::kTypeError:
          PyErr_SetString(PyExc_TypeError, e.what());
          return;
        case ErrorCode::kTimeout:
          PyErr_SetString(PyExc_TimeoutError, e.what());
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
    }
  });

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
      .def("status", [](const PyWork& w) { return w.work->status(); });

  m.def("is_backend_built", &is_backend_registered);
  // NVML's answer pair by pair, or (None, why) when it cannot answer (never a guess).
  m.def("nvlink_matrix", [](const std::vector<int>& devices) -> py::tuple {
#ifdef FASTCOMMS_WITH_CUDA
    std::string why;
    auto m = cuda::nvlink_matrix(devices, &why);
    if (!m) return py::make_tuple(py::none(), why);
    py::dict d;
    for (const auto& [k, v] : *m) d[py::make_tuple(k.first, k.second)] = v;
    return py::make_tuple(d, "");
#else
    (void)devices;
    return py::make_tuple(py::none(), "this build has no CUDA layer");
#endif
  });
  m.def("built_backends", &registered_backends);

#ifdef FASTCOMMS_WITH_CUDA
  py::class_<PyNvlink>(m, "NvlinkGroup")
      .def(py::init([](int rank, int size, int device, py::object store, const std::string& name,
                       std::chrono::milliseconds timeout) {
             auto o = p2p_options<NvlinkUlyssesOptions>(rank, size, device, std::move(store), name,
                                                        timeout);
             py::gil_scoped_release release;
             return PyNvlink{std::make_shared<NvlinkUlysses>(std::move(o)), device};
           }),
           py::arg("rank"), py::arg("size"), py::arg("device"), py::arg("store"), py::arg("name"),
           py::arg("timeout"))
      .def("output_shape",
           [](PyNvlink& n, at::Tensor x, int mode, std::optional<std::vector<int64_t>> seq,
              std::optional<std::vector<int64_t>> heads) {
             const auto s = n.get().output_shape(view(x), ulysses_args(mode, seq, heads));
             return std::vector<int64_t>(s.begin(), s.end());
           })
      .def("all_to_all_4d",
           [](PyNvlink& n, at::Tensor x, at::Tensor out, int mode,
              std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads,
              int engine) {
             FASTCOMMS_CHECK(engine >= 0 && engine <= 3, kInvalidArgument,
                             "UlyssesGroup: engine must be 0 (auto), 1 (copy engine), 2 (SM) or "
                             "3 (hybrid), got ",
                             engine);
             cudaStream_t s = c10::cuda::getCurrentCUDAStream(n.device).stream();
             py::gil_scoped_release release;
             n.get().all_to_all_4d(view(x), view(out), ulysses_args(mode, seq, heads), s,
                                   static_cast<TransferEngine>(engine));
           })
      .def("empty_output",
           [](PyNvlink& n, std::vector<int64_t> shape, int64_t bytes, at::Tensor like) {
             const auto st = like.scalar_type();
             void* p = nullptr;
             {
               py::gil_scoped_release release;
               p = n.get().empty_output(bytes);
             }
             auto keep = n.g;  // the mapping lives as long as any tensor on it
             return torch::from_blob(
                 p, shape, [keep](void*) {},
                 at::TensorOptions().dtype(st).device(at::kCUDA, n.device));
           })
      .def("check_errors", [](PyNvlink& n) { n.get().check_errors(); })
      .def("memory_bytes", [](PyNvlink& n) { return n.g ? n.g->memory_bytes() : int64_t{0}; })
      .def("epoch", [](PyNvlink& n) { return n.g ? n.g->epoch() : uint64_t{0}; })
      .def("device_epoch",
           [](PyNvlink& n) {
             py::gil_scoped_release release;
             return n.get().device_epoch();
           })
      .def("destroy", [](PyNvlink& n) {
        py::gil_scoped_release release;
        n.g.reset();
      });

  // Windows (fastcomms.TorchCommWindow): ops enqueue on the caller's current torch stream;
  // map_remote tensors keep the window alive.
  py::class_<NvlinkWindow, std::shared_ptr<NvlinkWindow>>(m, "NvlinkWindow")
      .def(py::init([](int rank, int size, int device, py::object store, const std::string& name,
                       std::chrono::milliseconds timeout) {
        auto o =
            p2p_options<NvlinkWindowOptions>(rank, size, device, std::move(store), name, timeout);
        py::gil_scoped_release release;
        return std::make_shared<NvlinkWindow>(std::move(o));
      }))
      .def("register_buffer",
           [](NvlinkWindow& w, at::Tensor t) {
             void* p = t.data_ptr();
             const int64_t bytes = t.numel() * t.element_size();
             py::gil_scoped_release release;
             w.register_buffer(p, bytes);
           })
      .def("deregister",
           [](NvlinkWindow& w) {
             py::gil_scoped_release release;
             w.deregister();
           })
      .def("bytes", &NvlinkWindow::bytes)
      .def("put",
           [](NvlinkWindow& w, at::Tensor src, int dst, int64_t offset_bytes, int device) {
             cudaStream_t s = c10::cuda::getCurrentCUDAStream(device).stream();
             w.put(src.data_ptr(), src.numel() * src.element_size(), dst, offset_bytes, s);
           })
      .def("signal",
           [](NvlinkWindow& w, int peer, int device) {
             w.signal(peer, c10::cuda::getCurrentCUDAStream(device).stream());
           })
      .def("wait_signal",
           [](NvlinkWindow& w, int peer, int device) {
             w.wait_signal(peer, c10::cuda::getCurrentCUDAStream(device).stream());
           })
      .def("check_errors", &NvlinkWindow::check_errors)
      .def("remote",
           [](std::shared_ptr<NvlinkWindow> w, int q, std::vector<int64_t> shape, at::Tensor like) {
             void* p = w->remote(q);
             return torch::from_blob(
                 p, shape, [w](void*) {},
                 at::TensorOptions().dtype(like.scalar_type()).device(like.device()));
           });
#endif

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
           [](PyComm& c, at::Tensor t, RedOpType op, double f, bool a, Ms to, H h) {
             return c.run(
                 {t}, [&] { return c.comm->all_reduce(view(t), to_op(op, f), c.opts(a, to, h)); });
           })
      .def("reduce",
           [](PyComm& c, at::Tensor t, int root, RedOpType op, double f, bool a, Ms to, H h) {
             return c.run({t}, [&] {
               return c.comm->reduce(view(t), root, to_op(op, f), c.opts(a, to, h));
             });
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
           [](PyComm& c, at::Tensor out, std::vector<at::Tensor> ins, RedOpType op, double f,
              bool v, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep = ins;
             keep.push_back(out);
             return c.run(keep, [&] {
               return v ? c.comm->reduce_scatter_v(view(out), views(ins), to_op(op, f),
                                                   c.opts(a, to, h))
                        : c.comm->reduce_scatter(view(out), views(ins), to_op(op, f),
                                                 c.opts(a, to, h));
             });
           })
      .def(
          "reduce_scatter_single",
          [](PyComm& c, at::Tensor out, at::Tensor in, RedOpType op, double f, bool a, Ms to, H h) {
            return c.run({out, in}, [&] {
              return c.comm->reduce_scatter_single(view(out), view(in), to_op(op, f),
                                                   c.opts(a, to, h));
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
      .def("register_abort_hook",
           [](PyComm& c, py::function fn) {
             auto h = std::make_shared<RemovableHandle>(c.comm->register_abort_hook([fn] {
               py::gil_scoped_acquire gil;
               fn();
             }));
             return py::cpp_function([h] { h->remove(); });
           })
      .def("ulysses_output_shape",
           [](PyComm& c, at::Tensor x, int mode, std::optional<std::vector<int64_t>> seq,
              std::optional<std::vector<int64_t>> heads) {
             UlyssesArgs a;
             a.mode = mode;
             a.seq_splits = seq;
             a.head_splits = heads;
             const auto s = c.group().output_shape(view(x), a);
             return std::vector<int64_t>(s.begin(), s.end());
           })
      .def("ulysses_all_to_all_4d",
           [](PyComm& c, at::Tensor x, at::Tensor out, int mode,
              std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads,
              bool a) {
             UlyssesGroup& g = c.group();
             UlyssesArgs args;
             args.mode = mode;
             args.seq_splits = seq;
             args.head_splits = heads;
             args.async_op = a;
             return c.run({x, out}, [&] { return g.all_to_all_4d(view(x), view(out), args); });
           })
      // The CUDA collective path (pack kernel, all_to_all_v_single, unpack kernel), enqueued on
      // the caller's current stream; None when this build has no NCCL.
      .def("ulysses_cuda_all_to_all_4d",
           [](PyComm& c, at::Tensor x, at::Tensor out, int mode,
              std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads) {
#ifdef FASTCOMMS_WITH_NCCL
             auto& g = c.cuda_group();
             cudaStream_t s = static_cast<cudaStream_t>(c.stream());
             py::gil_scoped_release release;
             g.all_to_all_4d(view(x), view(out), ulysses_args(mode, seq, heads), s);
             return true;
#else
             (void)c, (void)x, (void)out, (void)mode, (void)seq, (void)heads;
             return false;
#endif
           });
}
