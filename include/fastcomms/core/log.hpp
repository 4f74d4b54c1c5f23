// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The library's one log: lines to stderr, filtered by level. What the library cannot raise to a
/// caller (a failing hook, a clean-up that failed after the error that matters, a background
/// thread's error that the op it belongs to reports another way) goes here instead of being
/// dropped; nothing is printed any other way.

#include <string>
#include <string_view>

#include "fastcomms/error.hpp"

namespace fastcomms::log {

/// Severity of a line; FASTCOMMS_LOG_LEVEL (off, error, warn, info, debug; default warn),
/// read once per process, keeps this level and the ones above it.
enum class Level : int { kOff = -1, kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

/// The threshold from FASTCOMMS_LOG_LEVEL (an unknown value means warn, and says so once).
Level threshold() noexcept;

/// Whether a line of `level` is written.
inline bool enabled(Level level) noexcept {
  return static_cast<int>(level) <= static_cast<int>(threshold());
}

/// Writes "fastcomms <LEVEL> [pid <pid>] <message>\n" to stderr in one call (lines of several
/// threads never interleave); never throws. Callers put "[rank r/n comm op] " in the message
/// where they know it.
void write(Level level, std::string_view message) noexcept;

/// The message of the exception being handled (inside a catch block), for a log line.
std::string current_exception_text() noexcept;

/// Parses a FASTCOMMS_LOG_LEVEL value; false for an unknown one (for tests).
bool parse_level(std::string_view text, Level* level) noexcept;

}  // namespace fastcomms::log

/// FASTCOMMS_LOG(kWarn, "[rank ", r, "] what happened: ", why): formats only when enabled.
#define FASTCOMMS_LOG(level, ...)                                     \
  do {                                                                \
    if (::fastcomms::log::enabled(::fastcomms::log::Level::level))    \
      ::fastcomms::log::write(::fastcomms::log::Level::level,         \
                              ::fastcomms::detail::cat(__VA_ARGS__)); \
  } while (0)
