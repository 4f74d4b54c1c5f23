// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The clog log (torchcomms' clog hook in C++): the signatures and lifecycle events of the ops
/// of the communicators it is attached to, in torchcomms' clog format, written by hooks on the
/// C++ communicator.

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "fastcomms/core/communicator.hpp"

namespace fastcomms {

/// NOTE [clog]: torchcomms' clog log format, version 1: a header
/// "V|1|base_timestamp=<epoch s>", one "C<id>|sig|<op>|<k>=<v>|...|comm=<name>" line per distinct
/// signature, then "C<id>|Q|work_id=<n>|+<s>" per call and "C<id>|S|", "|E|", "|W|" lifecycle
/// lines, "new_comm|comm=..|rank=..|world_size=..", "split|parent=..|child=..|ranks=..",
/// "WARN|...". The log is a pre- and post-hook on the C++ communicator (and a wait observer on
/// each async op's Work, NOTE [wait observers]), so every path a call takes is logged and none
/// is turned off (NOTE [process group fast path]). Where the lifecycle is learnt: a synchronous
/// call starts (S) at its pre-hook and ends (E) when it returns (on CUDA: issued in stream
/// order); an asynchronous call starts when it is issued, and ends and is waited (E, W) when a
/// wait on its work returns (works call nothing back when they complete, so an async call never
/// waited logs no E). Ops the library issues for itself on the communicator (the Ulysses
/// collective transport's byte exchanges) are logged too, their E and W when the transport waits
/// for them. Lines written during CUDA graph capture carry no "G<id>|" prefix and
/// replays log nothing. Thread-safe; each line is flushed as it is written.
class Clog : public std::enable_shared_from_this<Clog> {
 public:
  /// Which lifecycle events are written (Q lines always are), and whether signatures carry the
  /// tensors' addresses (`buf=` for an in-place tensor, `in=` / `out=`).
  struct Options {
    bool start = false;
    bool end = false;
    bool waited = false;
    bool buffers = false;
  };

  /// Opens (truncates) `path` and writes the header; an Error (kInvalidArgument) where the file
  /// cannot be opened.
  Clog(const std::string& path, Options options);
  ~Clog();
  Clog(const Clog&) = delete;
  Clog& operator=(const Clog&) = delete;

  /// Logs `comm`'s ops from now on (writes its new_comm line).
  void attach(const std::shared_ptr<Communicator>& comm);
  /// Stops logging every communicator attached.
  void detach();
  /// Detaches and closes the file; later lines are dropped.
  void close();

  /// The `<k>=<v>` fields of an op's signature, or nullopt for an op clog does not log
  /// (finalize, new_window, split).
  static std::optional<std::vector<std::string>> signature(const OpInfo& op, bool buffers);

 private:
  void line(const std::string& text);
  std::string stamp() const;
  void pre(const std::string& comm, const OpInfo& op);
  void post(const std::string& comm, const OpInfo& op);

  Options options_;
  double base_ = 0;  // epoch seconds, rounded to ms
  mutable std::mutex mu_;
  std::FILE* file_ = nullptr;
  std::map<std::string, int> sigs_;
  uint64_t work_ids_ = 0;
  // op id -> (corr id, async) of a logged op until its post-hook (or its error); op id -> the
  // ranks of a split
  std::map<uint64_t, std::pair<int, bool>> open_;
  std::map<uint64_t, std::vector<int>> splits_;
  std::vector<RemovableHandle> handles_;
};

}  // namespace fastcomms
