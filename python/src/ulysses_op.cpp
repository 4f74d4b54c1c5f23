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
// tracer or a mode must see the call. The family's other overloads: `.out` (the caller's
// buffer; refused under grad mode), `.fp8` (FP8 on the wire: NOTE [fp8 wire exchange]) and
// `.fp8_out`, each with the same kernels per key and reached the same two ways.
//
// NOTE [ulysses op errors]: a kernel's argument and dtype errors leave it as c10::ValueError /
// c10::TypeError, which torch's entry points (torch.ops, the compiler) turn into ValueError /
// TypeError; the module's translator maps them to fastcomms' own classes (NOTE [error
// mapping]). Other errors (timeouts, aborts, a peer's failure) stay fastcomms::Error.
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/SymInt.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "binding.hpp"
#include "fp8_rows.hpp"
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

std::string where(const UlyssesTransport& t, const char* op = "all_to_all_4d") {
  return detail::cat("[rank ", t.rank(), "/", t.size(), "] ", op, ": ");
}

// One exchange per batch row would hang ranks that disagree on the batch.
bool batched(const at::Tensor& x) {
  return x.key_set().has(c10::DispatchKey::FuncTorchBatched) ||
         x.key_set().has(c10::DispatchKey::Batched);
}
constexpr const char* kVmapRefusal =
    "torch.vmap (or autograd.grad(is_grads_batched=True)) is not supported: every rank must issue "
    "each exchange once, and ranks that disagree on the batch would hang; loop over the batch "
    "explicitly or fold it into the tensor's batch dimension";

std::string dtype_str(at::ScalarType s) {
  switch (s) {
    case at::kHalf:
      return "float16";
    case at::kBFloat16:
      return "bfloat16";
    case at::kFloat:
      return "float32";
    case at::kDouble:
      return "float64";
    case at::kFloat8_e4m3fn:
      return "float8_e4m3fn";
    case at::kFloat8_e5m2:
      return "float8_e5m2";
    case at::kInt:
      return "int32";
    case at::kLong:
      return "int64";
    case at::kShort:
      return "int16";
    case at::kChar:
      return "int8";
    case at::kByte:
      return "uint8";
    case at::kBool:
      return "bool";
    default:
      return c10::toString(s);
  }
}

