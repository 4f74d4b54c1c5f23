// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The flight recorder (NOTE [flight recorder in C++] in flight_recorder.hpp).
#include "fastcomms/core/flight_recorder.hpp"

#include <algorithm>
#include <chrono>

#include "fastcomms/core/log.hpp"

namespace fastcomms {

namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}
bool is_p2p(const std::string& op) {
  return op == "send" || op == "recv" || op == "batch_op_issue";
}
}  // namespace

const char* FlightRecorder::trace_dtype_name(DType dt) noexcept {
  switch (dt) {
    case DType::kFloat16:
      return "Half";
    case DType::kBFloat16:
      return "BFloat16";
    case DType::kFloat32:
      return "Float";
    case DType::kFloat64:
      return "Double";
    case DType::kFloat8E4M3FN:
      return "Float8_e4m3fn";
    case DType::kFloat8E5M2:
      return "Float8_e5m2";
    case DType::kInt8:
      return "Char";
    case DType::kUInt8:
      return "Byte";
    case DType::kInt32:
      return "Int";
    case DType::kInt64:
      return "Long";
    case DType::kBool:
      return "Bool";
  }
  return "Undefined";
}

FlightRecorder::FlightRecorder(size_t max_entries, bool isolated)
    : max_(max_entries), isolated_(isolated) {}

FlightRecorder::Group& FlightRecorder::group(const std::string& name, const std::string& backend,
                                             int rank, int size) {
  auto it = groups_.find(name);
  if (it == groups_.end()) {
    Group g;
    g.name = name;
    g.backend = backend;
    g.pg_id = static_cast<int>(groups_.size());
    g.rank = rank;
    g.size = size;
    it = groups_.emplace(name, std::move(g)).first;
  }
  return it->second;
}

// An async op's entry holds its Work while it runs (the caller may drop its handle at once), and
// is settled by the next op recorded or the next read of the entries: completed (and retired)
// when the work completed, left started when it failed; either way the work is let go.
void FlightRecorder::settle() {
  std::erase_if(started_, [](const std::shared_ptr<Entry>& e) {
    if (!e->work || !e->work->is_completed()) return e->work == nullptr;
    if (e->work->status() == WorkStatus::kCompleted) {
      e->state = State::kCompleted;
      e->retired = true;
    }
    e->work.reset();
    return true;
  });
}

void FlightRecorder::pre(Group& g, int64_t timeout_ms, const std::string& op, uint64_t op_id,
                         bool async_op, Shapes&& shapes) {
  if (!started_.empty()) settle();
  auto e = std::make_shared<Entry>();
  const bool p2p = is_p2p(op);
  (p2p ? g.p2p_seq_id : g.collective_seq_id) += 1;
  e->record_id = next_record_++;
  e->pg_id = g.pg_id;
  e->comm = g.name;
  e->backend = g.backend;
  e->collective_seq_id = p2p ? 0 : g.collective_seq_id;
  e->p2p_seq_id = p2p ? g.p2p_seq_id : 0;
  e->op_id = op_id;
  e->op = op;
  e->input_sizes = std::move(shapes.input_sizes);
  e->output_sizes = std::move(shapes.output_sizes);
  e->input_dtypes = std::move(shapes.input_dtypes);
  e->output_dtypes = std::move(shapes.output_dtypes);
  e->time_created_ns = now_ns();
  e->is_p2p = p2p;
  e->timeout_ms = timeout_ms;
  e->async_op = async_op;
  auto& ring = rings_[isolated_ ? g.name : std::string()];
  ring.push_back(e);
  while (ring.size() > max_) ring.pop_front();
  open_[op_id] = std::move(e);
  ++recorded_;
}

void FlightRecorder::issued(uint64_t op_id, const WorkPtr& work) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = open_.find(op_id);
  if (it == open_.end()) return;
  Entry& e = *it->second;
  e.time_started_ns = now_ns();
  if (e.async_op) {
    e.state = State::kStarted;
    e.work = work;
    if (work) started_.push_back(it->second);
  } else {  // a sync op returned: done (on CUDA, in stream order)
    e.state = State::kCompleted;
    e.retired = true;
    e.duration_ms = static_cast<double>(e.time_started_ns - e.time_created_ns) / 1e6;
  }
  open_.erase(it);
}

