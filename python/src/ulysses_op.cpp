// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The Ulysses all-to-all as one torch op (issue 36, item 1).
//
// NOTE [ulysses op in c++]: `fastcomms::ulysses_all_to_all_4d(Tensor x, int group, int mode,
// int[]? seq_splits, int[]? head_splits, int kv_replicas=1) -> Tensor` is registered here with
// its CPU and CUDA kernels (the group's transport moves the bytes; mode 1 with kv replicas sums
// each head's replicas after the exchange), its Meta kernel (the output shape from plan/, the
// same arithmetic the transports run, so fake tensors and torch.compile see the plan's shapes
// and errors), its autograd (backward is the op in the other mode with the same splits, through
// the dispatcher, so double backward works; forward-mode AD sends the tangent through the same
// exchange) and a refusal under vmap. `group` is the id of a transport in this process's table
// (`UlyssesGroup._id`): an int is what the dispatcher, Dynamo and FakeTensor carry without a
// custom class, and Dynamo guards on it as a constant. fastcomms.ulysses reaches the op one way:
// `_C.ulysses_all_to_all_4d` (a typed dispatcher call, no torch.ops lookup: NOTE [host cost per
// call] in ulysses.py) in plain eager mode, `torch.ops.fastcomms.ulysses_all_to_all_4d` where a
// tracer or a mode must see the call. `out=` calls take `_C.ulysses_all_to_all_4d_out`, which
// runs the same kernel body into the caller's buffer (not differentiable, so not an op).
//
// NOTE [ulysses op errors]: a kernel's argument and dtype errors leave it as c10::ValueError /
// c10::TypeError, which torch's entry points (torch.ops, the compiler) turn into ValueError /
// TypeError; the module's translator maps them to fastcomms' own classes (NOTE [error
// mapping]). Other errors (timeouts, aborts, a peer's failure) stay fastcomms::Error.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/SymInt.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "binding.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

// -- the table of groups ----------------------------------------------------------------------
class GroupTable {
 public:
  int64_t add(UlyssesTransportPtr t) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t id = next_++;
    groups_.emplace(id, std::move(t));
    return id;
  }
  void remove(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    groups_.erase(id);
  }
  UlyssesTransportPtr get(int64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    const auto it = groups_.find(id);
    FASTCOMMS_CHECK(it != groups_.end(), kInvalidArgument, "all_to_all_4d: UlyssesGroup ", id,
                    " was destroyed (or never made in this process)");
    return it->second;
  }

 private:
  std::mutex mu_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, UlyssesTransportPtr> groups_;
};

GroupTable& groups() {
  static auto* t = new GroupTable;  // never destroyed: kernels may run during interpreter exit
  return *t;
}

// NOTE [ulysses op errors]
template <typename Fn>
auto torch_errors(Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kInvalidArgument) TORCH_CHECK_VALUE(false, e.what());
    if (e.code() == ErrorCode::kTypeError) TORCH_CHECK_TYPE(false, e.what());
    throw;
  }
}

// Runs `fn` without the GIL where this thread holds it (a CPU exchange waits for its peers).
template <typename Fn>
void without_gil(Fn&& fn) {
  if (PyGILState_Check()) {
    py::gil_scoped_release release;
    fn();
  } else {
    fn();
  }
}

UlyssesArgs make_args(int64_t mode, at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads,
                      int64_t kv_replicas) {
  UlyssesArgs a;
  a.mode = static_cast<int>(mode);
  if (seq) a.seq_splits = seq->vec();
  if (heads) a.head_splits = heads->vec();
  a.kv_replicas = kv_replicas;
  return a;
}

std::string where(const UlyssesTransport& t) {
  return detail::cat("[rank ", t.rank(), "/", t.size(), "] all_to_all_4d: ");
}

void check_x(const UlyssesTransport& t, const at::Tensor& x) {
  FASTCOMMS_CHECK(x.dim() == 4, kInvalidArgument, where(t),
                  "x must be a 4-D tensor (b, s, h, d), got ", x.sym_sizes());
}

std::array<int64_t, 4> concrete_shape(const at::Tensor& x) {
  std::array<int64_t, 4> s{};
  for (int i = 0; i < 4; ++i) s[i] = x.sym_size(i).guard_int(__FILE__, __LINE__);
  return s;
}

