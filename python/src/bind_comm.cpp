// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The communicator from Python (fastcomms._C.Comm, held by fastcomms.TorchComm): every op takes
// torch tensors as views and returns a Work that keeps them until the op completes (NOTE [python
// tensors outlive their op] in tensors.cpp); the enums, the persistent all-gather handle and the
// backend registry beside it. Hooks, windows and Ulysses transports add their methods to Comm in
// their own files (NOTE [one extension] in binding.hpp).
#include <pybind11/chrono.h>
#include <pybind11/stl.h>

#include <variant>

#include "binding.hpp"
#include "fastcomms/core/factory.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

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

}  // namespace

void bind_comm(py::module_& m) {
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
        o.store = py_store(std::move(store));
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
      .def("supports_window", [](const PyComm& c) { return c.comm->backend().supports_window(); })
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
             return issue(c, {t}, a, to, h,
                          [&](const CallOptions& o) { return c.comm->send(view(t), dst, o); });
           })
      .def("recv",
           [](PyComm& c, at::Tensor t, int src, bool a, Ms to, H h) {
             return issue(c, {t}, a, to, h,
                          [&](const CallOptions& o) { return c.comm->recv(view(t), src, o); });
           })
      .def("batch",
           [](PyComm& c, std::vector<std::tuple<bool, at::Tensor, int>> ops, bool a, Ms to, H h) {
             std::vector<P2POp> p;
             std::vector<at::Tensor> keep;
             for (auto& [is_send, t, peer] : ops) {
               p.push_back({is_send ? P2POp::Kind::kSend : P2POp::Kind::kRecv, view(t), peer});
               keep.push_back(t);
             }
             return issue(c, keep, a, to, h,
                          [&](const CallOptions& o) { return c.comm->batch_p2p(p, o); });
           })
      .def("broadcast",
           [](PyComm& c, at::Tensor t, int root, bool a, Ms to, H h) {
             return issue(c, {t}, a, to, h, [&](const CallOptions& o) {
               return c.comm->broadcast(view(t), root, o);
             });
           })
      .def("all_reduce",
           [](PyComm& c, at::Tensor t, RedOpType op, Factor f, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep{t};
             const ReduceOp r = to_op(op, f, t, keep);
             return issue(c, keep, a, to, h,
                          [&](const CallOptions& o) { return c.comm->all_reduce(view(t), r, o); });
           })
      .def("reduce",
           [](PyComm& c, at::Tensor t, int root, RedOpType op, Factor f, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep{t};
             const ReduceOp r = to_op(op, f, t, keep);
             return issue(c, keep, a, to, h, [&](const CallOptions& o) {
               return c.comm->reduce(view(t), root, r, o);
             });
           })
      .def("all_gather",
           [](PyComm& c, std::vector<at::Tensor> outs, at::Tensor in, bool v, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep = outs;
             keep.push_back(in);
             return issue(c, keep, a, to, h, [&](const CallOptions& o) {
               return v ? c.comm->all_gather_v(views(outs), view(in), o)
                        : c.comm->all_gather(views(outs), view(in), o);
             });
           })
      .def("all_gather_single",
           [](PyComm& c, at::Tensor out, at::Tensor in, bool a, Ms to, H h) {
             return issue(c, {out, in}, a, to, h, [&](const CallOptions& o) {
               return c.comm->all_gather_single(view(out), view(in), o);
             });
           })
      .def("reduce_scatter",
           [](PyComm& c, at::Tensor out, std::vector<at::Tensor> ins, RedOpType op, Factor f,
              bool v, bool a, Ms to, H h) {
             std::vector<at::Tensor> keep = ins;
             keep.push_back(out);
             const ReduceOp r = to_op(op, f, out, keep);
             return issue(c, keep, a, to, h, [&](const CallOptions& o) {
               return v ? c.comm->reduce_scatter_v(view(out), views(ins), r, o)
                        : c.comm->reduce_scatter(view(out), views(ins), r, o);
             });
           })
      .def(
          "reduce_scatter_single",
          [](PyComm& c, at::Tensor out, at::Tensor in, RedOpType op, Factor f, bool a, Ms to, H h) {
            std::vector<at::Tensor> keep{out, in};
            const ReduceOp r = to_op(op, f, out, keep);
            return issue(c, keep, a, to, h, [&](const CallOptions& o) {
              return c.comm->reduce_scatter_single(view(out), view(in), r, o);
            });
          })
      .def("all_to_all_single",
           [](PyComm& c, at::Tensor out, at::Tensor in, bool a, Ms to, H h) {
             return issue(c, {out, in}, a, to, h, [&](const CallOptions& o) {
               return c.comm->all_to_all_single(view(out), view(in), o);
             });
           })
      .def("all_to_all_v_single",
           [](PyComm& c, at::Tensor out, at::Tensor in, std::vector<int64_t> out_s,
              std::vector<int64_t> in_s, bool a, Ms to, H h) {
             return issue(c, {out, in}, a, to, h, [&](const CallOptions& o) {
               return c.comm->all_to_all_v_single(view(out), view(in), out_s, in_s, o);
             });
           })
      .def("all_to_all",
           [](PyComm& c, std::vector<at::Tensor> outs, std::vector<at::Tensor> ins, bool a, Ms to,
              H h) {
             std::vector<at::Tensor> keep = outs;
             keep.insert(keep.end(), ins.begin(), ins.end());
             return issue(c, keep, a, to, h, [&](const CallOptions& o) {
               return c.comm->all_to_all(views(outs), views(ins), o);
             });
           })
      .def("barrier",
           [](PyComm& c, bool a, Ms to, H h) {
             return issue(c, {}, a, to, h,
                          [&](const CallOptions& o) { return c.comm->barrier(o); });
           })
      .def(
          "scatter",
          [](PyComm& c, at::Tensor out, std::vector<at::Tensor> ins, int root, bool a, Ms to, H h) {
            std::vector<at::Tensor> keep = ins;
            keep.push_back(out);
            return issue(c, keep, a, to, h, [&](const CallOptions& o) {
              return c.comm->scatter(view(out), views(ins), root, o);
            });
          })
      .def(
          "gather",
          [](PyComm& c, std::vector<at::Tensor> outs, at::Tensor in, int root, bool a, Ms to, H h) {
            std::vector<at::Tensor> keep = outs;
            keep.push_back(in);
            return issue(c, keep, a, to, h, [&](const CallOptions& o) {
              return c.comm->gather(views(outs), view(in), root, o);
            });
          })
      .def("gather_single",
           [](PyComm& c, at::Tensor out, at::Tensor in, int root, bool a, Ms to, H h) {
             return issue(c, {out, in}, a, to, h, [&](const CallOptions& o) {
               return c.comm->gather_single(view(out), view(in), root, o);
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
             return issue(c, {p.output, in}, a, to, h, [&](const CallOptions& o) {
               return c.comm->all_gather_p_exec(*p.h, view(in), o);
             });
           })
      .def("all_gather_p_free", [](PyComm& c, PyAllGatherP& p) {
        {
          py::gil_scoped_release release;
          c.comm->all_gather_p_free(*p.h);
        }
        p.output = at::Tensor();
      });
}

}  // namespace fastcomms::python
