// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Stand-in for a header Debian's libgloo-dev (0.0~git20220518) does not install although its
/// `gloo/transport/tcp/pair.h` and `context.h` include it. It is on the include path only where
/// the real header is missing (backends/gloo/CMakeLists.txt). It declares the pointer wrappers
/// those headers name, enough for them to parse; fastcomms never creates, reads or copies one,
/// and never touches a member laid out after one, so their size here does not matter: the one
/// object whose size it could change, the pair, is allocated with slack (NOTE [gloo I/O thread
/// errors] in gloo_backend.cpp).

#include <memory>

namespace gloo {

template <typename T>
class NonOwningPtr;

template <typename T>
class ShareableNonOwningPtr;

template <typename T>
class WeakNonOwningPtr {
 private:
  std::weak_ptr<T> ptr_;
};

}  // namespace gloo
