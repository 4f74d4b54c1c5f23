// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// torchcomms' device_alltoallv_single in fastcomms._C (fastcomms/core/device_alltoallv.hpp; the
// Python surface is fastcomms/_device_a2av.py). Each communicator gets one group, made by its
// first call (or device_alltoallv_prepare), kept here beside the communicator, and a pre-hook on
// the communicator that raises what the group's kernels flagged: the next host call on that
// communicator reports a device-side error, whichever op it is. Beside it, the MoE device
// transport's row kernels (NOTE [moe row kernels] in include/fastcomms/core/rows.hpp; used by
// python/fastcomms/_moe_device.py and moe.py): CUDA tensors only, every check here on shapes and
// strides, no value read on the host. (One file for both: each torch-including file costs about a
// minute of CI per build.)
#include <pybind11/pybind11.h>

#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>

#include "binding.hpp"
#include "fastcomms/core/communicator.hpp"
#include "fastcomms/core/device_alltoallv.hpp"
#include "fastcomms/core/rows.hpp"
#include "fastcomms/core/store.hpp"
#include "py_common.hpp"
#include "tensors.hpp"

#ifdef FASTCOMMS_WITH_CUDA
#include <c10/core/DeviceGuard.h>
#endif

namespace py = pybind11;

namespace fastcomms::python {
namespace {

// The communicator behind a fastcomms._C.Comm (TorchComm._c).
std::shared_ptr<Communicator> communicator_of(const py::handle& comm) {
  auto c = comm.cast<PyComm&>().comm;
  FASTCOMMS_CHECK(c != nullptr, kInvalidArgument,
                  "device_alltoallv_single: the communicator was destroyed");
  return c;
}

struct Entry {
  std::weak_ptr<Communicator> comm;
  std::shared_ptr<DeviceAlltoallv> group;
};
std::mutex mu;
// Kept for the process (entries of dropped communicators go on the next lookup).
auto* entries = new std::map<const Communicator*, Entry>();

std::shared_ptr<DeviceAlltoallv> find(const Communicator& c) {
  std::lock_guard<std::mutex> lock(mu);
  for (auto it = entries->begin(); it != entries->end();) {
    it = it->second.comm.expired() ? entries->erase(it) : std::next(it);
  }
  const auto it = entries->find(&c);
  return it == entries->end() ? nullptr : it->second.group;
}

// Takes `c`'s group out (the caller lets it go, outside the lock).
std::shared_ptr<DeviceAlltoallv> take(const Communicator* c) {
  std::lock_guard<std::mutex> lock(mu);
  const auto it = entries->find(c);
  if (it == entries->end()) return nullptr;
  auto g = std::move(it->second.group);
  entries->erase(it);
  return g;
}

// Collective: a new group for `c` (an old one is dropped first), whose receive buffers hold
// `capacity` bytes at least.
std::shared_ptr<DeviceAlltoallv> make(const std::shared_ptr<Communicator>& c, int64_t capacity) {
  take(c.get()).reset();
  DeviceAlltoallvInit init;
  init.rank = c->rank();
  init.size = c->size();
  init.device = c->device();
  init.store =
      std::make_shared<PrefixStore>(detail::cat("device_a2av/", c->next_key_id()), c->key_space());
  init.name = c->name();
  init.backend = c->backend_name();
  init.timeout = c->options().timeout;
  init.capacity_bytes = capacity;
  std::shared_ptr<DeviceAlltoallv> g = make_device_alltoallv(init);
  std::weak_ptr<DeviceAlltoallv> weak = g;
  const Communicator* key = c.get();
  {
    std::lock_guard<std::mutex> lock(mu);
    (*entries)[key] = Entry{c, g};
  }
  // Every later op of the communicator raises what the group flagged, once the op is issued
  // (a post-hook: a rank that raised before issuing would leave its peers waiting in that op).
  // finalize lets the group go first (its destructor waits for its last call), then raises.
  c->register_post_hook([weak](const OpInfo&) {
    if (auto g = weak.lock()) g->check_errors();
  });
  c->register_pre_hook([key](const OpInfo& info) {
    if (info.op != OpKind::kFinalize) return;
    if (auto g = take(key)) g->check_errors();  // the last owner: gone after the check
  });
  return g;
}

// The group of `comm` for a call: made by the first call (collective), which may not be inside
// a CUDA graph capture (the caller checks: setup allocates and exchanges handles).
std::shared_ptr<DeviceAlltoallv> group_for(const std::shared_ptr<Communicator>& c,
                                           int64_t capacity) {
  if (auto g = find(*c)) return g;
  return make(c, capacity);
}

// -- the MoE row kernels ---------------------------------------------------------------------
void check_cuda(const char* what, const char* name, const at::Tensor& t, const at::Tensor& like) {
  FASTCOMMS_CHECK(t.is_cuda() && t.device() == like.device(), kInvalidArgument, what, ": ", name,
                  " must be on ", like.device().str(), ", got ", t.device().str());
}

void check_index(const char* what, const at::Tensor& index, int64_t n, const at::Tensor& like) {
  check_cuda(what, "index", index, like);
  FASTCOMMS_CHECK(index.scalar_type() == at::kLong, kTypeError, what, ": index must be int64, got ",
                  c10::toString(index.scalar_type()));
  FASTCOMMS_CHECK(index.dim() == 1 && index.numel() == n && index.is_contiguous(), kInvalidArgument,
                  what, ": index must be a contiguous (", n, ",) tensor, got shape ",
                  index.sizes());
}

void* stream_of(const at::Tensor& t) {
#ifdef FASTCOMMS_WITH_CUDA
  return current_stream(Device{DeviceType::kCUDA, t.device().index()});
#else
  (void)t;
  throw Error(ErrorCode::kUnsupported, "moe row kernels: this build has no CUDA");
#endif
}

}  // namespace

void bind_device_a2a(py::module_& m) {
  m.def(
      "_device_alltoallv_single",
      [](const py::handle& comm, const at::Tensor& output, const at::Tensor& input,
         const at::Tensor& output_split_sizes, const at::Tensor& input_split_sizes,
         int64_t timeout_ms) {
        const auto c = communicator_of(comm);
        const TensorView out = view(output), in = view(input);
        const TensorView os = view(output_split_sizes), is = view(input_split_sizes);
        py::gil_scoped_release release;
        FASTCOMMS_CHECK(!c->is_aborted(), kAborted, c->prefix(OpKind::kAllToAllVSingle),
                        "device_alltoallv_single: the communicator was aborted");
        auto g = group_for(c, out.nbytes());
        g->run(out, in, os, is, current_stream(c->device()), std::chrono::milliseconds(timeout_ms));
      },
      py::arg("comm"), py::arg("output"), py::arg("input"), py::arg("output_split_sizes"),
      py::arg("input_split_sizes"), py::arg("timeout_ms") = 0,
      "Enqueues device_alltoallv_single on the current stream (fastcomms/_device_a2av.py)");
  m.def(
      "_device_alltoallv_prepare",
      [](const py::handle& comm, int64_t max_output_bytes) {
        const auto c = communicator_of(comm);
        FASTCOMMS_CHECK(max_output_bytes >= 0, kInvalidArgument,
                        "device_alltoallv_prepare: max_output_bytes must be >= 0, got ",
                        max_output_bytes);
        py::gil_scoped_release release;
        if (auto g = find(*c)) g->check_errors();
        make(c, max_output_bytes);
      },
      py::arg("comm"), py::arg("max_output_bytes"),
      "Collective: (re)makes the communicator's device all-to-all-v buffers");
  m.def(
      "_device_alltoallv_info",
      [](const py::handle& comm) -> py::object {
        const auto g = find(*communicator_of(comm));
        if (!g) return py::none();
        py::dict d;
        d["capacity_bytes"] = g->capacity_bytes();
        d["calls"] = g->calls();
        return d;
      },
      py::arg("comm"),
      "The communicator's device all-to-all-v group, or None before its first call");
  m.def(
      "_device_alltoallv_check",
      [](const py::handle& comm) {
        if (const auto g = find(*communicator_of(comm))) g->check_errors();
      },
      py::arg("comm"), "Raises what the device all-to-all-v flagged since the last check");
  // torchcomms calls it on the backend object (get_backend_impl()): this class's method.
  py::object cls = m.attr("Comm");
  cls.attr("device_alltoallv_single") = py::cpp_function(
      [](const py::object& self, const at::Tensor& output, const at::Tensor& input,
         const at::Tensor& output_split_sizes, const at::Tensor& input_split_sizes, bool async_op) {
        return py::module_::import("fastcomms._device_a2av")
            .attr("issue")(self, output, input, output_split_sizes, input_split_sizes, async_op);
      },
      py::name("device_alltoallv_single"), py::is_method(cls), py::arg("output"), py::arg("input"),
      py::arg("output_split_sizes"), py::arg("input_split_sizes"), py::arg("async_op"),
      "torchcomms' device_alltoallv_single: split sizes are int64 CUDA tensors (rows of dim 0), "
      "never read by the host");
  // the MoE row kernels
  m.def(
      "_moe_gather_rows",
      [](const at::Tensor& dst, const at::Tensor& src, const at::Tensor& index,
         const std::optional<at::Tensor>& count, bool zero_rest) {
        const char* what = "moe gather_rows";
        FASTCOMMS_CHECK(dst.is_cuda(), kInvalidArgument, what, ": dst must be a CUDA tensor, got ",
                        dst.device().str());
        check_cuda(what, "src", src, dst);
        for (const at::Tensor* t : {&dst, &src}) {
          FASTCOMMS_CHECK(
              t->scalar_type() == at::kByte && t->dim() == 2 && t->stride(1) == 1 &&
                  t->stride(0) >= t->size(1),
              kInvalidArgument, what,
              ": dst and src must be uint8 (rows, bytes) with rows of unit stride, got ",
              c10::toString(t->scalar_type()), " ", t->sizes(), " strides ", t->strides());
        }
        FASTCOMMS_CHECK(dst.size(1) == src.size(1), kInvalidArgument, what, ": rows of ",
                        dst.size(1), " bytes (dst) and ", src.size(1), " bytes (src)");
        check_index(what, index, dst.size(0), dst);
        const int64_t* c = nullptr;
        if (count) {
          check_cuda(what, "count", *count, dst);
          FASTCOMMS_CHECK(count->scalar_type() == at::kLong && count->numel() == 1,
                          kInvalidArgument, what, ": count must be one int64, got ",
                          c10::toString(count->scalar_type()), " ", count->sizes());
          c = count->data_ptr<int64_t>();
        }
#ifdef FASTCOMMS_WITH_CUDA
        c10::DeviceGuard guard(dst.device());
#endif
        gather_rows_device(dst.data_ptr(), dst.stride(0), src.data_ptr(), src.stride(0),
                           src.size(0), dst.size(1), index.data_ptr<int64_t>(), dst.size(0), c,
                           zero_rest, stream_of(dst));
      },
      py::arg("dst"), py::arg("src"), py::arg("index"), py::arg("count") = py::none(),
      py::arg("zero_rest") = false,
      "dst[i] = src[index[i]] for i < count (read on the GPU), zeros for index < 0; rows from "
      "count "
      "on zeroed (zero_rest) or untouched");
  m.def(
      "_moe_weighted_sum",
      [](const at::Tensor& out, const at::Tensor& src, const std::optional<at::Tensor>& index,
         const at::Tensor& w) {
        const char* what = "moe weighted_sum";
        FASTCOMMS_CHECK(out.is_cuda(), kInvalidArgument, what, ": out must be a CUDA tensor, got ",
                        out.device().str());
        check_cuda(what, "src", src, out);
        check_cuda(what, "w", w, out);
        FASTCOMMS_CHECK(out.dim() == 2 && out.is_contiguous(), kInvalidArgument, what,
                        ": out must be a contiguous (tokens, d) tensor, got ", out.sizes());
        const int64_t tokens = out.size(0), d = out.size(1);
        FASTCOMMS_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == tokens &&
                            w.is_contiguous(),
                        kInvalidArgument, what, ": w must be contiguous float32 (", tokens,
                        ", k), got ", c10::toString(w.scalar_type()), " ", w.sizes());
        const int64_t k = w.size(1);
        FASTCOMMS_CHECK(
            src.dim() == 2 && src.size(1) == d && src.stride(1) == 1 && src.stride(0) >= d,
            kInvalidArgument, what, ": src must be (rows, ", d, ") with rows of unit stride, got ",
            src.sizes(), " strides ", src.strides());
        const int64_t* idx = nullptr;
        if (index) {
          check_index(what, *index, tokens * k, out);
          idx = index->data_ptr<int64_t>();
        } else {
          FASTCOMMS_CHECK(src.size(0) == tokens * k, kInvalidArgument, what,
                          ": without an index src must have tokens * k = ", tokens * k,
                          " rows, got ", src.size(0));
        }
#ifdef FASTCOMMS_WITH_CUDA
        c10::DeviceGuard guard(out.device());
#endif
        weighted_sum_rows_device(out.data_ptr(), to_dtype(out.scalar_type()), src.data_ptr(),
                                 to_dtype(src.scalar_type()), src.stride(0) * src.element_size(),
                                 src.size(0), idx, w.data_ptr<float>(), tokens, k, d,
                                 stream_of(out));
      },
      py::arg("out"), py::arg("src"), py::arg("index"), py::arg("w"),
      "out[t] = sum_j w[t, j] * src[index[t * k + j]] in float32, slot order, no FMA");
  m.def("_moe_has_row_kernels", &has_row_kernels);
}

}  // namespace fastcomms::python
