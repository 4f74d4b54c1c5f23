// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The device API of windows from Python (fastcomms.TorchCommWindow.get_device_window, ...):
// device pointers cross as Python ints, as torchcomms returns them; the layout of the device
// structs is published so fastcomms.triton can check the offsets it reads fields at.
#include <pybind11/stl.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "binding.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/core/store_window.hpp"
#include "fastcomms/device/window.hpp"
#include "py_common.hpp"
#include "tensors.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

// NOTE [store windows]: a window over a FileStore folder, with no communicator, for ranks that
// cannot share an NCCL communicator (MPS clients of one GPU). The same host-side calls as
// fastcomms._C.Window (fastcomms.TorchCommWindow drives either).
struct StoreWindow {
  std::shared_ptr<Window> w;
  Device device;
};

std::shared_ptr<Window> native(const py::object& w) {
  if (py::isinstance<StoreWindow>(w)) return w.cast<StoreWindow&>().w;
  return w.cast<PyWindow&>().w;
}

}  // namespace

void bind_device_window(py::module_& m) {
  using device::DeviceWindow;
  using device::RegisteredBuffer;
  py::class_<StoreWindow>(m, "StoreWindow")
      .def("register_buffer",
           [](StoreWindow& w, const at::Tensor& t) {
             void* p = t.data_ptr();
             const int64_t bytes = t.numel() * t.element_size();
             py::gil_scoped_release release;
             w.w->register_buffer(p, bytes);
           })
      .def("deregister",
           [](StoreWindow& w) {
             py::gil_scoped_release release;
             w.w->deregister();
           })
      .def("bytes", [](const StoreWindow& w) { return w.w->bytes(); })
      .def("put",
           [](StoreWindow& w, const at::Tensor& src, int dst, int64_t offset_bytes) {
             w.w->put(src.data_ptr(), src.numel() * src.element_size(), dst, offset_bytes,
                      current_stream(w.device));
           })
      .def("signal", [](StoreWindow& w, int peer) { w.w->signal(peer, current_stream(w.device)); })
      .def("wait_signal",
           [](StoreWindow& w, int peer, int64_t timeout_ms) {
             w.w->wait_signal(peer, std::chrono::milliseconds(timeout_ms),
                              current_stream(w.device));
           })
      .def("check_errors", [](StoreWindow& w) { w.w->check_errors(); })
      .def("remote", [](StoreWindow& w, int q, std::vector<int64_t> shape, const at::Tensor& like) {
        void* p = w.w->remote(q);
        auto keep = w.w;
        return torch::from_blob(
            p, shape, [keep](void*) {},
            at::TensorOptions().dtype(like.scalar_type()).device(like.device()));
      });
  m.def(
      "store_window",
      [](int rank, int size, int device_index, const std::string& store_dir,
         const std::string& name, int64_t timeout_ms) {
        StoreWindowInit init;
        init.rank = rank;
        init.size = size;
        init.device = device_index;
        init.store = std::make_shared<FileStore>(store_dir);
        init.name = name;
        init.timeout = std::chrono::milliseconds(timeout_ms);
        std::shared_ptr<Window> w;
        {
          py::gil_scoped_release release;  // collective
          w = make_store_window(init);
        }
        return StoreWindow{std::move(w), Device{DeviceType::kCUDA, device_index}};
      },
      "Collective: a CUDA IPC window over a FileStore folder, with no communicator.");
  m.def(
      "device_window",
      [](const py::object& w, int signal_count, int counter_count, int barrier_count) {
        auto win = native(w);
        py::gil_scoped_release release;  // collective on the first call
        return reinterpret_cast<uintptr_t>(
            win->device_window(signal_count, counter_count, barrier_count));
      },
      "A device pointer to the window's fastcomms::device::DeviceWindow (collective at first).");
  m.def(
      "register_local_buffer",
      [](const py::object& w, const at::Tensor& t) {
        auto win = native(w);
        void* p = t.data_ptr();
        const int64_t bytes = t.numel() * t.element_size();
        py::gil_scoped_release release;
        return reinterpret_cast<uintptr_t>(win->register_local_buffer(p, bytes));
      },
      "A device pointer to a fastcomms::device::RegisteredBuffer over the tensor's bytes.");
  m.def(
      "deregister_local_buffer",
      [](const py::object& w, uintptr_t handle) {
        auto win = native(w);
        py::gil_scoped_release release;
        win->deregister_local_buffer(reinterpret_cast<void*>(handle));
      },
      "Frees a handle from register_local_buffer.");
  m.def(
      "arm_device_faults",
      [](const py::object& w, uint32_t flags) {
        auto win = native(w);
        py::gil_scoped_release release;
        win->arm_device_faults(flags);
      },
      "Tests only: sets the device window's fault bits.");
  m.def("device_window_layout", [] {
    std::map<std::string, int64_t> l;
#define FC_FIELD(f) l["DeviceWindow." #f] = static_cast<int64_t>(offsetof(DeviceWindow, f))
    FC_FIELD(base_);
    FC_FIELD(size_);
    FC_FIELD(rank_);
    FC_FIELD(num_ranks_);
    FC_FIELD(signal_count_);
    FC_FIELD(counter_count_);
    FC_FIELD(barrier_count_);
    FC_FIELD(flags_);
    FC_FIELD(peer_bases_);
    FC_FIELD(signals_);
    FC_FIELD(peer_signals_);
    FC_FIELD(counters_);
    FC_FIELD(barriers_);
    FC_FIELD(peer_barriers_);
    FC_FIELD(barrier_epochs_);
    FC_FIELD(error_);
    FC_FIELD(timeout_ns_);
#undef FC_FIELD
    l["DeviceWindow"] = sizeof(DeviceWindow);
    l["RegisteredBuffer.base_ptr"] = offsetof(RegisteredBuffer, base_ptr);
    l["RegisteredBuffer.size"] = offsetof(RegisteredBuffer, size);
    l["RegisteredBuffer"] = sizeof(RegisteredBuffer);
    l["kFaultUnorderedSignal"] = device::kFaultUnorderedSignal;
    l["kDeviceInvalid"] = device::kDeviceInvalid;
    l["kDeviceTimeout"] = device::kDeviceTimeout;
    return l;
  });
}

}  // namespace fastcomms::python