void check_x(const UlyssesTransport& t, const at::Tensor& x, const char* op = "all_to_all_4d") {
  FASTCOMMS_CHECK(x.dim() == 4, kInvalidArgument, where(t, op),
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

// The refusals of `out=` the transport cannot make (a summed result, FP8 rows): the result's
// shape in x's dtype (contiguous where the caller writes it as rows), and data where x has data.
void check_out(const UlyssesTransport& t, const at::Tensor& x, const at::Tensor& out,
               const std::vector<int64_t>& result, bool contiguous) {
  FASTCOMMS_CHECK(
      out.sizes() == at::IntArrayRef(result) && out.dtype() == x.dtype() &&
          (!contiguous || out.is_contiguous()),
      kInvalidArgument, where(t), "out is ", out.sizes(), " ", dtype_str(out.scalar_type()),
      contiguous && !out.is_contiguous() ? " (not contiguous)" : "", ", expected ",
      contiguous ? "a contiguous " : "", at::IntArrayRef(result), " ", dtype_str(x.scalar_type()));
  FASTCOMMS_CHECK(out.is_meta() == x.is_meta(), kInvalidArgument, where(t), "x is on ",
                  x.device().str(), " but out is on ", out.device().str(),
                  "; pass both on meta for shapes, or both with data");
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
    if (out) check_out(*t, x, *out, result, false);
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

// -- FP8 on the wire --------------------------------------------------------------------------
// NOTE [fp8 wire exchange]: a call with `wire_dtype` quantizes x's rows of d values (one float32
// scale per (token, head) row), moves the FP8 rows and the scales as two exchanges of the same
// geometry (the scales padded to 16 bytes a row on the peer-to-peer paths) and dequantizes into
// x's dtype (or returns both, `return_scales`): exactly quantize -> exchange -> dequantize of the
// torch reference (tests/python/fp8_reference.py; the numerics are NOTE [fp8 wire] in
// include/fastcomms/ulysses/fp8.hpp). Mode 1 with kv replicas exchanges the virtual heads and sums
// each head's replicas after dequantizing. On CUDA the transport may quantize as it writes into
// the peers' windows and dequantize in its copy-out (NOTE [fp8 fused push]); where it has no such
// path for the call it says so and the three steps run. Backward: the gradient in its own dtype
// by the plain op in the other mode, or FP8 again with `grad_wire_dtype`.
bool is_wire(at::ScalarType s) { return s == at::kFloat8_e4m3fn || s == at::kFloat8_e5m2; }

// Every check of an FP8 call, before anything runs or is traced.
void check_fp8(const UlyssesTransport& t, const at::Tensor& x, int64_t mode, int64_t kv,
               std::optional<at::ScalarType> wire, bool return_scales,
               std::optional<at::ScalarType> grad_wire, bool has_out) {
  FASTCOMMS_CHECK(wire.has_value(), kInvalidArgument, where(t),
                  "return_scales and grad_wire_dtype need wire_dtype");
  const at::ScalarType v = x.scalar_type();
  FASTCOMMS_CHECK(v == at::kHalf || v == at::kBFloat16 || v == at::kFloat, kTypeError, where(t),
                  "x's dtype with wire_dtype must be float16, bfloat16 or float32, got ",
                  dtype_str(v));
  FASTCOMMS_CHECK(is_wire(*wire), kTypeError, where(t),
                  "wire_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ",
                  dtype_str(*wire));
  FASTCOMMS_CHECK(!grad_wire || is_wire(*grad_wire), kTypeError, where(t),
                  "grad_wire_dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ",
                  grad_wire ? dtype_str(*grad_wire) : "");
  // The FP8 rows are new tensors of the wire dtype, and mode 1 with replicas sums after
  // dequantizing: neither has FP8 rows to hand back.
  FASTCOMMS_CHECK(!return_scales || (!has_out && !(mode == 1 && kv > 1)), kInvalidArgument,
                  where(t),
                  "return_scales=True returns new FP8 rows and scales; it takes no out= and no "
                  "mode 1 with kv_replicas > 1 (whose replicas are summed after dequantizing)");
}

std::vector<at::Tensor> run_fp8(const at::Tensor& x_in, int64_t group, int64_t mode,
                                at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads,
                                int64_t kv, std::optional<at::ScalarType> wire_arg,
                                bool return_scales, std::optional<at::ScalarType> grad_wire,
                                const std::optional<at::Tensor>& out) {
  return torch_errors([&]() -> std::vector<at::Tensor> {
    const UlyssesTransportPtr t = groups().get(group);
    check_x(*t, x_in);
    check_fp8(*t, x_in, mode, kv, wire_arg, return_scales, grad_wire, out.has_value());
    const at::ScalarType wire = *wire_arg;
    const at::Tensor x = x_in.contiguous();
    const bool summed = mode == 1 && kv > 1;
    const int64_t k = summed ? 1 : kv;  // summed: the virtual heads as sent, summed below
    const auto in = concrete_shape(x);
    const auto result = shapes(*t, in, x.element_size(), make_args(mode, seq, heads, kv)).second;
    const UlyssesArgs a = make_args(mode, seq, heads, k);
    const std::vector<int64_t> exch = shapes(*t, in, x.element_size(), a).first;
    const std::vector<int64_t> exch_rows(exch.begin(), exch.end() - 1);
    if (out) check_out(*t, x, *out, result, true);
    if (x.is_meta()) {
      if (return_scales)
        return {at::empty(exch, x.options().dtype(wire)),
                at::empty(exch_rows, x.options().dtype(at::kFloat))};
      return {out ? *out : at::empty(result, x.options())};
    }
    const auto into = [&](at::IntArrayRef shape) {
      return out && !summed ? *out : at::empty(shape, x.options());
    };
    at::Tensor got;
    if (x.is_cuda()) {  // NOTE [fp8 fused push]
      const at::Tensor dst = return_scales ? at::empty(exch, x.options().dtype(wire)) : into(exch);
      const at::Tensor so =
          return_scales ? at::empty(exch_rows, x.options().dtype(at::kFloat)) : at::Tensor();
      const TensorView xv = view(x), dv = view(dst);
      std::optional<TensorView> sv;
      if (so.defined()) sv = view(so);
      void* stream = current_stream(xv.device);
      bool done = false;
      without_gil([&] {
        done = t->all_to_all_4d_fp8(xv, dv, sv ? &*sv : nullptr, a, to_dtype(wire), stream);
      });
      if (done && return_scales) return {dst, so};
      if (done) got = dst;
    }
    if (!got.defined()) {
      const at::Tensor q = at::empty(x.sizes(), x.options().dtype(wire));
      const at::Tensor scales = at::empty(x.sizes().slice(0, 3), x.options().dtype(at::kFloat));
      fp8_quantize("all_to_all_4d", x, q, scales);
      at::Tensor s = scales.unsqueeze(-1);
      const std::string kind = t->kind();
      if (kind == "nvlink" || kind == "hierarchical")  // peer-to-peer rows: 16-byte units
        s = at::constant_pad_nd(s, {0, 3}, 0);
      const at::Tensor qo = run(q, group, mode, seq, heads, k, std::nullopt);
      const at::Tensor so =
          run(s, group, mode, seq, heads, k, std::nullopt).select(-1, 0).contiguous();
      if (return_scales) return {qo, so};
      got = into(qo.sizes());
      fp8_dequantize("all_to_all_4d", qo, so, got);
    }
    if (!summed) return {got};
    at::Tensor dst = out ? *out : at::empty(result, x.options());
    sum_replicas(got, kv, dst);
    return {dst};
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

// `.out`: CPU, CUDA and Meta alike (run() stops after its checks for meta tensors).
at::Tensor& out_kernel(const at::Tensor& x, int64_t group, int64_t mode,
                       at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads, int64_t kv,
                       at::Tensor& out) {
  run(x, group, mode, seq, heads, kv, out);
  return out;
}

// `.fp8` and `.fp8_out`: CPU, CUDA and Meta alike (NOTE [fp8 wire exchange]).
std::vector<at::Tensor> fp8_kernel(const at::Tensor& x, int64_t group, int64_t mode,
                                   at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads,
                                   int64_t kv, std::optional<at::ScalarType> wire,
                                   bool return_scales, std::optional<at::ScalarType> grad_wire) {
  return run_fp8(x, group, mode, seq, heads, kv, wire, return_scales, grad_wire, std::nullopt);
}

at::Tensor& fp8_out_kernel(const at::Tensor& x, int64_t group, int64_t mode,
                           at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads, int64_t kv,
                           std::optional<at::ScalarType> wire, bool return_scales,
                           std::optional<at::ScalarType> grad_wire, at::Tensor& out) {
  run_fp8(x, group, mode, seq, heads, kv, wire, return_scales, grad_wire, out);
  return out;
}

using Signature = at::Tensor(const at::Tensor&, int64_t, int64_t, at::OptionalIntArrayRef,
                             at::OptionalIntArrayRef, int64_t);
using OutSignature = at::Tensor&(const at::Tensor&, int64_t, int64_t, at::OptionalIntArrayRef,
                                 at::OptionalIntArrayRef, int64_t, at::Tensor&);
using Fp8Signature = std::vector<at::Tensor>(const at::Tensor&, int64_t, int64_t,
                                             at::OptionalIntArrayRef, at::OptionalIntArrayRef,
                                             int64_t, std::optional<at::ScalarType>, bool,
                                             std::optional<at::ScalarType>);
using Fp8OutSignature = at::Tensor&(const at::Tensor&, int64_t, int64_t, at::OptionalIntArrayRef,
                                    at::OptionalIntArrayRef, int64_t, std::optional<at::ScalarType>,
                                    bool, std::optional<at::ScalarType>, at::Tensor&);

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* overload) {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("fastcomms::ulysses_all_to_all_4d", overload)
      .typed<Sig>();
}

const c10::TypedOperatorHandle<Signature>& op() {
  static const auto handle = find<Signature>("");
  return handle;
}
const c10::TypedOperatorHandle<OutSignature>& out_op() {
  static const auto handle = find<OutSignature>("out");
  return handle;
}
const c10::TypedOperatorHandle<Fp8Signature>& fp8_op() {
  static const auto handle = find<Fp8Signature>("fp8");
  return handle;
}
const c10::TypedOperatorHandle<Fp8OutSignature>& fp8_out_op() {
  static const auto handle = find<Fp8OutSignature>("fp8_out");
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

// NOTE [fp8 wire exchange]: backward is the other mode with the same splits, the gradient in its
// own dtype (the plain op) or as grad_wire (this op again, so double backward stays FP8).
at::Tensor fp8_backward_exchange(const at::Tensor& g, int64_t group, int64_t mode,
                                 at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads,
                                 int64_t kv, std::optional<at::ScalarType> grad_wire) {
  if (!grad_wire) return op().call(g.contiguous(), group, mode, seq, heads, kv);
  return fp8_op().call(g.contiguous(), group, mode, seq, heads, kv, grad_wire, false, grad_wire)[0];
}

class UlyssesFp8Function : public torch::autograd::Function<UlyssesFp8Function> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, int64_t group, int64_t mode,
                                                std::optional<std::vector<int64_t>> seq,
                                                std::optional<std::vector<int64_t>> heads,
                                                int64_t kv, std::optional<at::ScalarType> wire,
                                                std::optional<at::ScalarType> grad_wire) {
    ctx->saved_data["group"] = group;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["kv"] = kv;
    if (seq) ctx->saved_data["seq"] = *seq;
    if (heads) ctx->saved_data["heads"] = *heads;
    if (grad_wire) ctx->saved_data["grad_wire"] = *grad_wire;
    at::AutoDispatchBelowADInplaceOrView below;
    return fp8_op().call(x, group, mode, as_ref(seq), as_ref(heads), kv, wire, false, grad_wire);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto& d = ctx->saved_data;
    std::optional<std::vector<int64_t>> seq, heads;
    std::optional<at::ScalarType> grad_wire;
    if (d.count("seq")) seq = d.at("seq").toIntVector();
    if (d.count("heads")) heads = d.at("heads").toIntVector();
    if (d.count("grad_wire")) grad_wire = d.at("grad_wire").toScalarType();
    at::Tensor g = fp8_backward_exchange(grads[0], d.at("group").toInt(), 1 - d.at("mode").toInt(),
                                         as_ref(seq), as_ref(heads), d.at("kv").toInt(), grad_wire);
    return {g,
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

// out= and the FP8 rows with their scales are not differentiable: refused under grad mode.
[[noreturn]] void refuse_grad(int64_t group, const char* what) {
  const UlyssesTransportPtr t = groups().get(group);
  throw Error(ErrorCode::kUnsupported,
              where(*t) + what + " not differentiable; x requires grad under grad mode");
}

std::vector<at::Tensor> fp8_autograd_kernel(const at::Tensor& x, int64_t group, int64_t mode,
                                            at::OptionalIntArrayRef seq,
                                            at::OptionalIntArrayRef heads, int64_t kv,
                                            std::optional<at::ScalarType> wire, bool return_scales,
                                            std::optional<at::ScalarType> grad_wire) {
  const bool grad = at::GradMode::is_enabled() && x.requires_grad();
  if (grad && return_scales) refuse_grad(group, "out= and return_scales=True are");
  std::vector<at::Tensor> result;
  if (grad) {
    result =
        UlyssesFp8Function::apply(x, group, mode, to_vec(seq), to_vec(heads), kv, wire, grad_wire);
  } else {
    at::AutoDispatchBelowADInplaceOrView below;
    result = fp8_op().call(x, group, mode, seq, heads, kv, wire, return_scales, grad_wire);
  }
  const at::Tensor& tangent = x._fw_grad(/*level=*/0);
  if (tangent.defined() && !return_scales) {  // forward-mode AD: the tangent as the gradient
    at::Tensor t_out;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      t_out = fp8_backward_exchange(tangent, group, mode, seq, heads, kv, grad_wire);
    }
    result[0]._set_fw_grad(t_out, /*level=*/0, /*is_inplace_op=*/false);
  }
  return result;
}

at::Tensor& out_autograd_kernel(const at::Tensor& x, int64_t group, int64_t mode,
                                at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads,
                                int64_t kv, at::Tensor& out) {
  if (at::GradMode::is_enabled() && x.requires_grad()) refuse_grad(group, "out= is");
  at::AutoDispatchBelowADInplaceOrView below;
  return out_op().call(x, group, mode, seq, heads, kv, out);
}

at::Tensor& fp8_out_autograd_kernel(const at::Tensor& x, int64_t group, int64_t mode,
                                    at::OptionalIntArrayRef seq, at::OptionalIntArrayRef heads,
                                    int64_t kv, std::optional<at::ScalarType> wire,
                                    bool return_scales, std::optional<at::ScalarType> grad_wire,
                                    at::Tensor& out) {
  if (at::GradMode::is_enabled() && x.requires_grad())
    refuse_grad(group, "out= and return_scales=True are");
  at::AutoDispatchBelowADInplaceOrView below;
  return fp8_out_op().call(x, group, mode, seq, heads, kv, wire, return_scales, grad_wire, out);
}

void refuse_batched(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  const int64_t group = (*stack)[1].toInt();
  const UlyssesTransportPtr t = groups().get(group);
  TORCH_CHECK(false, where(*t), kVmapRefusal);
}

// -- the async form ---------------------------------------------------------------------------
// NOTE [async ulysses in c++]: UlyssesGroup.all_to_all_4d_async is one call of UlyssesAsync.call,
// which a group holds beside its transport: the checks (NOTE [async ulysses checks]), the async
// lane (its own transport, windows and barriers: NOTE [async lane]) and its id in the op's
// table, the side stream, the lend ring and the completion torch's work registry holds for the
// result (NOTE [async result waits]); Python wraps the returned tensor as an
// AsyncCollectiveTensor. CUDA calls run on the side stream, ordered after the caller's current
// stream; CPU calls run the transport's own async path (NOTE [dropped async results]).

// NOTE [async result waits]: the work torch's registry holds for an AsyncCollectiveTensor of
// an async CUDA call, recording an event on the side stream after the call.
// blockCurrentStream() makes the calling thread's current stream wait for it (no host block);
// wait() does too, after waiting for the event on the host, so it is right from whichever
// thread torch calls it. Device-generic (c10::Event), so a build without CUDA orders a
// torch.distributed group's CUDA calls the same way.
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
  void order() {
    ev_.block(c10::impl::getDeviceGuardImpl(ev_.device_type())
                  ->getStream(c10::Device(ev_.device_type(), ev_.device_index())));
  }
  c10::Event ev_;
};

// NOTE [dropped async results]: torch's work registry keeps the work of an AsyncCollectiveTensor
// until a wait on it, forever for a result dropped unwaited, and a CPU call's work holds its
// buffers (NOTE [work keeps its buffers]; the unpack into the output runs in wait()). So every CPU
// async call's work is queued (pending()), and each later call from Python finishes those whose
// exchange is over (in call order: the unpack, then the release), leaving a small registry entry
// as torch's own functional collectives do (docs/reliability.md). A kept result reads the same;
// its wait raises the call's error.
class HostWork final : public c10d::Work {
 public:
  explicit HostWork(std::optional<PyWork> w) : work_(std::move(w)) {}
  // Whether finish() would not block: no call left, or its tensors are released.
  bool released() const { return !work_ || work_->work->tensors_released(); }
  // Waits for the call once (its unpack into the output included) and lets go of it; a later
  // wait raises what this one raised.
  void finish() {
    std::optional<PyWork> w;
    w.swap(work_);
    if (!w) return;
    try {
      if (PyGILState_Check()) {
        py::gil_scoped_release release;
        w->wait_nogil();
      } else {
        w->wait_nogil();
      }
    } catch (...) {
      error_ = std::current_exception();
    }
    py::gil_scoped_acquire gil;  // NOTE [python tensors outlive their op]
    w.reset();
  }
  bool wait(std::chrono::milliseconds) override {
    finish();
    if (error_) std::rethrow_exception(error_);
    return true;
  }
  // A CPU result has no stream to order: the first use waits on this thread (never the default's
  // helper thread, which would need the interpreter this thread may hold).
  void blockCurrentStream() override { wait(std::chrono::milliseconds(0)); }
  bool isCompleted() override { return !work_ || work_->work->is_completed(); }

 private:
  std::optional<PyWork> work_;
  std::exception_ptr error_;
};

std::deque<c10::intrusive_ptr<HostWork>>& pending() {
  static auto* q = new std::deque<c10::intrusive_ptr<HostWork>>;  // guarded by the GIL
  return *q;
}

// Finishes the queued CPU async calls whose exchange is over, in call order (GIL held).
void finish_done() {
  auto& q = pending();
  while (!q.empty() && q.front()->released()) {
    const c10::intrusive_ptr<HostWork> w = q.front();
    q.pop_front();
    w->finish();
  }
}

class UlyssesAsync {
 public:
  static constexpr int kLendRing = 4;

  UlyssesAsync(const PyTransport& t, int64_t group, std::string reason)
      : t_(t.t), device_(t.device), group_(group), reason_(std::move(reason)) {}

  at::Tensor call(const at::Tensor& x_in, int64_t mode, std::optional<at::Tensor> out,
                  std::optional<std::vector<int64_t>> seq,
                  std::optional<std::vector<int64_t>> heads, int64_t kv, bool lend,
                  std::optional<at::ScalarType> wire) {
    FASTCOMMS_CHECK(t_ != nullptr, kInvalidArgument, "UlyssesGroup: the group was destroyed");
    check(x_in, mode, kv, lend, out.has_value());
    const at::Tensor x = x_in.contiguous();
    const bool summed = mode == 1 && kv > 1;
    if (!x.is_cuda()) return call_host(x, mode, std::move(out), seq, heads, kv, summed, wire);
    if (!lane_) {
      {
        py::gil_scoped_release release;
        lane_ = t_->async_lane();
      }
      lane_id_ = groups().add(lane_);
    }
    if (!side_) {
      // high priority: the async call's small barrier kernels get the next free SM ahead of a
      // compute kernel's remaining blocks (the overlap it exists for); torch.cuda.Stream's
      // priority -1, from the same pool
      side_ = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getNewStream(x.device(), -1);
    }
    const c10::Stream s = *side_;
    FASTCOMMS_CHECK(s.device() == x.device(), kInvalidArgument, where(*t_, kOp),
                    "the side stream is on ", s.device().str(), ", x on ", x.device().str(),
                    " (one group, one device)");
    const UlyssesArgs a = make_args(mode, as_ref(seq), as_ref(heads), kv);
    const auto [exch, result] = shapes(*lane_, concrete_shape(x), x.element_size(), a);
    at::Tensor dst = lend ? lent(x, exch, a) : out ? *out : at::empty(result, x.options());
    FASTCOMMS_CHECK(dst.is_cuda() && dst.device() == x.device(), kInvalidArgument, where(*t_, kOp),
                    "the async CUDA call needs x and out on one CUDA device, got ",
                    x.device().str(), " and ", dst.device().str());
    // the caller's current stream on x's device (not the current device's: a caller under
    // another device's guard, or that never set one, still orders x's producers before the call)
    // (device-generic: a build without CUDA runs this path for a torch.distributed group's CUDA
    // tensors too)
    const c10::Stream caller =
        c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA)->getStream(x.device());
    c10::StreamGuard on_side(s);  // the side stream (and x's device) is current for the call
    {
      c10::Event ev(c10::DeviceType::CUDA);  // the side stream waits for the caller's
      ev.record(caller);
      ev.block(s);
    }
    x.record_stream(s);
    dst.record_stream(s);
    if (!summed && !wire) {
      // the transport's call straight on the side stream (NOTE [host cost per call]); a dropped
      // Work parks x and out until it is done (NOTE [python tensors outlive their op])
      transport_call(*lane_, x, dst, a, s.native_handle());
    } else if (wire) {  // NOTE [fp8 wire exchange]: the op's .fp8_out on the side stream
      fp8_out_op().call(x, *lane_id_, mode, as_ref(seq), as_ref(heads), kv, wire, false,
                        std::nullopt, dst);
    } else {  // the replicas' sum too
      out_op().call(x, *lane_id_, mode, as_ref(seq), as_ref(heads), kv, dst);
    }
    c10::Event done(c10::DeviceType::CUDA);
    done.record(s);
    c10d::register_work(dst, c10::make_intrusive<StreamEventWork>(std::move(done)));
    release_finished();
    return dst;
  }

  // The side stream as (stream_id, device_index, device_type), None before the first CUDA call.
  py::object side_stream() const {
    if (!side_) return py::none();
    return py::make_tuple(side_->id(), side_->device_index(),
                          static_cast<int>(side_->device_type()));
  }

  // (device bytes, calls) of the async lane where it is not the group's transport, and the lend
  // ring's bytes.
  py::tuple stats() const {
    UlyssesMemoryStats lane{};
    if (lane_ && lane_ != t_) lane = lane_->memory_stats();
    int64_t ring = 0;
    for (const auto& [dtype, r] : rings_)
      for (const at::Tensor& b : r.bufs)
        if (b.defined()) ring += b.numel();
    return py::make_tuple(lane.device_bytes, lane.calls, ring);
  }

  void tune(const std::string& knob, const std::string& value) {
    if (lane_) lane_->tune(knob, value);
  }

  // Releases the lane (collective on the NVLink transport, as the group's destroy), the ring and
  // the stream; the group's own transport is the caller's. Not `collective` (a reconfigure or an
  // abort, where a peer may be gone): this process lets go of them, no call to its peers.
  void destroy(bool collective) {
    rings_.clear();
    side_.reset();
    if (lane_id_) groups().remove(*lane_id_);
    lane_id_.reset();
    UlyssesTransportPtr lane = std::move(lane_);
    lane_.reset();
    if (collective && lane && lane != t_) {
      py::gil_scoped_release release;
      lane->destroy();
    }
    t_.reset();
  }

 private:
  static constexpr const char* kOp = "all_to_all_4d_async";

  // NOTE [async ulysses checks]: the async form's refusals, before anything is allocated or
  // ordered. The form is no op (it returns an AsyncCollectiveTensor of a stream-ordered call), so
  // these and the transport's are its checks; the messages are the op's.
  void check(const at::Tensor& x, int64_t mode, int64_t kv, bool lend, bool has_out) const {
    const std::string w = where(*t_, kOp);
    if (at::GradMode::is_enabled() && x.requires_grad())
      throw Error(ErrorCode::kUnsupported,
                  w + "the async form is not differentiable; x requires grad under grad mode");
    if (lend) {  // the ring's windows are NVLink windows of the exchange's own shape
      FASTCOMMS_CHECK(!has_out, kInvalidArgument, w,
                      "lend=True returns a buffer of the group's ring; out= cannot be given "
                      "with it");
      FASTCOMMS_CHECK(!(mode == 1 && kv > 1), kInvalidArgument, w,
                      "lend=True with mode 1 and kv_replicas > 1 is not supported (the "
                      "replicas are summed into a new tensor)");
      const std::string kind = t_->kind();
      FASTCOMMS_CHECK(kind == "nvlink", kInvalidArgument, w,
                      "lend=True needs the NVLink transport; this group uses ",
                      kind == "hierarchical" ? kind : std::string("collective"), " (", reason_,
                      ")");
    }
    if (batched(x)) throw Error(ErrorCode::kUnsupported, w + kVmapRefusal);
    check_x(*t_, x, kOp);
    FASTCOMMS_CHECK(!x.is_meta(), kInvalidArgument, w,
                    "x is a meta tensor (no data to move); use all_to_all_4d for shapes");
  }

  // CPU: the transport's own async path, whose completion (the unpack included) is the registered
  // work's wait; a summed or FP8 call runs at once and hands back a done result.
  at::Tensor call_host(const at::Tensor& x, int64_t mode, std::optional<at::Tensor> out,
                       const std::optional<std::vector<int64_t>>& seq,
                       const std::optional<std::vector<int64_t>>& heads, int64_t kv, bool summed,
                       std::optional<at::ScalarType> wire) {
    finish_done();
    at::Tensor dst;
    std::optional<PyWork> work;
    if (wire) {
      if (out)
        dst = fp8_out_op().call(x, group_, mode, as_ref(seq), as_ref(heads), kv, wire, false,
                                std::nullopt, *out);
      else
        dst = fp8_op().call(x, group_, mode, as_ref(seq), as_ref(heads), kv, wire, false,
                            std::nullopt)[0];
    } else if (summed) {
      dst = out ? out_op().call(x, group_, mode, as_ref(seq), as_ref(heads), kv, *out)
                : op().call(x, group_, mode, as_ref(seq), as_ref(heads), kv);
    } else {
      UlyssesArgs a = make_args(mode, as_ref(seq), as_ref(heads), kv);
      dst =
          out ? *out
              : at::empty(shapes(*t_, concrete_shape(x), x.element_size(), a).second, x.options());
      a.async_op = true;
      work = transport_call(*t_, x, dst, a);
    }
    const bool queued = work.has_value();
    auto registered = c10::make_intrusive<HostWork>(std::move(work));
    c10d::register_work(dst, registered);
    if (queued) pending().push_back(std::move(registered));
    release_finished();
    return dst;
  }

  // One ring per dtype of kLendRing windows, grown (never shrunk) to the largest call; a window
  // whose storage has more users than the ring's own reference backs a live result.
  struct Ring {
    std::array<at::Tensor, kLendRing> bufs;
    int next = 0;
  };

  at::Tensor lent(const at::Tensor& x, const std::vector<int64_t>& shape, const UlyssesArgs& a) {
    Ring& ring = rings_[x.scalar_type()];
    const int k = ring.next;
    const int64_t need =
        std::max<int64_t>(16, lane_->max_out_bytes(concrete_shape(x), x.element_size(), a));
    at::Tensor& buf = ring.bufs[k];
    if (buf.defined() && buf.storage().use_count() > 1)
      throw Error(ErrorCode::kUnsupported,
                  detail::cat(where(*t_, "all_to_all_4d_async(lend=True)"), "the ring's ",
                              kLendRing, " torch.", dtype_str(x.scalar_type()),
                              " windows all back live results (the next one, window ", k,
                              ", is still referenced or was never waited on); release a lent "
                              "result (drop it after using it) before lending another, or pass "
                              "out="));
    ring.next = (k + 1) % kLendRing;
    if (!buf.defined() || buf.numel() < need) {  // grow-only; every rank grows at the same call
      buf = at::Tensor();
      std::shared_ptr<void> mem;
      {
        py::gil_scoped_release release;
        mem = lane_->empty_output(need);
      }
      FASTCOMMS_CHECK(mem != nullptr && device_.type == DeviceType::kCUDA, kInternal,
                      where(*t_, kOp), "the async lane gave no window to lend");
      buf = torch::from_blob(
          mem.get(), {need}, [mem](void*) {},
          at::TensorOptions().dtype(at::kByte).device(at::kCUDA, device_.index));
    }
    int64_t numel = 1;
    for (const int64_t n : shape) numel *= n;
    return buf.view(x.scalar_type()).narrow(0, 0, numel).view(shape);
  }

  UlyssesTransportPtr t_;  // the group's transport (its id: group_)
  Device device_;
  int64_t group_;
  std::string reason_;
  UlyssesTransportPtr lane_;
  std::optional<int64_t> lane_id_;
  std::optional<c10::Stream> side_;
  std::map<at::ScalarType, Ring> rings_;
};

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
        finish_done();  // NOTE [dropped async results]
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
        finish_done();  // NOTE [dropped async results]
        out_op().call(x, group, mode, as_ref(seq), as_ref(heads), kv, out);
        release_finished();
        return out;
      },
      py::arg("x"), py::arg("out"), py::arg("group"), py::arg("mode"), py::arg("seq"),
      py::arg("heads"), py::arg("kv_replicas") = 1);
  // FP8 on the wire (NOTE [fp8 wire exchange]): `.fp8` returns [y] or [fp8 rows, scales].
  m.def(
      "ulysses_all_to_all_4d_fp8",
      [](const at::Tensor& x, int64_t group, int64_t mode, std::optional<std::vector<int64_t>> seq,
         std::optional<std::vector<int64_t>> heads, int64_t kv, std::optional<at::ScalarType> wire,
         bool return_scales, std::optional<at::ScalarType> grad_wire) {
        finish_done();  // NOTE [dropped async results]
        auto y = fp8_op().call(x, group, mode, as_ref(seq), as_ref(heads), kv, wire, return_scales,
                               grad_wire);
        release_finished();
        return y;
      },
      py::arg("x"), py::arg("group"), py::arg("mode"), py::arg("seq"), py::arg("heads"),
      py::arg("kv_replicas"), py::arg("wire_dtype"), py::arg("return_scales") = false,
      py::arg("grad_wire_dtype") = py::none());
  m.def(
      "ulysses_all_to_all_4d_fp8_out",
      [](const at::Tensor& x, at::Tensor out, int64_t group, int64_t mode,
         std::optional<std::vector<int64_t>> seq, std::optional<std::vector<int64_t>> heads,
         int64_t kv, std::optional<at::ScalarType> wire, bool return_scales,
         std::optional<at::ScalarType> grad_wire) {
        finish_done();  // NOTE [dropped async results]
        fp8_out_op().call(x, group, mode, as_ref(seq), as_ref(heads), kv, wire, return_scales,
                          grad_wire, out);
        release_finished();
        return out;
      },
      py::arg("x"), py::arg("out"), py::arg("group"), py::arg("mode"), py::arg("seq"),
      py::arg("heads"), py::arg("kv_replicas"), py::arg("wire_dtype"),
      py::arg("return_scales") = false, py::arg("grad_wire_dtype") = py::none());
  // The async form, one per group (UlyssesGroup._async; NOTE [async ulysses in c++]).
  py::class_<UlyssesAsync>(m, "UlyssesAsync")
      .def(py::init<const PyTransport&, int64_t, std::string>(), py::arg("transport"),
           py::arg("group"), py::arg("transport_reason"))
      .def_property_readonly_static("LEND_RING", [](py::object) { return UlyssesAsync::kLendRing; })
      .def("call", &UlyssesAsync::call, py::arg("x"), py::arg("mode"), py::arg("out"),
           py::arg("seq"), py::arg("heads"), py::arg("kv_replicas"), py::arg("lend"),
           py::arg("wire_dtype"))
      .def("side_stream", &UlyssesAsync::side_stream)
      .def("stats", &UlyssesAsync::stats)
      .def("tune", &UlyssesAsync::tune, py::arg("knob"), py::arg("value"))
      .def("destroy", &UlyssesAsync::destroy, py::arg("collective") = true);
  // The collective path over a torch.distributed ProcessGroup.
  m.def("process_group_transport", [](c10::intrusive_ptr<c10d::ProcessGroup> pg, int rank, int size,
                                      int device_index) {
    const Device dev = device_index >= 0 ? Device{DeviceType::kCUDA, device_index} : Device{};
    return PyTransport{std::make_shared<ProcessGroupTransport>(std::move(pg), rank, size), dev};
  });
}

}  // namespace fastcomms::python