// The exchange's shape (virtual heads for mode 1 with kv replicas) and the result's.
std::pair<std::vector<int64_t>, std::vector<int64_t>> shapes(const UlyssesTransport& t,
                                                             const std::array<int64_t, 4>& in,
                                                             int64_t element_size,
                                                             const UlyssesArgs& a) {
  const auto o = t.output_shape(in, element_size, a);
  std::vector<int64_t> exch(o.begin(), o.end()), result = exch;
  if (a.mode == 1 && a.kv_replicas > 1) result[2] /= a.kv_replicas;  // NOTE [kv replicas]
  return {exch, result};
}

// Moves x into `dst` (the exchange's shape) on the caller's current stream; CUDA transports
// enqueue and return, the CPU ones return once the bytes are in.
void exchange(UlyssesTransport& t, const at::Tensor& x, const at::Tensor& dst,
              const UlyssesArgs& a) {
  const TensorView xv = view(x), dv = view(dst);
  void* stream = current_stream(xv.device);
  without_gil([&] { t.all_to_all_4d(xv, dv, a, stream)->wait(); });
}

// Sums each run of kv virtual heads: (b, s, h * kv, d) -> (b, s, h, d), the backward of
// repeat_interleave(kv, dim=2); integers keep their dtype.
void sum_replicas(const at::Tensor& tmp, int64_t kv, at::Tensor& out) {
  const auto reps = tmp.unflatten(2, {tmp.size(2) / kv, kv});
  at::sum_out(out, reps, {3}, false, tmp.scalar_type());
}

at::Tensor run(const at::Tensor& x_in, int64_t group, int64_t mode, at::OptionalIntArrayRef seq,
               at::OptionalIntArrayRef heads, int64_t kv, const std::optional<at::Tensor>& out) {
  return torch_errors([&]() -> at::Tensor {
    const UlyssesTransportPtr t = groups().get(group);
    check_x(*t, x_in);
    const at::Tensor x = x_in.contiguous();
    const UlyssesArgs a = make_args(mode, seq, heads, kv);
    const bool summed = mode == 1 && kv > 1;
    const auto [exch, result] = shapes(*t, concrete_shape(x), x.element_size(), a);
    if (out) {  // the refusals the transport cannot make: a summed result, shapes only
      FASTCOMMS_CHECK(out->sizes() == at::IntArrayRef(result) && out->dtype() == x.dtype(),
                      kInvalidArgument, where(*t), "out is ", out->sizes(), " ", out->dtype(),
                      ", expected ", at::IntArrayRef(result), " ", x.dtype());
      FASTCOMMS_CHECK(out->is_meta() == x.is_meta(), kInvalidArgument, where(*t), "x is on ",
                      x.device().str(), " but out is on ", out->device().str(),
                      "; pass both on meta for shapes, or both with data");
    }
    if (x.is_meta()) return out ? *out : at::empty(result, x.options());
    if (!summed) {
      at::Tensor dst = out ? *out : at::empty(result, x.options());
      exchange(*t, x, dst, a);
      return dst;
    }
    const at::Tensor tmp = at::empty(exch, x.options());
    exchange(*t, x, tmp, a);
    at::Tensor dst = out ? *out : at::empty(result, x.options());
    sum_replicas(tmp, kv, dst);
    return dst;
  });
}

// -- kernels ---------------------------------------------------------------------------------
at::Tensor kernel(const at::Tensor& x, int64_t group, int64_t mode, at::OptionalIntArrayRef seq,
                  at::OptionalIntArrayRef heads, int64_t kv) {
  return run(x, group, mode, seq, heads, kv, std::nullopt);
}

at::Tensor meta_kernel(const at::Tensor& x, int64_t group, int64_t mode,
                       at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads, int64_t kv) {
  return torch_errors([&]() -> at::Tensor {
    const UlyssesTransportPtr t = groups().get(group);
    check_x(*t, x);
    const auto [exch, result] =
        shapes(*t, concrete_shape(x), x.element_size(), make_args(mode, seq, heads, kv));
    return at::empty(result, x.options());
  });
}

using Signature = at::Tensor(const at::Tensor&, int64_t, int64_t, at::OptionalIntArrayRef,
                             at::OptionalIntArrayRef, int64_t);

