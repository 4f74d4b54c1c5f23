// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The backend factory: static registration by name, and dlopen of
/// FASTCOMMS_BACKEND_LIB_PATH_<NAME> through an extern "C" entry point with an ABI check.

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "fastcomms/core/backend.hpp"

/// Bumped whenever Backend, BackendInit, TensorView or any type they reach changes layout.
#define FASTCOMMS_BACKEND_ABI_VERSION 5

/// What a dlopen-able backend library exports as `fastcomms_backend_entry`.
extern "C" {
struct FastcommsBackendEntry {
  int abi_version;   ///< Must equal FASTCOMMS_BACKEND_ABI_VERSION.
  const char* name;  ///< The backend's name.
  /// Creates the backend (ownership passes to the caller); throws fastcomms::Error.
  fastcomms::Backend* (*create)(const fastcomms::BackendInit* init);
};
/// The symbol a backend library defines.
typedef const FastcommsBackendEntry* (*FastcommsBackendEntryFn)();
}

/// Defines the entry point of a backend library for class `Cls` (constructible from
/// const BackendInit&) registered as `NAME`.
#define FASTCOMMS_DEFINE_BACKEND_ENTRY(NAME, Cls)                                                  \
  extern "C" __attribute__((visibility("default"))) const FastcommsBackendEntry*                   \
  fastcomms_backend_entry() {                                                                      \
    static const FastcommsBackendEntry entry{                                                      \
        FASTCOMMS_BACKEND_ABI_VERSION, NAME,                                                       \
        [](const fastcomms::BackendInit* init) -> fastcomms::Backend* { return new Cls(*init); }}; \
    return &entry;                                                                                 \
  }

namespace fastcomms {

/// Makes a backend from its init.
using BackendCreator = std::function<std::unique_ptr<Backend>(const BackendInit&)>;

/// Registers `name` (replacing an earlier registration of the same name).
void register_backend(const std::string& name, BackendCreator creator);
/// True when `name` is registered statically (dlopen-able ones are not listed).
bool is_backend_registered(const std::string& name);

/// Throws create_backend's kInvalidArgument error unless `name` is registered or a library is
/// named for it by FASTCOMMS_BACKEND_LIB_PATH_<NAME> (not yet checked or loaded).
void require_backend_known(const std::string& name);
/// The statically registered names, sorted.
std::vector<std::string> registered_backends();
/// Creates backend `name`: a static registration first, else the library named by
/// FASTCOMMS_BACKEND_LIB_PATH_<NAME> (upper-cased). Throws kInvalidArgument for an unknown name
/// or a missing variable, kBackendError for a library that does not load, lacks the entry point
/// or has another ABI version.
std::unique_ptr<Backend> create_backend(const std::string& name, const BackendInit& init);

/// Registers a backend at static-initialization time:
/// `static fastcomms::StaticBackendRegistration reg("gloo", creator);`
struct StaticBackendRegistration {
  StaticBackendRegistration(const std::string& name, BackendCreator creator) {
    register_backend(name, std::move(creator));
  }
};

}  // namespace fastcomms
