// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/factory.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <mutex>

#include "fastcomms/error.hpp"
#include "fastcomms/trusted_path.hpp"

namespace fastcomms {
namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, BackendCreator> creators;
  std::map<std::string, void*> libraries;  // dlopen handles, kept open for the process
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: backends may outlive static dtors
  return *r;
}

std::string env_name(const std::string& name) {
  std::string v = "FASTCOMMS_BACKEND_LIB_PATH_";
  for (char c : name)
    v += std::isalnum(static_cast<unsigned char>(c))
             ? static_cast<char>(std::toupper(static_cast<unsigned char>(c)))
             : '_';
  return v;
}

}  // namespace

void register_backend(const std::string& name, BackendCreator creator) {
  FASTCOMMS_CHECK(!name.empty(), kInvalidArgument, "register_backend: name is empty");
  FASTCOMMS_CHECK(creator != nullptr, kInvalidArgument, "register_backend('", name,
                  "'): creator is null");
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.creators[name] = std::move(creator);
}

bool is_backend_registered(const std::string& name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.creators.count(name) > 0;
}

void require_backend_known(const std::string& name) {
  if (is_backend_registered(name)) return;
  const std::string var = env_name(name);
  const char* path = std::getenv(var.c_str());
  if (path != nullptr && *path != '\0') return;
  std::string known;
  for (const auto& n : registered_backends()) known += (known.empty() ? "" : ", ") + n;
  throw Error(ErrorCode::kInvalidArgument,
              detail::cat("backend '", name,
                          "' is not built in (built in: ", known.empty() ? "none" : known, ") and ",
                          var, " is not set to a backend library"));
}

std::vector<std::string> registered_backends() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  std::vector<std::string> out;
  for (const auto& [name, fn] : r.creators) out.push_back(name);
  return out;
}

std::unique_ptr<Backend> create_backend(const std::string& name, const BackendInit& init) {
  Registry& r = registry();
  BackendCreator creator;
  {
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.creators.find(name);
    if (it != r.creators.end()) creator = it->second;
  }
  if (creator) return creator(init);

  require_backend_known(name);
  const std::string var = env_name(name);
  const char* path = std::getenv(var.c_str());
  check_trusted_library(path, var);  // before dlopen: loading runs the library's code
  void* handle = ::dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* err = ::dlerror();
    throw Error(ErrorCode::kBackendError,
                detail::cat("backend '", name, "': cannot load ", var, "=", path, ": ",
                            err ? err : "unknown dlopen error"));
  }
  auto entry_fn =
      reinterpret_cast<FastcommsBackendEntryFn>(::dlsym(handle, "fastcomms_backend_entry"));
  if (entry_fn == nullptr) {
    ::dlclose(handle);
    throw Error(ErrorCode::kBackendError,
                detail::cat("backend '", name, "': ", path,
                            " does not export the entry point fastcomms_backend_entry"));
  }
  const FastcommsBackendEntry* entry = entry_fn();
  if (entry == nullptr || entry->abi_version != FASTCOMMS_BACKEND_ABI_VERSION ||
      entry->create == nullptr) {
    const int got = entry ? entry->abi_version : -1;
    ::dlclose(handle);
    throw Error(ErrorCode::kBackendError,
                detail::cat("backend '", name, "': ", path, " was built for backend ABI version ",
                            got, ", this fastcomms has ABI version ", FASTCOMMS_BACKEND_ABI_VERSION,
                            "; rebuild the backend"));
  }
  {
    std::lock_guard<std::mutex> lock(r.mu);
    r.libraries[name] = handle;
  }
  return std::unique_ptr<Backend>(entry->create(&init));
}

}  // namespace fastcomms