const c10::TypedOperatorHandle<Signature>& op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("fastcomms::ulysses_all_to_all_4d", "")
                                 .typed<Signature>();
  return handle;
}

at::OptionalIntArrayRef as_ref(const std::optional<std::vector<int64_t>>& v) {
  return v ? at::OptionalIntArrayRef(*v) : at::OptionalIntArrayRef();
}

std::optional<std::vector<int64_t>> to_vec(at::OptionalIntArrayRef r) {
  return r ? std::optional<std::vector<int64_t>>(r->vec()) : std::nullopt;
}

class UlyssesFunction : public torch::autograd::Function<UlyssesFunction> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            int64_t group, int64_t mode, std::optional<std::vector<int64_t>> seq,
                            std::optional<std::vector<int64_t>> heads, int64_t kv) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["kv"] = kv;
    if (seq) ctx->saved_data["seq"] = *seq;
    if (heads) ctx->saved_data["heads"] = *heads;
    at::AutoDispatchBelowADInplaceOrView below;
    return op().call(x, group, mode, as_ref(seq), as_ref(heads), kv);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& d = ctx->saved_data;
    std::optional<std::vector<int64_t>> seq, heads;
    if (d.count("seq")) seq = d.at("seq").toIntVector();
    if (d.count("heads")) heads = d.at("heads").toIntVector();
    // The inverse exchange, differentiable itself (double backward).
    at::Tensor g = op().call(grads[0].contiguous(), d.at("group").toInt(), 1 - d.at("mode").toInt(),
                             as_ref(seq), as_ref(heads), d.at("kv").toInt());
    return {g, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor autograd_kernel(const at::Tensor& x, int64_t group, int64_t mode,
                           at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads, int64_t kv) {
  const at::Tensor& tangent = x._fw_grad(/*level=*/0);
  at::Tensor result;
  if (at::GradMode::is_enabled() && x.requires_grad()) {
    result = UlyssesFunction::apply(x, group, mode, to_vec(seq), to_vec(heads), kv);
  } else {
    at::AutoDispatchBelowADInplaceOrView below;
    result = op().call(x, group, mode, seq, heads, kv);
  }
  if (tangent.defined()) {  // forward-mode AD: the tangent takes the same exchange
    at::Tensor t_out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      t_out = op().call(tangent.contiguous(), group, mode, seq, heads, kv);
    }
    result._set_fw_grad(t_out, /*level=*/0, /*is_inplace_op=*/false);
  }
  return result;
}

void refuse_batched(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const int64_t group = (*stack)[1].toInt();
  const UlyssesTransportPtr t = groups().get(group);
  TORCH_CHECK(false, where(*t),
              "torch.vmap (or autograd.grad(is_grads_batched=True)) is not supported: every "
              "rank must issue each exchange once, and ranks that disagree on the batch "
              "would hang; loop over the batch explicitly or fold it into the tensor's batch "
              "dimension");
}