void FlightRecorder::attach(const std::shared_ptr<Communicator>& comm, DumpFn dump) {
  const std::string name = comm->name();
  const int rank = comm->rank();
  const int64_t timeout_ms = std::max<int64_t>(1, comm->options().timeout.count());
  {
    std::lock_guard<std::mutex> lock(mu_);
    group(name, comm->backend_name(), rank, comm->size());
    enabled_ = true;
  }
  auto self = shared_from_this();
  auto dump_fn = std::make_shared<DumpFn>(std::move(dump));
  const auto dump_now = [dump_fn, rank] {
    try {
      if (*dump_fn) (*dump_fn)(rank);
    } catch (...) {  // a failed dump must not replace the error that asked for it
      FASTCOMMS_LOG(kError, "[rank ", rank,
                    "] the flight recorder's dump failed: ", log::current_exception_text());
    }
  };
  std::vector<RemovableHandle> hs;
  hs.push_back(comm->register_pre_hook([self, name, timeout_ms](const OpInfo& i) {
    if (i.op == OpKind::kFinalize || i.op == OpKind::kNewWindow || self->max_ == 0) return;
    Shapes shapes;  // (made before the lock is taken)
    for (const TensorView& t : i.inputs) {
      shapes.input_sizes.push_back(t.shape);
      shapes.input_dtypes.emplace_back(trace_dtype_name(t.dtype));
    }
    for (const TensorView& t : i.outputs) {
      shapes.output_sizes.push_back(t.shape);
      shapes.output_dtypes.emplace_back(trace_dtype_name(t.dtype));
    }
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->groups_.find(name);
    if (it == self->groups_.end()) return;
    self->pre(it->second, timeout_ms, op_name(i.op), i.op_id, i.async_op, std::move(shapes));
  }));
  hs.push_back(comm->register_post_hook([self, dump_fn, dump_now](const OpInfo& i) {
    if (i.op == OpKind::kSplit && i.new_comm != nullptr && *i.new_comm) {
      self->attach(*i.new_comm, *dump_fn);  // a split's communicator is recorded too
    }
    self->issued(i.op_id, i.async_op ? i.work : nullptr);
    if (i.async_op && i.work) {
      if (auto* a = dynamic_cast<AsyncWork*>(i.work.get())) a->on_timeout(dump_now);
    }
  }));
  hs.push_back(comm->register_error_hook([self, dump_now](const OpInfo& i, const Error& e) {
    {
      std::lock_guard<std::mutex> lock(self->mu_);
      self->open_.erase(i.op_id);  // it stays "scheduled": it never got past its start
    }
    if (e.code() == ErrorCode::kTimeout) dump_now();
  }));
  hs.push_back(comm->register_abort_hook(dump_now));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& h : hs) handles_.push_back(std::move(h));
}

void FlightRecorder::detach() {
  std::vector<RemovableHandle> hs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hs.swap(handles_);
    enabled_ = false;
  }
  for (auto& h : hs) h.remove();
}

bool FlightRecorder::enabled() const {
  std::lock_guard<std::mutex> lock(mu_);
  return enabled_;
}

void FlightRecorder::record(const std::string& comm, const std::string& backend, int rank, int size,
                            int64_t timeout_ms, const std::string& op, uint64_t op_id,
                            bool async_op, Shapes shapes) {
  if (op == "finalize" || op == "new_window" || max_ == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  enabled_ = true;
  pre(group(comm, backend, rank, size), timeout_ms, op, op_id, async_op, std::move(shapes));
}

std::vector<FlightRecorder::Entry> FlightRecorder::entries(bool include_completed) {
  std::lock_guard<std::mutex> lock(mu_);
  settle();
  std::vector<Entry> out;
  for (auto& [key, ring] : rings_)
    for (auto& e : ring)
      if (include_completed || !e->retired) out.push_back(*e);
  std::sort(out.begin(), out.end(),
            [](const Entry& a, const Entry& b) { return a.record_id < b.record_id; });
  for (auto& e : out) e.work.reset();
  return out;
}

std::vector<FlightRecorder::Group> FlightRecorder::groups() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Group> out;
  for (const auto& [name, g] : groups_) out.push_back(g);
  std::sort(out.begin(), out.end(),
            [](const Group& a, const Group& b) { return a.pg_id < b.pg_id; });
  return out;
}

void FlightRecorder::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  rings_.clear();
  open_.clear();
  started_.clear();
  recorded_ = 0;
}

uint64_t FlightRecorder::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return recorded_;
}

}  // namespace fastcomms
