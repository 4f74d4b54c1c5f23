// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/log.hpp"

#include <unistd.h>

#include <cstdlib>
#include <exception>

namespace fastcomms::log {

bool parse_level(std::string_view text, Level* level) noexcept {
  if (text == "off")
    *level = Level::kOff;
  else if (text == "error")
    *level = Level::kError;
  else if (text == "warn")
    *level = Level::kWarn;
  else if (text == "info")
    *level = Level::kInfo;
  else if (text == "debug")
    *level = Level::kDebug;
  else
    return false;
  return true;
}

Level threshold() noexcept {
  static const Level level = [] {
    Level l = Level::kWarn;
    const char* e = std::getenv("FASTCOMMS_LOG_LEVEL");
    if (e != nullptr && !parse_level(e, &l)) {
      l = Level::kWarn;
      write(Level::kWarn, std::string("FASTCOMMS_LOG_LEVEL must be off, error, warn, info or "
                                      "debug, got '") +
                              e + "': warn");
    }
    return l;
  }();
  return level;
}

void write(Level level, std::string_view message) noexcept {
  try {
    static constexpr const char* kNames[] = {"ERROR", "WARN", "INFO", "DEBUG"};
    const int i = static_cast<int>(level);
    std::string line = detail::cat("fastcomms ", i >= 0 && i < 4 ? kNames[i] : "?", " [pid ",
                                   ::getpid(), "] ", message, "\n");
    const char* p = line.data();
    size_t left = line.size();
    while (left > 0) {  // one write call for a line of ordinary size
      const ssize_t n = ::write(STDERR_FILENO, p, left);
      if (n <= 0) break;
      p += n;
      left -= static_cast<size_t>(n);
    }
  } catch (...) {  // the log itself must never throw (out of memory formatting a line)
  }
}

std::string current_exception_text() noexcept {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace fastcomms::log
