// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// torchcomms' NaN check as a C++ hook on the communicator (fastcomms._C.NanCheck; wrapped by
// fastcomms.hooks.NanCheckHook).
//
// NOTE [NaN check on the device]: the check is a pre-hook on the C++ communicator (NOTE [hook op
// record]), so it runs on every path a call takes and registering it leaves the C++ paths on
// (NOTE [process group fast path]). Which tensors: where an op has one tensor it reads or writes
// in place (send, recv, broadcast, all_reduce, reduce) that tensor is checked, labelled input
// unless the op only writes it (recv), when check_inputs and the op reads it or check_outputs and
// the op writes it; otherwise the inputs with check_inputs and the outputs with check_outputs.
// Floating tensors with elements only. A CPU tensor is checked in place, before the op, and a
// NaN raises then. A CUDA tensor is reduced on the caller's current stream (where the op is
// ordered) into a one-element flag copied without blocking into pinned host memory, with an
// event behind it: the host never waits for it. Every later pre-hook of the communicator (and
// check_pending(), which NanCheckHook runs when asked) reads the flags whose events have
// completed and raises for the first NaN found, so a CUDA NaN is reported by the next call on
// the communicator instead of before its own op (the op itself ran with the NaN, as the check
// cannot stop a stream without a host sync). While a current stream captures a CUDA graph the
// device check neither queues nor reads (a capture forbids event queries, and a captured copy would
// run only at replay): ops captured into a graph are not checked. The message is torchcomms': "NaN
// detected in <input|output> tensor for '<op>' on comm '<name>': <shape> <dtype>".
#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <pybind11/stl.h>

#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "binding.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

bool is_floating(DType dt) {
  switch (dt) {
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kFloat32:
    case DType::kFloat64:
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
      return true;
    default:
      return false;
  }
}

// "(4,)", "(2, 3)": the shape as Python prints a tuple.
std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + (shape.size() == 1 ? ",)" : ")");
}

std::string nan_message(const char* label, const std::string& op, const std::string& comm,
                        const TensorView& t) {
  return detail::cat("NaN detected in ", label, " tensor for '", op, "' on comm '", comm,
                     "': ", shape_text(t.shape), " ", dtype_name(t.dtype));
}

at::Tensor as_tensor(const TensorView& v) {
  auto opts = at::TensorOptions().dtype(to_scalar_type(v.dtype));
  opts = v.device.type == DeviceType::kCUDA
             ? opts.device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(v.device.index)))
             : opts.device(at::kCPU);
  return at::from_blob(v.data, v.shape, v.strides, opts);
}

// The tensors an op's check reads, with their labels (NOTE [NaN check on the device]).
struct Checked {
  const TensorView* t;
  const char* label;
};
std::vector<Checked> checked(const std::string& op, std::span<const TensorView> in,
                             std::span<const TensorView> out, bool check_in, bool check_out) {
  std::vector<Checked> c;
  const bool in_place =
      op == "send" || op == "recv" || op == "broadcast" || op == "all_reduce" || op == "reduce";
  if (in_place) {
    const TensorView* t = !in.empty() ? &in[0] : !out.empty() ? &out[0] : nullptr;
    const bool reads = op != "recv";
    const bool writes = op != "send";
    if (t != nullptr && ((check_in && reads) || (check_out && writes)))
      c.push_back({t, reads ? "input" : "output"});
    return c;
  }
  if (check_in)
    for (const TensorView& t : in) c.push_back({&t, "input"});
  if (check_out)
    for (const TensorView& t : out) c.push_back({&t, "output"});
  return c;
}

class NanCheck : public std::enable_shared_from_this<NanCheck> {
 public:
  NanCheck(bool check_in, bool check_out) : in_(check_in), out_(check_out) {}

  void attach(const std::shared_ptr<Communicator>& comm) {
    auto self = shared_from_this();
    const std::string name = comm->name();
    auto h = comm->register_pre_hook([self, name](const OpInfo& i) {
      self->check_pending();
      self->check(op_name(i.op), name, i.inputs, i.outputs);
    });
    std::lock_guard<std::mutex> lock(mu_);
    handles_.push_back(std::move(h));
  }

  void detach() {
    std::vector<RemovableHandle> hs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      hs.swap(handles_);
    }
    for (auto& h : hs) h.remove();
  }

  // The check of one op's tensors (CPU: raises now; CUDA: queued on the device).
  void check(const std::string& op, const std::string& comm, std::span<const TensorView> in,
             std::span<const TensorView> out) {
    std::optional<bool> capturing;  // asked once per op, at its first CUDA tensor
    for (const Checked& c : checked(op, in, out, in_, out_)) {
      const TensorView& v = *c.t;
      if (!is_floating(v.dtype) || v.numel() == 0) continue;
      const at::Tensor t = as_tensor(v);
      if (v.device.type == DeviceType::kCPU) {
        FASTCOMMS_CHECK(!at::isnan(t).any().item<bool>(), kInvalidArgument,
                        nan_message(c.label, op, comm, v));
        continue;
      }
#ifdef FASTCOMMS_WITH_CUDA
      // Not inside a CUDA graph capture: the flag's copy would run only at replays, after the
      // check was read, and the event could not be queried (NOTE [NaN check on the device]).
      if (!capturing) capturing = stream_capturing();
      if (*capturing) continue;
      // On the caller's current stream, where the op is ordered: no host wait.
      Pending p;
      p.flag = at::empty({}, at::TensorOptions().dtype(at::kBool).pinned_memory(true));
      p.flag.copy_(at::isnan(t).any(), /*non_blocking=*/true);
      p.done.emplace(c10::DeviceType::CUDA);
      p.done->record(torch_current_stream(static_cast<c10::DeviceIndex>(v.device.index)));
      p.message = nan_message(c.label, op, comm, v);
      std::lock_guard<std::mutex> lock(mu_);
      pending_.push_back(std::move(p));
#endif
    }
  }

  // Raises for the first NaN a completed device check found (NOTE [NaN check on the device]).
  void check_pending() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (pending_.empty()) return;
    }
    if (stream_capturing()) return;  // an event query would invalidate the capture
    std::string found;
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (!pending_.empty() && pending_.front().done && pending_.front().done->query()) {
        Pending p = std::move(pending_.front());
        pending_.pop_front();
        if (*p.flag.data_ptr<bool>()) {
          found = std::move(p.message);
          break;
        }
      }
    }
    FASTCOMMS_CHECK(found.empty(), kInvalidArgument, found);
  }

  size_t pending() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_.size();
  }

 private:
  struct Pending {
    at::Tensor flag;                 // pinned host bool, written by the device
    std::optional<c10::Event> done;  // behind the copy
    std::string message;
  };
  const bool in_, out_;
  mutable std::mutex mu_;
  std::deque<Pending> pending_;
  std::vector<RemovableHandle> handles_;
};

}  // namespace

void bind_nan_check(py::module_& m) {
  py::class_<NanCheck, std::shared_ptr<NanCheck>>(
      m, "NanCheck", "NOTE [NaN check on the device]; fastcomms.hooks.NanCheckHook wraps it.")
      .def(py::init<bool, bool>(), py::arg("check_inputs"), py::arg("check_outputs"))
      .def("attach", [](NanCheck& n, const PyComm& c) { n.attach(c.comm); })
      .def("detach", &NanCheck::detach)
      .def("check_pending", &NanCheck::check_pending,
           "Raises for a NaN a completed device check found.")
      .def("pending", &NanCheck::pending, "Device checks not read yet.");
}

}  // namespace fastcomms::python
