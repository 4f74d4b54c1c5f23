// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The flight recorder (torchcomms' FlightRecorderHook in C++): the last operations of the
/// communicators it is attached to, recorded by hooks on the C++ communicator.

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "fastcomms/core/communicator.hpp"

namespace fastcomms {

/// NOTE [flight recorder in C++]: the recorder is a pre-, post- and error hook on the C++
/// communicator, so it records every call whatever path issued it (the Python methods, the
/// process group's and the compiled calls' C++ paths, NOTE [process group fast path]) and a
/// recorded call costs what its hooks cost in C++ (a lock, the sizes copied, a clock read):
/// registering it leaves the C++ paths on. An entry is "scheduled" at its pre-hook, "started" at
/// its post-hook when async and "completed" (retired) when sync; an async op's state is read
/// from its Work when entries are read (complete: "completed", retired). A timeout (a sync op's
/// error, an async op's wait past its deadline) and an abort call the dump function given to
/// attach(); the pickled trace is written by the Python side (fastcomms.hooks). Thread-safe.
class FlightRecorder : public std::enable_shared_from_this<FlightRecorder> {
 public:
  /// Where an entry stands.
  enum class State : int { kScheduled = 0, kStarted = 1, kCompleted = 2 };
  /// One recorded op (torch's trace fields; time_started_ns and duration_ms -1 where unknown).
  struct Entry {
    uint64_t record_id = 0;
    int pg_id = 0;
    std::string comm;
    std::string backend;
    uint64_t collective_seq_id = 0;
    uint64_t p2p_seq_id = 0;
    uint64_t op_id = 0;
    std::string op;
    std::vector<std::vector<int64_t>> input_sizes, output_sizes;
    std::vector<std::string> input_dtypes, output_dtypes;  // torch's names ("Float", ...)
    int64_t time_created_ns = 0;
    int64_t time_started_ns = -1;
    double duration_ms = -1;
    State state = State::kScheduled;
    bool is_p2p = false;
    bool retired = false;
    int64_t timeout_ms = 0;
    bool async_op = false;
    WorkPtr work;  // an async op's, until it is seen finished
  };
  /// A communicator the recorder saw (pg_id in the order attached).
  struct Group {
    std::string name;
    std::string backend;
    int pg_id = 0;
    int rank = 0;
    int size = 0;
    uint64_t collective_seq_id = 0;
    uint64_t p2p_seq_id = 0;
  };
  /// Called with the rank where the trace is to be written (an abort, a timeout).
  using DumpFn = std::function<void(int rank)>;

  /// Keeps the last `max_entries` ops (0: records nothing); `isolated`: one ring per
  /// communicator, else one for all.
  FlightRecorder(size_t max_entries, bool isolated);

  /// Records `comm`'s ops from now on, and those of the communicators its splits make.
  void attach(const std::shared_ptr<Communicator>& comm, DumpFn dump);
  /// Stops recording every communicator attached (what was recorded stays).
  void detach();
  /// Whether a communicator is attached (or an op was recorded through record()).
  bool enabled() const;

  /// The entries in record order; without `include_completed`, only those not retired.
  std::vector<Entry> entries(bool include_completed);
  /// The communicators seen, by pg_id.
  std::vector<Group> groups() const;
  /// Drops every entry and restarts size() (the sequence ids go on).
  void reset();
  /// Entries recorded since the last reset (it goes on past max_entries).
  uint64_t size() const;

  /// What an entry says of its tensors: sizes and torch's dtype names, inputs then outputs.
  struct Shapes {
    std::vector<std::vector<int64_t>> input_sizes, output_sizes;
    std::vector<std::string> input_dtypes, output_dtypes;
  };
  /// An op of a communicator the recorder cannot hook (a backend written in Python): its
  /// pre-hook's record. `op` is its API name.
  void record(const std::string& comm, const std::string& backend, int rank, int size,
              int64_t timeout_ms, const std::string& op, uint64_t op_id, bool async_op,
              Shapes shapes);
  /// Its post-hook: the op was issued (`work`: its Work where async, or null).
  void issued(uint64_t op_id, const WorkPtr& work);

  /// torch's name of a dtype in a trace ("Float", "BFloat16", ...).
  static const char* trace_dtype_name(DType dt) noexcept;

 private:
  Group& group(const std::string& name, const std::string& backend, int rank, int size);
  // (the lock held)
  void pre(Group& g, int64_t timeout_ms, const std::string& op, uint64_t op_id, bool async_op,
           Shapes&& shapes);
  // Settles the started async entries whose works finished (the lock held).
  void settle();

  const size_t max_;
  const bool isolated_;
  mutable std::mutex mu_;
  std::map<std::string, std::deque<std::shared_ptr<Entry>>> rings_;
  std::map<uint64_t, std::shared_ptr<Entry>> open_;  // op_id -> entry, until the op is issued
  std::vector<std::shared_ptr<Entry>> started_;      // async entries whose works run
  std::map<std::string, Group> groups_;
  uint64_t next_record_ = 0;
  uint64_t recorded_ = 0;
  std::vector<RemovableHandle> handles_;
  bool enabled_ = false;
};

}  // namespace fastcomms