// The op's four overloads (NOTE [ulysses op in c++]) share the checks (check_x, check_out,
// check_fp8, the plan's), the Meta kernels and the refusals (grad with out=, vmap).
TORCH_LIBRARY(fastcomms, m) {
  m.def(
      "ulysses_all_to_all_4d(Tensor x, int group, int mode, int[]? seq_splits, "
      "int[]? head_splits, int kv_replicas=1) -> Tensor");
  m.def(
      "ulysses_all_to_all_4d.out(Tensor x, int group, int mode, int[]? seq_splits, "
      "int[]? head_splits, int kv_replicas=1, *, Tensor(a!) out) -> Tensor(a!)");
  m.def(
      "ulysses_all_to_all_4d.fp8(Tensor x, int group, int mode, int[]? seq_splits, "
      "int[]? head_splits, int kv_replicas, ScalarType? wire_dtype, bool return_scales=False, "
      "ScalarType? grad_wire_dtype=None) -> Tensor[]");
  m.def(
      "ulysses_all_to_all_4d.fp8_out(Tensor x, int group, int mode, int[]? seq_splits, "
      "int[]? head_splits, int kv_replicas, ScalarType? wire_dtype, bool return_scales=False, "
      "ScalarType? grad_wire_dtype=None, *, Tensor(a!) out) -> Tensor(a!)");
}

