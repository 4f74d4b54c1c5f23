// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Hooks on a communicator from Python (NOTE [one hook registry] in fastcomms/_ops.py): pre and
// post hooks see the op's name, id and async flag, and a fast-path op's arguments (pre: its
// tensors, NOTE [hooks on the fast path] in py_common.hpp; post: whether it is one); abort hooks
// run before an abort. Each registration returns its remover. The flight recorder is C++ (NOTE
// [flight recorder in C++]); fastcomms.hooks wraps it.
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <vector>

#include "binding.hpp"
#include "fastcomms/core/clog.hpp"
#include "fastcomms/core/flight_recorder.hpp"
#include "py_common.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

// A Python callable held by C++ for as long as C++ needs it: called and dropped with the GIL
// taken (a hook's copy may be dropped on any thread); after the interpreter is gone, left alone.
std::shared_ptr<py::function> held(py::function fn) {
  return std::shared_ptr<py::function>(new py::function(std::move(fn)), [](py::function* p) {
    if (!usable()) return;  // (leaked: nothing may be released once Python is gone)
    py::gil_scoped_acquire gil;
    delete p;
  });
}

const char* state_name(FlightRecorder::State s) {
  switch (s) {
    case FlightRecorder::State::kScheduled:
      return "scheduled";
    case FlightRecorder::State::kStarted:
      return "started";
    case FlightRecorder::State::kCompleted:
      break;
  }
  return "completed";
}

// An entry as torch's trace writes it (fastcomms.hooks.FlightRecorderHook's dump).
py::dict entry_dict(const FlightRecorder::Entry& e) {
  py::dict d;
  d["record_id"] = e.record_id;
  d["pg_id"] = e.pg_id;
  d["process_group"] = py::make_tuple(e.comm, e.backend);
  d["collective_seq_id"] = e.collective_seq_id;
  d["p2p_seq_id"] = e.p2p_seq_id;
  d["op_id"] = e.op_id;
  d["profiling_name"] = e.backend + ":" + e.op;
  d["input_sizes"] = e.input_sizes;
  d["input_dtypes"] = e.input_dtypes;
  d["output_sizes"] = e.output_sizes;
  d["output_dtypes"] = e.output_dtypes;
  d["time_created_ns"] = e.time_created_ns;
  d["state"] = state_name(e.state);
  d["is_p2p"] = e.is_p2p;
  d["retired"] = e.retired;
  d["timeout_ms"] = e.timeout_ms;
  d["frames"] = py::list();
  if (e.time_started_ns >= 0) d["time_discovered_started_ns"] = e.time_started_ns;
  if (e.duration_ms >= 0) d["duration_ms"] = e.duration_ms;
  return d;
}

void bind_flight_recorder(py::module_& m) {
  using FR = FlightRecorder;
  py::class_<FR, std::shared_ptr<FR>>(m, "FlightRecorder",
                                      "NOTE [flight recorder in C++]; fastcomms.hooks wraps it.")
      .def(py::init<size_t, bool>(), py::arg("max_entries"), py::arg("isolated"))
      .def(
          "attach",
          [](FR& f, const PyComm& c, py::function dump) {
            auto fn = held(std::move(dump));
            f.attach(c.comm, [fn](int rank) {
              py::gil_scoped_acquire gil;
              (*fn)(rank);
            });
          },
          "Records the communicator's ops (and its splits'); dump(rank) at an abort or timeout.")
      .def("detach", &FR::detach)
      .def("enabled", &FR::enabled)
      .def("size", &FR::size)
      .def("reset", &FR::reset)
      .def("entries",
           [](FR& f, bool include_completed) {
             py::list out;
             for (const auto& e : f.entries(include_completed)) out.append(entry_dict(e));
             return out;
           })
      .def("groups", [](const FR& f) {
        py::list out;
        for (const auto& g : f.groups()) {
          py::dict d;
          d["name"] = g.name;
          d["backend"] = g.backend;
          d["pg_id"] = g.pg_id;
          d["rank"] = g.rank;
          d["size"] = g.size;
          d["collective_seq_id"] = g.collective_seq_id;
          d["p2p_seq_id"] = g.p2p_seq_id;
          out.append(d);
        }
        return out;
      });
}

void bind_clog(py::module_& m) {
  py::class_<Clog, std::shared_ptr<Clog>>(m, "Clog", "NOTE [clog]; fastcomms.hooks.clog wraps it.")
      .def(py::init([](const std::string& path, bool start, bool end, bool waited, bool buffers) {
             return std::make_shared<Clog>(path, Clog::Options{start, end, waited, buffers});
           }),
           py::arg("path"), py::arg("start"), py::arg("end"), py::arg("waited"), py::arg("buffers"))
      .def(
          "attach", [](Clog& l, const PyComm& c) { l.attach(c.comm); },
          "Logs the communicator's ops from now on (writes its new_comm line).")
      .def("detach", &Clog::detach, py::call_guard<py::gil_scoped_release>())
      .def("close", &Clog::close, py::call_guard<py::gil_scoped_release>());
}

// A Python pre- or post-hook registered with `reg`: fn(name, op_id, async_op), and with `fast`
// what `extra` makes of the op (NOTE [hooks on the fast path]); returns its remover. held():
// copies of the hook (the registry's, made on the op's thread without the GIL) share one
// reference instead of counting the Python object's.
template <typename Register, typename Extra>
py::cpp_function python_hook(Register reg, py::function fn, bool fast, Extra extra) {
  auto h = std::make_shared<RemovableHandle>(
      reg([fn = held(std::move(fn)), fast, extra](const OpInfo& i) {
        py::gil_scoped_acquire gil;
        const std::string name(op_name(i.op));
        if (fast) {
          (*fn)(name, i.op_id, i.async_op, extra(i));
        } else {
          (*fn)(name, i.op_id, i.async_op);
        }
      }));
  return py::cpp_function([h] { h->remove(); });
}

}  // namespace

void bind_hooks(py::module_& m) {
  bind_flight_recorder(m);
  bind_clog(m);
  reopen<PyComm>(m, "Comm")
      .def(
          "register_pre_hook",
          [](PyComm& c, py::function fn, bool fast) {
            return python_hook(
                [&c](Communicator::PreHook h) { return c.comm->register_pre_hook(std::move(h)); },
                std::move(fn), fast, [](const OpInfo& i) { return frontend_args(i.frontend); });
          },
          py::arg("fn"), py::arg("fast") = false,
          "fn(name, op_id, async_op), and with `fast` a fast-path op's arguments or None (NOTE "
          "[hooks on the fast path]).")
      .def(
          "register_post_hook",
          [](PyComm& c, py::function fn, bool fast) {
            return python_hook(
                [&c](Communicator::PostHook h) { return c.comm->register_post_hook(std::move(h)); },
                std::move(fn), fast,
                [](const OpInfo& i) { return py::bool_(is_hook_frontend(i.frontend)); });
          },
          py::arg("fn"), py::arg("fast") = false,
          "fn(name, op_id, async_op), and with `fast` whether it is a fast-path op.")
      .def("register_abort_hook", [](PyComm& c, py::function fn) {
        auto h = std::make_shared<RemovableHandle>(
            c.comm->register_abort_hook([fn = held(std::move(fn))] {
              py::gil_scoped_acquire gil;
              (*fn)();
            }));
        return py::cpp_function([h] { h->remove(); });
      });
}

}  // namespace fastcomms::python