// -- the collective path over a torch.distributed ProcessGroup -----------------------------------
// The plan's split sizes, torch ops for the relayout, and the group's own all_to_all_single:
// permute + all_to_all_single + permute, as the reference (API.md §2).
class ProcessGroupTransport final : public UlyssesTransport {
 public:
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> pg, int rank, int size)
      : UlyssesTransport(rank, size, "ulysses"), pg_(std::move(pg)) {}
  std::string kind() const override { return "collective"; }
  UlyssesMemoryStats memory_stats() const override { return {0, calls_.load()}; }

 protected:
  plan::Path path() const override { return plan::Path::kCollective; }
  WorkPtr run(const TensorView& xv, const TensorView& outv, const UlyssesArgs& args,
              const plan::UlyssesRequest&, const std::shared_ptr<const plan::UlyssesPlan>& p,
              void*) override {
    // Bytes move as bytes: float8 travels as uint8, which every process group carries (gloo has
    // no float8 type); elements of one byte, so the split sizes are the same.
    const bool fp8 = xv.dtype == DType::kFloat8E4M3FN || xv.dtype == DType::kFloat8E5M2;
    const at::Tensor x = fp8 ? tensor(xv).view(at::kByte) : tensor(xv);
    const at::Tensor out = fp8 ? tensor(outv).view(at::kByte) : tensor(outv);
    const auto& seq = p->seq_splits;
    const auto& heads = p->head_splits;
    const int64_t b = p->b, d = p->d, r = rank_;
    std::vector<int64_t> in_sizes, out_sizes;
    at::Tensor send;
    if (args.mode == 0) {  // (b, s_r, N, d) -> chunks (h_q, s_r, b, d)
      send = x.permute({2, 1, 0, 3});
      if (p->kv_replicas > 1)  // virtual head v reads source head v // R (one gather)
        send = send.index_select(
            0,
            at::arange(p->heads_total, x.options().dtype(at::kLong)).div(p->kv_replicas, "floor"));
      for (int64_t q = 0; q < size_; ++q) {
        in_sizes.push_back(heads[q] * seq[r] * b * d);
        out_sizes.push_back(heads[r] * seq[q] * b * d);
      }
    } else {  // (b, S, h_r, d) -> chunks (s_q, h_r, b, d)
      send = x.permute({1, 2, 0, 3});
      for (int64_t q = 0; q < size_; ++q) {
        in_sizes.push_back(seq[q] * heads[r] * b * d);
        out_sizes.push_back(seq[r] * heads[q] * b * d);
      }
    }
    send = send.contiguous().reshape({-1});
    int64_t total = 0;
    for (const int64_t n : out_sizes) total += n;
    at::Tensor recv = at::empty({total}, x.options());
    pg_->alltoall_base(recv, send, out_sizes, in_sizes)->wait();
    std::vector<at::Tensor> views;
    int64_t off = 0;
    for (int64_t q = 0; q < size_; ++q) {
      const at::Tensor part = recv.narrow(0, off, out_sizes[q]);
      off += out_sizes[q];
      views.push_back(args.mode == 0 ? part.view({heads[r], seq[q], b, d}).permute({2, 1, 0, 3})
                                     : part.view({seq[r], heads[q], b, d}).permute({2, 0, 1, 3}));
    }
    out.copy_(at::cat(views, args.mode == 0 ? 1 : 2));
    calls_.fetch_add(1);
    return std::make_shared<CompletedWork>();
  }

 private:
  static at::Tensor tensor(const TensorView& v) {
    auto opts = at::TensorOptions().dtype(to_scalar_type(v.dtype));
    opts = v.device.type == DeviceType::kCUDA
               ? opts.device(at::kCUDA, static_cast<c10::DeviceIndex>(v.device.index))
               : opts.device(at::kCPU);
    return at::from_blob(v.data, v.shape, v.strides, opts);
  }
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::atomic<uint64_t> calls_{0};
};

}  // namespace

