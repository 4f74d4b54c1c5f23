// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// Checks on a shared library named by an environment variable, before it is loaded. Loading a
/// library runs its code (its constructors run inside dlopen, before any symbol is looked up),
/// so naming one is trusting it: the name must be an absolute path (a bare name would be
/// resolved through the search path), a regular file, and neither the file nor the folder that
/// holds it may be writable by users other than its owner and group.

#include <sys/stat.h>

#include <string>

#include "fastcomms/error.hpp"

namespace fastcomms {

/// Throws kInvalidArgument (naming `what`, e.g. "FASTCOMMS_NVML_LIBRARY") unless `path` is an
/// absolute path to a regular file that neither it nor its folder lets others write.
inline void check_trusted_library(const std::string& path, const std::string& what) {
  FASTCOMMS_CHECK(!path.empty() && path[0] == '/', kInvalidArgument, what, "=", path,
                  ": a library to load must be named by an absolute path (a bare or relative name "
                  "would be looked up where others may plant one)");
  struct stat st {};
  FASTCOMMS_CHECK(::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode), kInvalidArgument, what,
                  "=", path, ": not a regular file");
  FASTCOMMS_CHECK(!(st.st_mode & S_IWOTH), kInvalidArgument, what, "=", path,
                  ": refused, the file is writable by every user (loading it would run code "
                  "anyone could have written)");
  const std::string dir = path.substr(0, path.rfind('/') == 0 ? 1 : path.rfind('/'));
  struct stat ds {};
  FASTCOMMS_CHECK(::stat(dir.c_str(), &ds) == 0, kInvalidArgument, what, "=", path,
                  ": cannot stat its folder ", dir);
  // A world-writable folder with the sticky bit (/tmp) still lets others replace only their own
  // files, not this one; without it, anyone could swap the file.
  FASTCOMMS_CHECK(!(ds.st_mode & S_IWOTH) || (ds.st_mode & S_ISVTX), kInvalidArgument, what, "=",
                  path, ": refused, its folder ", dir,
                  " is writable by every user (anyone could replace the library)");
}

}  // namespace fastcomms