#define FASTCOMMS_ULYSSES_KERNELS(KEY, PLAIN)                                    \
  TORCH_LIBRARY_IMPL(fastcomms, KEY, m) {                                        \
    m.impl("ulysses_all_to_all_4d", &fastcomms::python::PLAIN);                  \
    m.impl("ulysses_all_to_all_4d.out", &fastcomms::python::out_kernel);         \
    m.impl("ulysses_all_to_all_4d.fp8", &fastcomms::python::fp8_kernel);         \
    m.impl("ulysses_all_to_all_4d.fp8_out", &fastcomms::python::fp8_out_kernel); \
  }
FASTCOMMS_ULYSSES_KERNELS(CPU, kernel)
FASTCOMMS_ULYSSES_KERNELS(CUDA, kernel)
FASTCOMMS_ULYSSES_KERNELS(Meta, meta_kernel)
#undef FASTCOMMS_ULYSSES_KERNELS

TORCH_LIBRARY_IMPL(fastcomms, Autograd, m) {
  m.impl("ulysses_all_to_all_4d", &fastcomms::python::autograd_kernel);
  m.impl("ulysses_all_to_all_4d.out", &fastcomms::python::out_autograd_kernel);
  m.impl("ulysses_all_to_all_4d.fp8", &fastcomms::python::fp8_autograd_kernel);
  m.impl("ulysses_all_to_all_4d.fp8_out", &fastcomms::python::fp8_out_autograd_kernel);
}
// torch.vmap, and autograd.grad(is_grads_batched=True) through the legacy Batched key.
#define FASTCOMMS_ULYSSES_REFUSE(KEY)                                                          \
  TORCH_LIBRARY_IMPL(fastcomms, KEY, m) {                                                      \
    for (const char* name : {"ulysses_all_to_all_4d", "ulysses_all_to_all_4d.out",             \
                             "ulysses_all_to_all_4d.fp8", "ulysses_all_to_all_4d.fp8_out"})    \
      m.impl(name,                                                                             \
             torch::CppFunction::makeFromBoxedFunction<&fastcomms::python::refuse_batched>()); \
  }
FASTCOMMS_ULYSSES_REFUSE(FuncTorchBatched)
FASTCOMMS_ULYSSES_REFUSE(Batched)
#undef FASTCOMMS_ULYSSES_REFUSE
