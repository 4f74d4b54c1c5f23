// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The one exception type of fastcomms, its codes, and the argument-check macro.
///
/// Every layer (plan, core, cuda, backends) throws fastcomms::Error; the Python binding maps the
/// code to a Python exception in one place.

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace fastcomms {

/// What kind of failure an Error reports. Stable numbers: the Python mapping keys on them.
enum class ErrorCode : int {
  kInvalidArgument = 1,  ///< A caller passed a bad argument (Python: ValueError).
  kTypeError = 2,        ///< A caller passed an argument of the wrong type or dtype (TypeError).
  kTimeout = 3,          ///< An operation did not complete in time (TimeoutError).
  kAborted = 4,          ///< The communicator was aborted.
  kBackendError = 5,     ///< The underlying transport or library failed.
  kUnsupported = 6,      ///< The backend does not implement the request.
  kCudaError = 7,        ///< A CUDA runtime or driver call failed.
  kInternal = 8,         ///< A broken invariant inside fastcomms (a bug).
};

/// The name of an ErrorCode, e.g. "InvalidArgument".
constexpr std::string_view error_code_name(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "InvalidArgument";
    case ErrorCode::kTypeError:
      return "TypeError";
    case ErrorCode::kTimeout:
      return "Timeout";
    case ErrorCode::kAborted:
      return "Aborted";
    case ErrorCode::kBackendError:
      return "BackendError";
    case ErrorCode::kUnsupported:
      return "Unsupported";
    case ErrorCode::kCudaError:
      return "CudaError";
    case ErrorCode::kInternal:
      return "Internal";
  }
  return "Unknown";
}

/// The single exception type thrown by fastcomms. what() is the full message, already prefixed
/// with its context (rank, communicator, op) by whoever threw it.
class Error : public std::runtime_error {
 public:
  /// @param code what kind of failure this is
  /// @param message the full, human-readable message
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}

  /// The failure's code.
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

namespace detail {
/// Concatenates its arguments with operator<< into one string.
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

}  // namespace fastcomms

/// Throws fastcomms::Error(code, message) when `cond` is false; the message is the remaining
/// arguments streamed together, e.g.
/// FASTCOMMS_CHECK(n >= 0, kInvalidArgument, prefix, "n must be >= 0, got ", n);
#define FASTCOMMS_CHECK(cond, code, ...)                               \
  do {                                                                 \
    if (!(cond)) [[unlikely]] {                                        \
      throw ::fastcomms::Error(::fastcomms::ErrorCode::code,           \
                               ::fastcomms::detail::cat(__VA_ARGS__)); \
    }                                                                  \
  } while (0)
