// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Ulysses transports from Python (fastcomms.ulysses): the transport choice (over a communicator,
// or over a torch.distributed ProcessGroup with the NVLink probe and the hierarchical exchange),
// the UlyssesTransport object a group holds, and the geometry of a call from shapes alone. The op
// family itself, its async form included, is ulysses_op.cpp.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "binding.hpp"
#include "fastcomms/ulysses/hierarchical.hpp"
#include "tensors.hpp"

#ifdef FASTCOMMS_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <cuda_runtime_api.h>
#endif

namespace py = pybind11;

namespace fastcomms::python {
namespace {

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

// The byte all-to-all of a hierarchical group over a torch.distributed ProcessGroup: alltoall_base
// of uint8 tensors; on CUDA ordered after the exchange's stream and before what follows on it, on
// a torch stream of the pool.
ByteExchange process_group_exchange(c10::intrusive_ptr<c10d::ProcessGroup> pg) {
  return [pg](const TensorView& recv, const TensorView& send, const std::vector<int64_t>& rb,
              const std::vector<int64_t>& sb, void* stream, uint64_t) {
    auto opts = at::TensorOptions().dtype(at::kByte);
    opts = recv.device.type == DeviceType::kCUDA
               ? opts.device(at::kCUDA, static_cast<c10::DeviceIndex>(recv.device.index))
               : opts.device(at::kCPU);
    at::Tensor r = at::from_blob(recv.data, {recv.shape.at(0)}, opts);
    at::Tensor s = at::from_blob(send.data, {send.shape.at(0)}, opts);
    std::vector<int64_t> out_sizes(rb), in_sizes(sb);
    if (recv.device.type != DeviceType::kCUDA) {
      pg->alltoall_base(r, s, out_sizes, in_sizes)->wait();
      return;
    }
#ifdef FASTCOMMS_WITH_CUDA
    // NOTE [process group on a side stream]: a ProcessGroup orders its work after the caller's
    // current torch stream and `wait()` orders that stream after the work. The exchange runs on
    // its own stream beside the caller's, so a torch stream of the pool stands in for it:
    // it waits for `stream`, is current during the call, and `stream` waits for it after.
    const c10::Device dev(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(recv.device.index));
    auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    const c10::Stream pool = impl->getStreamFromGlobalPool(dev, false);
    auto side = static_cast<cudaStream_t>(stream);
    auto torch_side = static_cast<cudaStream_t>(pool.native_handle());
    cudaEvent_t before = nullptr, after = nullptr;
    FASTCOMMS_CHECK(cudaEventCreateWithFlags(&before, cudaEventDisableTiming) == cudaSuccess &&
                        cudaEventCreateWithFlags(&after, cudaEventDisableTiming) == cudaSuccess,
                    kInternal, "process_group_exchange: cudaEventCreate failed");
    const auto release = [&] {
      (void)cudaEventDestroy(before);
      (void)cudaEventDestroy(after);
    };
    try {
      FASTCOMMS_CHECK(cudaEventRecord(before, side) == cudaSuccess &&
                          cudaStreamWaitEvent(torch_side, before, 0) == cudaSuccess,
                      kInternal, "process_group_exchange: ordering after the exchange's stream");
      const c10::Stream previous = impl->exchangeStream(pool);
      try {
        pg->alltoall_base(r, s, out_sizes, in_sizes)->wait();
      } catch (...) {
        impl->exchangeStream(previous);
        throw;
      }
      impl->exchangeStream(previous);
      FASTCOMMS_CHECK(cudaEventRecord(after, torch_side) == cudaSuccess &&
                          cudaStreamWaitEvent(side, after, 0) == cudaSuccess,
                      kInternal, "process_group_exchange: ordering the exchange's stream after");
    } catch (...) {
      release();
      throw;
    }
    release();
#else
    (void)stream;
    throw Error(ErrorCode::kUnsupported, "process_group_exchange: this build has no CUDA");
#endif
  };
}

}  // namespace

void bind_ulysses(py::module_& m) {
  // NVML's answer pair by pair, or (None, why) when it cannot answer (never a guess).
  m.def("nvlink_matrix", [](const std::vector<int>& devices) {
    py::gil_scoped_release release;
    return nvlink_matrix(devices);
  });
  m.def("nvlink_decision", &nvlink_decision, py::arg("who"), py::arg("probe"));
  m.def("has_transport", &has_transport);
  // The geometry of a call from shapes alone (fake tensors, the torch.distributed path):
  // (out_shape, seq_splits, head_splits, max_out_bytes), validated like the call.
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

  reopen<PyComm>(m, "Comm").def("select_transport", [](PyComm& c, const std::string& transport,
                                                       bool require_nvlink) {
    FASTCOMMS_CHECK(
        c.comm->backend().lend(kLentPythonBackend) == nullptr, kUnsupported, "[", c.comm->name(),
        "] the Ulysses layer needs a built-in backend's communicator ('", c.comm->backend_name(),
        "' is written in Python); pass a torch.distributed ProcessGroup instead");
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
    return py::make_tuple(PyTransport{choice.transport, init.device}, choice.kind, choice.reason);
  });

  // A Ulysses transport for a group that is not a fastcomms communicator (a torch.distributed
  // ProcessGroup): the caller gathered every rank's "host|device" (`who`) and passes a store
  // the ranks share. The transport is None when the collective path is chosen (the caller runs
  // it with torch ops).
  // A hierarchical group (ranks on several hosts) also needs `gather` (an all-gather of one str
  // per rank over the group: the hosts' verdicts) and `pg` (the group itself, the exchange
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
        if (!store.is_none()) init.store = py_store(std::move(store));
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
        if (!pg.is_none())
          init.exchange = process_group_exchange(pg.cast<c10::intrusive_ptr<c10d::ProcessGroup>>());
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
}

}  // namespace fastcomms::python
