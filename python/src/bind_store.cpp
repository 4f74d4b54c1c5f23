// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// Stores from Python: a torch.distributed.Store (any object with its methods) as a fastcomms Store,
// and the authenticated store wrapped over one (NOTE [authenticated rendezvous]).
#include <string>
#include <utility>
#include <vector>

#include <pybind11/stl.h>

#include "binding.hpp"
#include "fastcomms/core/auth_store.hpp"
#include "py_common.hpp"

namespace py = pybind11;

namespace fastcomms::python {
namespace {

class PyStore : public Store {
 public:
  explicit PyStore(py::object store) : store_(std::move(store)) {}
  ~PyStore() override {
    if (!usable()) {  // the interpreter is finalizing: left to the exiting process
      store_.release();
      return;
    }
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

}  // namespace

std::shared_ptr<Store> py_store(py::object store) {
  return std::make_shared<PyStore>(std::move(store));
}

void bind_store(py::module_& m) {
  // NOTE [authenticated rendezvous]: the store wrapper, for the tests' forged-value checks.
  m.def("_auth_store_set",
        [](py::object store, const std::string& secret, const std::string& key, py::bytes value) {
          const std::string v = value;
          AuthStore(py_store(std::move(store)), secret)
              .set(key, std::vector<uint8_t>(v.begin(), v.end()));
        });
  m.def("_auth_store_get", [](py::object store, const std::string& secret, const std::string& key) {
    const auto v = AuthStore(py_store(std::move(store)), secret).get(key);
    return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
  });
}

}  // namespace fastcomms::python
