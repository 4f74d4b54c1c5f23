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

#include <algorithm>
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

// A contiguous CUDA tensor on like's device of `type` and `n` values.
void check_plan(const char* what, const char* name, const at::Tensor& t, const at::Tensor& like,
                at::ScalarType type, int64_t n) {
  check_cuda(what, name, t, like);
  FASTCOMMS_CHECK(t.scalar_type() == type && t.numel() == n && t.is_contiguous(), kInvalidArgument,
                  what, ": ", name, " must be contiguous ", c10::toString(type), " of ", n,
                  " values, got ", c10::toString(t.scalar_type()), " ", t.sizes());
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
         int64_t timeout_ms, const std::optional<at::Tensor>& input_index) {
        const auto c = communicator_of(comm);
        const TensorView out = view(output), in = view(input);
        const TensorView os = view(output_split_sizes), is = view(input_split_sizes);
        std::optional<TensorView> ix;
        if (input_index) ix = view(*input_index);
        py::gil_scoped_release release;
        FASTCOMMS_CHECK(!c->is_aborted(), kAborted, c->prefix(OpKind::kAllToAllVSingle),
                        "device_alltoallv_single: the communicator was aborted");
        auto g = group_for(c, out.nbytes());
        g->run(out, in, os, is, current_stream(c->device()), std::chrono::milliseconds(timeout_ms),
               ix ? &*ix : nullptr);
      },
      py::arg("comm"), py::arg("output"), py::arg("input"), py::arg("output_split_sizes"),
      py::arg("input_split_sizes"), py::arg("timeout_ms") = 0, py::arg("input_index") = py::none(),
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
  m.def(
      "_moe_gather_dequant",
      [](const at::Tensor& out, const at::Tensor& src, const at::Tensor& scales,
         const at::Tensor& index, const std::optional<at::Tensor>& count) {
        const char* what = "moe gather_dequant";
        FASTCOMMS_CHECK(out.is_cuda(), kInvalidArgument, what, ": out must be a CUDA tensor, got ",
                        out.device().str());
        check_cuda(what, "src", src, out);
        FASTCOMMS_CHECK(out.dim() == 2 && out.is_contiguous(), kInvalidArgument, what,
                        ": out must be a contiguous (rows, d) tensor, got ", out.sizes());
        const int64_t n = out.size(0), d = out.size(1);
        FASTCOMMS_CHECK(src.dim() == 2 && src.size(1) == d && src.stride(1) == 1 &&
                            src.stride(0) >= d && src.element_size() == 1,
                        kInvalidArgument, what, ": src must be FP8 (rows, ", d,
                        ") with rows of unit stride, got ", c10::toString(src.scalar_type()), " ",
                        src.sizes(), " strides ", src.strides());
        check_plan(what, "scales", scales, out, at::kFloat, n);
        check_index(what, index, n, out);
        const int64_t* c = nullptr;
        if (count) {
          check_plan(what, "count", *count, out, at::kLong, 1);
          c = count->data_ptr<int64_t>();
        }
#ifdef FASTCOMMS_WITH_CUDA
        c10::DeviceGuard guard(out.device());
#endif
        gather_dequant_rows_device(out.data_ptr(), to_dtype(out.scalar_type()), src.data_ptr(),
                                   to_dtype(src.scalar_type()), src.stride(0), src.size(0),
                                   scales.data_ptr<float>(), index.data_ptr<int64_t>(), n, c, d,
                                   stream_of(out));
      },
      py::arg("out"), py::arg("src"), py::arg("scales"), py::arg("index"),
      py::arg("count") = py::none(),
      "out[i] = dequantize(src[index[i]], scales[i]) for i < count (read on the GPU), zeros for "
      "index < 0; rows from count on untouched");
  m.def("_moe_has_row_kernels", &has_row_kernels);
  // NOTE [moe plan kernels] (include/fastcomms/plan/moe_plan.hpp)
  m.def("_moe_plan_fits", &moe_plan_fits, py::arg("ranks"), py::arg("local_experts"));
  m.def(
      "_moe_plan_home",
      [](const at::Tensor& idx, int64_t P, int64_t L, int64_t E, int64_t max_tokens,
         int64_t overflow, int64_t bad, int64_t dup) {
        const char* what = "moe plan_home";
        FASTCOMMS_CHECK(idx.is_cuda() && idx.scalar_type() == at::kLong && idx.dim() == 2 &&
                            idx.is_contiguous(),
                        kInvalidArgument, what,
                        ": topk_idx must be a contiguous int64 (tokens, k) CUDA tensor, got ",
                        c10::toString(idx.scalar_type()), " ", idx.sizes(), " on ",
                        idx.device().str());
        const int64_t T = idx.size(0), k = idx.size(1), S = T * std::min(k, P);
        const auto i64 = idx.options();
        at::Tensor head = at::empty({P, plan::kMoeHeader}, i64);
        at::Tensor owner = at::empty({T, k}, i64), local = at::empty({T, k}, i64);
        at::Tensor send_tok = at::empty({S}, i64), send_dest = at::empty({S}, i64);
        at::Tensor scratch =
            at::empty({plan::moe_plan_scratch(T * k, P)}, idx.options().dtype(at::kInt));
        plan::MoePlanHome a;
        a.idx = idx.data_ptr<int64_t>();
        a.tokens = T;
        a.k = k;
        a.ranks = P;
        a.local_experts = L;
        a.num_experts = E;
        a.max_tokens = max_tokens;
        a.overflow_bit = overflow;
        a.bad_expert_bit = bad;
        a.duplicate_bit = dup;
        a.owner = owner.data_ptr<int64_t>();
        a.local = local.data_ptr<int64_t>();
        a.send_tok = send_tok.data_ptr<int64_t>();
        a.send_dest = send_dest.data_ptr<int64_t>();
        a.send_rows = S;
        a.head = head.data_ptr<int64_t>();
        a.scratch = scratch.data_ptr<int32_t>();
#ifdef FASTCOMMS_WITH_CUDA
        c10::DeviceGuard guard(idx.device());
#endif
        moe_plan_home_device(a, stream_of(idx));
        return py::make_tuple(head, owner, local, send_tok, send_dest);
      },
      "The home side of the routing plan: (head (P, 5), owner, local, send_tok, send_dest)");
  m.def(
      "_moe_plan_send",
      [](const at::Tensor& got, const at::Tensor& head, const at::Tensor& owner,
         const at::Tensor& local, const at::Tensor& send_tok, const at::Tensor& send_dest,
         const std::optional<at::Tensor>& scales, const std::optional<at::Tensor>& weights,
         const at::Tensor& flags, const at::Tensor& send, int64_t row_bytes) {
        const char* what = "moe plan_send";
        FASTCOMMS_CHECK(owner.is_cuda() && owner.dim() == 2, kInvalidArgument, what,
                        ": owner must be a (tokens, k) CUDA tensor, got ", owner.sizes());
        const int64_t T = owner.size(0), k = owner.size(1), P = head.size(0);
        const int64_t S = T * std::min(k, P);
        check_plan(what, "head", head, owner, at::kLong, P * plan::kMoeHeader);
        check_plan(what, "got", got, owner, at::kLong, P * plan::kMoeHeader);
        check_plan(what, "owner", owner, owner, at::kLong, T * k);
        check_plan(what, "local", local, owner, at::kLong, T * k);
        check_plan(what, "send_tok", send_tok, owner, at::kLong, S);
        check_plan(what, "send_dest", send_dest, owner, at::kLong, S);
        check_plan(what, "flags", flags, owner, at::kLong, 5);
        if (scales) check_plan(what, "scales", *scales, owner, at::kFloat, T);
        if (weights) check_plan(what, "weights", *weights, owner, at::kFloat, T * k);
        check_cuda(what, "send", send, owner);
        FASTCOMMS_CHECK(send.scalar_type() == at::kByte && send.dim() == 2 && send.size(0) == S &&
                            send.stride(1) == 1 && row_bytes >= 0 &&
                            send.size(1) >= row_bytes + 4 * (2 + 2 * k),
                        kInvalidArgument, what, ": send must be uint8 (", S,
                        ", >= ", row_bytes + 4 * (2 + 2 * k), ") with rows of unit stride, got ",
                        c10::toString(send.scalar_type()), " ", send.sizes());
        const auto i64 = owner.options();
        at::Tensor send_splits = at::empty({P}, i64), recv_splits = at::empty({P}, i64);
        at::Tensor back_splits = at::empty({P}, i64), slot_src = at::empty({T * k}, i64);
        at::Tensor send_total = at::empty({1}, i64);
        at::Tensor scratch = at::empty({plan::moe_plan_scratch(T * k, P)}, i64.dtype(at::kInt));
        plan::MoePlanSend a;
        a.got = got.data_ptr<int64_t>();
        a.head = head.data_ptr<int64_t>();
        a.owner = owner.data_ptr<int64_t>();
        a.local = local.data_ptr<int64_t>();
        a.send_tok = send_tok.data_ptr<int64_t>();
        a.send_dest = send_dest.data_ptr<int64_t>();
        a.scales = scales ? scales->data_ptr<float>() : nullptr;
        a.weights = weights ? weights->data_ptr<float>() : nullptr;
        a.tokens = T;
        a.k = k;
        a.ranks = P;
        a.send_rows = S;
        a.flags = flags.data_ptr<int64_t>();
        a.meta = send.data_ptr<uint8_t>() + row_bytes;
        a.meta_pitch = send.stride(0);
        a.send_splits = send_splits.data_ptr<int64_t>();
        a.recv_splits = recv_splits.data_ptr<int64_t>();
        a.back_splits = back_splits.data_ptr<int64_t>();
        a.slot_src = slot_src.data_ptr<int64_t>();
        a.send_total = send_total.data_ptr<int64_t>();
        a.scratch = scratch.data_ptr<int32_t>();
#ifdef FASTCOMMS_WITH_CUDA
        c10::DeviceGuard guard(owner.device());
#endif
        moe_plan_send_device(a, stream_of(owner));
        return py::make_tuple(send_splits, recv_splits, back_splits, slot_src, send_total);
      },
      "The plan after the header exchange: (send_splits, recv_splits, back_splits, slot_src, "
      "send_total); the metadata written into send[:, row_bytes:]");
  m.def(
      "_moe_plan_expert",
      [](const at::Tensor& recv, int64_t row_bytes, const at::Tensor& recv_splits, int64_t k,
         int64_t L, int64_t capacity, bool want_scales) {
        const char* what = "moe plan_expert";
        check_cuda(what, "recv", recv, recv);
        FASTCOMMS_CHECK(recv.scalar_type() == at::kByte && recv.dim() == 2 && recv.stride(1) == 1 &&
                            k >= 1 && row_bytes >= 0 && recv.size(1) >= row_bytes + 4 * (2 + 2 * k),
                        kInvalidArgument, what,
                        ": recv must be uint8 (rows, >= ", row_bytes + 4 * (2 + 2 * k),
                        ") with rows of unit stride, got ", c10::toString(recv.scalar_type()), " ",
                        recv.sizes());
        const int64_t P = recv_splits.numel();
        check_plan(what, "recv_splits", recv_splits, recv, at::kLong, P);
        const auto i64 = recv.options().dtype(at::kLong);
        const auto f32 = recv.options().dtype(at::kFloat);
        at::Tensor counts = at::empty({L}, recv.options().dtype(at::kInt));
        at::Tensor row_tok = at::empty({capacity}, i64), row_slot = at::empty({capacity}, i64);
        at::Tensor row_keep = at::empty({capacity}, recv.options().dtype(at::kBool));
        at::Tensor back_rows = at::empty({capacity}, i64), rows_from = at::empty({P}, i64);
        at::Tensor row_total = at::empty({1}, i64), row_w = at::empty({capacity}, f32);
        at::Tensor src = at::empty({capacity, 2}, i64);
        std::optional<at::Tensor> row_scales;
        if (want_scales) row_scales = at::empty({capacity}, f32);
        at::Tensor scratch = at::empty({plan::moe_plan_scratch(recv.size(0) * k, L)},
                                       recv.options().dtype(at::kInt));
        plan::MoePlanExpert a;
        a.meta = recv.data_ptr<uint8_t>() + row_bytes;
        a.meta_pitch = recv.stride(0);
        a.recv_rows = recv.size(0);
        a.recv_splits = recv_splits.data_ptr<int64_t>();
        a.ranks = P;
        a.k = k;
        a.local_experts = L;
        a.capacity = capacity;
        a.counts = counts.data_ptr<int32_t>();
        a.row_tok = row_tok.data_ptr<int64_t>();
        a.row_slot = row_slot.data_ptr<int64_t>();
        a.row_keep = row_keep.data_ptr<bool>();
        a.back_rows = back_rows.data_ptr<int64_t>();
        a.rows_from = rows_from.data_ptr<int64_t>();
        a.row_total = row_total.data_ptr<int64_t>();
        a.row_w = row_w.data_ptr<float>();
        a.src = src.data_ptr<int64_t>();
        a.row_scales = row_scales ? row_scales->data_ptr<float>() : nullptr;
        a.scratch = scratch.data_ptr<int32_t>();
#ifdef FASTCOMMS_WITH_CUDA
        c10::DeviceGuard guard(recv.device());
#endif
        moe_plan_expert_device(a, stream_of(recv));
        return py::make_tuple(counts, row_tok, row_slot, row_keep, back_rows, rows_from, row_total,
                              row_w, src, row_scales);
      },
      "The expert side of the plan from the received metadata: (counts, row_tok, row_slot, "
      "row_keep, back_rows, rows_from, row_total, row_w, src, row_scales or None)");
}

}  // namespace fastcomms::python