void bind_ulysses_op(py::module_& m) {
  // Python entry points of NOTE [ulysses op in c++].
  m.def("_ulysses_register", [](const PyTransport& t) { return groups().add(t.t); });
  m.def("_ulysses_unregister", [](int64_t id) { groups().remove(id); });
  m.def(
      "ulysses_all_to_all_4d",
      [](const at::Tensor& x, int64_t group, int64_t mode, std::optional<std::vector<int64_t>> seq,
         std::optional<std::vector<int64_t>> heads, int64_t kv) {
        at::Tensor y = op().call(x, group, mode, as_ref(seq), as_ref(heads), kv);
        release_finished();  // what earlier async calls left parked
        return y;
      },
      py::arg("x"), py::arg("group"), py::arg("mode"), py::arg("seq"), py::arg("heads"),
      py::arg("kv_replicas") = 1);
  m.def(
      "ulysses_shapes",
      [](int64_t group, const std::vector<int64_t>& shape, int64_t element_size, int64_t mode,
         std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads,
         int64_t kv) {
        const UlyssesTransportPtr t = groups().get(group);
        FASTCOMMS_CHECK(shape.size() == 4, kInvalidArgument, where(*t),
                        "x must be a 4-D tensor (b, s, h, d), got ", shape.size(), " dims");
        const auto s = shapes(*t, {shape[0], shape[1], shape[2], shape[3]}, element_size,
                              make_args(mode, as_ref(seq), as_ref(heads), kv));
        return py::make_tuple(s.first, s.second);
      },
      "(the exchange's shape, the result's shape) of a call: the plan's rules");
  m.def(
      "ulysses_all_to_all_4d_out",
      [](const at::Tensor& x, at::Tensor out, int64_t group, int64_t mode,
         std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads,
         int64_t kv) {
        if (at::GradMode::is_enabled() && x.requires_grad()) {
          const UlyssesTransportPtr t = groups().get(group);
          throw Error(ErrorCode::kUnsupported,
                      where(*t) + "out= is not differentiable; x requires grad under grad mode");
        }
        at::Tensor y = run(x, group, mode, as_ref(seq), as_ref(heads), kv, out);
        release_finished();
        return y;
      },
      py::arg("x"), py::arg("out"), py::arg("group"), py::arg("mode"), py::arg("seq"),
      py::arg("heads"), py::arg("kv_replicas") = 1);
  // FP8 on the wire fused into the transfer where the group's transport has such a path
  // (fastcomms._fp8_wire, NOTE [fp8 fused push]); False when it has none for this call. `wire`:
  // 0 float8_e4m3fn, 1 float8_e5m2; `scales` given: out holds the FP8 rows.
  m.def(
      "ulysses_fp8_fused",
      [](const at::Tensor& x, int64_t group, int64_t mode, std::optional<std::vector<int64_t>> seq,
         std::optional<std::vector<int64_t>> heads, int64_t kv, const at::Tensor& out,
         std::optional<at::Tensor> scales, int64_t wire) {
        const UlyssesTransportPtr t = groups().get(group);
        const UlyssesArgs a = make_args(mode, as_ref(seq), as_ref(heads), kv);
        const TensorView xv = view(x), ov = view(out);
        std::optional<TensorView> sv;
        if (scales) sv = view(*scales);
        void* stream = current_stream(xv.device);
        bool done = false;
        without_gil([&] {
          done =
              t->all_to_all_4d_fp8(xv, ov, sv ? &*sv : nullptr, a,
                                   wire == 0 ? DType::kFloat8E4M3FN : DType::kFloat8E5M2, stream);
        });
        return done;
      },
      py::arg("x"), py::arg("group"), py::arg("mode"), py::arg("seq"), py::arg("heads"),
      py::arg("kv_replicas"), py::arg("out"), py::arg("scales"), py::arg("wire"));
  // The collective path over a torch.distributed ProcessGroup.
  m.def("process_group_transport", [](c10::intrusive_ptr<c10d::ProcessGroup> pg, int rank, int size,
                                      int device_index) {
    const Device dev = device_index >= 0 ? Device{DeviceType::kCUDA, device_index} : Device{};
    return PyTransport{std::make_shared<ProcessGroupTransport>(std::move(pg), rank, size), dev};
  });
}

}  // namespace fastcomms::python

TORCH_LIBRARY(fastcomms, m) {
  m.def(
      "ulysses_all_to_all_4d(Tensor x, int group, int mode, int[]? seq_splits, "
      "int[]? head_splits, int kv_replicas=1) -> Tensor");
}

TORCH_LIBRARY_IMPL(fastcomms, CPU, m) {
  m.impl("ulysses_all_to_all_4d", &fastcomms::python::kernel);
}
TORCH_LIBRARY_IMPL(fastcomms, CUDA, m) {
  m.impl("ulysses_all_to_all_4d", &fastcomms::python::kernel);
}
TORCH_LIBRARY_IMPL(fastcomms, Meta, m) {
  m.impl("ulysses_all_to_all_4d", &fastcomms::python::meta_kernel);
}
TORCH_LIBRARY_IMPL(fastcomms, Autograd, m) {
  m.impl("ulysses_all_to_all_4d", &fastcomms::python::autograd_kernel);
}
TORCH_LIBRARY_IMPL(fastcomms, FuncTorchBatched, m) {
  m.impl("ulysses_all_to_all_4d",
         torch::CppFunction::makeFromBoxedFunction<&fastcomms::python::refuse_batched>());
}
// autograd.grad(is_grads_batched=True) batches through the legacy Batched key.
TORCH_LIBRARY_IMPL(fastcomms, Batched, m) {
  m.impl("ulysses_all_to_all_4d",
         torch::CppFunction::makeFromBoxedFunction<&fastcomms::python::refuse_batched>());
}
