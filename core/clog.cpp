// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The clog log (NOTE [clog] in clog.hpp).
#include "fastcomms/core/clog.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include "fastcomms/core/reduce_op.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms {

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

const char* clog_dtype(DType dt) {
  switch (dt) {
    case DType::kFloat32:
      return "f32";
    case DType::kFloat64:
      return "f64";
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
    case DType::kInt32:
      return "i32";
    case DType::kInt64:
      return "i64";
    case DType::kInt8:
      return "i8";
    case DType::kUInt8:
      return "u8";
    case DType::kBool:
      return "bool";
    case DType::kFloat8E4M3FN:
      return "fp8e4m3";
    case DType::kFloat8E5M2:
      return "fp8e5m2";
  }
  return "other";
}

// torchcomms' name of a reduction: torch's, in lower case, "prod" for PRODUCT
std::string clog_red(RedOpType t) {
  if (t == RedOpType::kProduct) return "prod";
  std::string s(red_op_name(t));
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

std::string ptrs(std::span<const TensorView> ts) {
  std::ostringstream s;
  for (size_t i = 0; i < ts.size(); ++i) {
    s << (i ? "," : "") << "0x" << std::hex << reinterpret_cast<uintptr_t>(ts[i].data);
  }
  return s.str();
}

template <typename T>
std::string joined(std::span<const T> v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  return s.str();
}

// How an op's arguments read in its signature: an in-place tensor, a point-to-point tensor, an
// input and an output (each one tensor or a list), or neither.
enum class Shape { kNone, kInPlace, kSend, kRecv, kInOut };
struct Form {
  Shape shape = Shape::kNone;
  bool in_list = false, out_list = false;
  const char* extra = nullptr;  // "root", "peer" or "num_ops"
};

std::optional<Form> form(OpKind op) {
  switch (op) {
    case OpKind::kSend:
      return Form{Shape::kSend, false, false, "peer"};
    case OpKind::kRecv:
      return Form{Shape::kRecv, false, false, "peer"};
    case OpKind::kBroadcast:
    case OpKind::kReduce:
      return Form{Shape::kInPlace, false, false, "root"};
    case OpKind::kAllReduce:
      return Form{Shape::kInPlace};
    case OpKind::kAllGather:
    case OpKind::kAllGatherV:
      return Form{Shape::kInOut, false, true};
    case OpKind::kReduceScatter:
    case OpKind::kReduceScatterV:
      return Form{Shape::kInOut, true, false};
    case OpKind::kAllGatherSingle:
    case OpKind::kAllGatherPExec:
    case OpKind::kReduceScatterSingle:
    case OpKind::kAllToAllSingle:
    case OpKind::kAllToAllVSingle:
      return Form{Shape::kInOut};
    case OpKind::kAllToAll:
      return Form{Shape::kInOut, true, true};
    case OpKind::kScatter:
      return Form{Shape::kInOut, true, false, "root"};
    case OpKind::kGather:
      return Form{Shape::kInOut, false, true, "root"};
    case OpKind::kGatherSingle:
      return Form{Shape::kInOut, false, false, "root"};
    case OpKind::kBarrier:
      return Form{};
    case OpKind::kBatchP2P:
      return Form{Shape::kNone, false, false, "num_ops"};
    case OpKind::kSplit:
    case OpKind::kNewWindow:
    case OpKind::kFinalize:
    case OpKind::kCount:
      break;
  }
  return std::nullopt;
}

}  // namespace

std::optional<std::vector<std::string>> Clog::signature(const OpInfo& i, bool buffers) {
  const std::optional<Form> f = form(i.op);
  if (!f) return std::nullopt;
  std::vector<std::string> kv, ps;
  const TensorView* first = nullptr;  // the tensor whose dtype is written
  const auto count = [](const TensorView* t) { return t ? t->numel() : int64_t{0}; };
  const TensorView* in = i.inputs.empty() ? nullptr : &i.inputs[0];
  const TensorView* out = i.outputs.empty() ? nullptr : &i.outputs[0];
  switch (f->shape) {
    case Shape::kSend:
    case Shape::kRecv: {
      const bool recv = f->shape == Shape::kRecv;
      first = recv ? out : in;
      kv.push_back("in_count=" + std::to_string(recv ? 0 : count(first)));
      kv.push_back("out_count=" + std::to_string(recv ? count(first) : 0));
      ps.push_back(std::string(recv ? "out=" : "in=") + (recv ? ptrs(i.outputs) : ptrs(i.inputs)));
      break;
    }
    case Shape::kInPlace:
      first = in;
      kv.push_back("in_count=" + std::to_string(count(in)));
      kv.push_back("out_count=" + std::to_string(count(in)));
      ps.push_back("buf=" + ptrs(i.inputs));
      break;
    case Shape::kInOut: {
      if (i.op == OpKind::kAllToAllVSingle) {
        kv.push_back("in_splits=" + joined(i.input_splits));
        kv.push_back("out_splits=" + joined(i.output_splits));
      } else {
        for (const bool is_in : {true, false}) {
          const auto ts = is_in ? i.inputs : i.outputs;
          const bool list = is_in ? f->in_list : f->out_list;
          std::string v = std::string(is_in ? "in" : "out") + (list ? "_counts=" : "_count=");
          if (list) {
            std::vector<int64_t> n;
            for (const TensorView& t : ts) n.push_back(t.numel());
            v += joined(std::span<const int64_t>(n));
          } else {
            v += std::to_string(ts.empty() ? 0 : ts[0].numel());
          }
          kv.push_back(std::move(v));
        }
      }
      // the first single tensor (input, then output); where both are lists, the first input
      first = !f->in_list ? in : !f->out_list ? out : in;
      ps.push_back("in=" + ptrs(i.inputs));
      ps.push_back("out=" + ptrs(i.outputs));
      break;
    }
    case Shape::kNone:
      break;
  }
  if (!kv.empty())
    kv.push_back(std::string("dtype=") + (first ? clog_dtype(first->dtype) : "other"));
  if (i.reduce != nullptr) kv.push_back(std::string("red_op=") + clog_red(i.reduce->type));
  if (f->extra != nullptr) {
    const bool ops = std::string(f->extra) == "num_ops";
    kv.push_back(std::string(f->extra) + "=" +
                 (ops ? std::to_string(i.num_ops) : std::to_string(i.peer)));
  }
  kv.push_back(std::string("async_op=") + (i.async_op ? "t" : "f"));
  if (buffers) kv.insert(kv.end(), ps.begin(), ps.end());
  return kv;
}

Clog::Clog(const std::string& path, Options options) : options_(options) {
  file_ = std::fopen(path.c_str(), "w");
  FASTCOMMS_CHECK(file_ != nullptr, kInvalidArgument, "clog: cannot open ", path,
                  " for writing: ", std::strerror(errno));
  // (rounded down, so no event is stamped before it: rounding up made the first events "+-0.000")
  base_ = std::floor(now_s() * 1000.0) / 1000.0;
  char head[64];
  std::snprintf(head, sizeof(head), "V|1|base_timestamp=%.3f", base_);
  line(head);
}

Clog::~Clog() { close(); }

void Clog::line(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ == nullptr) return;
  std::fputs(text.c_str(), file_);
  std::fputc('\n', file_);
  std::fflush(file_);
}

std::string Clog::stamp() const {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "+%.3f", std::max(0.0, now_s() - base_));
  return buf;
}

void Clog::attach(const std::shared_ptr<Communicator>& comm) {
  const std::string name = comm->name();
  line("new_comm|comm=" + name + "|rank=" + std::to_string(comm->rank()) +
       "|world_size=" + std::to_string(comm->size()));
  auto self = shared_from_this();
  std::vector<RemovableHandle> hs;
  hs.push_back(comm->register_pre_hook([self, name](const OpInfo& i) { self->pre(name, i); }));
  hs.push_back(comm->register_post_hook([self, name](const OpInfo& i) { self->post(name, i); }));
  hs.push_back(comm->register_error_hook([self](const OpInfo& i, const Error&) {
    std::lock_guard<std::mutex> lock(self->mu_);  // an op that raised: no post-hook comes
    self->open_.erase(i.op_id);
    self->splits_.erase(i.op_id);
  }));
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& h : hs) handles_.push_back(std::move(h));
}

void Clog::pre(const std::string& comm, const OpInfo& i) {
  if (i.op == OpKind::kSplit) {
    std::lock_guard<std::mutex> lock(mu_);
    splits_[i.op_id] = std::vector<int>(i.ranks.begin(), i.ranks.end());
    return;
  }
  const auto kv = signature(i, options_.buffers);
  if (!kv) return;  // finalize, new_window: not logged
  std::string sig = op_name(i.op);
  for (const std::string& f : *kv) sig += "|" + f;
  sig += "|comm=" + comm;
  std::vector<std::string> lines;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto [it, fresh] = sigs_.try_emplace(sig, static_cast<int>(sigs_.size()) + 1);
    const std::string c = "C" + std::to_string(it->second);
    if (fresh) lines.push_back(c + "|sig|" + sig);
    lines.push_back(c + "|Q|work_id=" + std::to_string(++work_ids_) + "|" + stamp());
    if (options_.start && !i.async_op) lines.push_back(c + "|S|" + stamp());
    open_[i.op_id] = std::make_pair(it->second, i.async_op);
  }
  for (const std::string& l : lines) line(l);
}

void Clog::post(const std::string& comm, const OpInfo& i) {
  if (i.op != OpKind::kSplit && !form(i.op)) return;  // finalize, new_window: not logged
  std::optional<std::vector<int>> ranks;
  std::optional<std::pair<int, bool>> entry;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto s = splits_.find(i.op_id); s != splits_.end()) {
      ranks = std::move(s->second);
      splits_.erase(s);
    } else if (auto o = open_.find(i.op_id); o != open_.end()) {
      entry = o->second;
      open_.erase(o);
    }
  }
  if (ranks) {
    if (i.new_comm != nullptr && *i.new_comm) {
      line("split|parent=" + comm + "|child=" + (*i.new_comm)->name() +
           "|ranks=" + joined(std::span<const int>(*ranks)));
    }
    return;
  }
  if (!entry) {
    line("WARN|post-hook of op " + std::to_string(i.op_id) + " on " + comm + " without a pre-hook");
    return;
  }
  const auto [corr, async_op] = *entry;
  const std::string c = "C" + std::to_string(corr);
  if (!async_op) {
    if (options_.end) line(c + "|E|" + stamp());
    return;
  }
  if (options_.start) line(c + "|S|" + stamp());
  if (i.work && (options_.end || options_.waited)) {
    std::weak_ptr<Clog> weak = weak_from_this();
    i.work->on_waited([weak, c] {  // NOTE [wait observers]
      if (auto self = weak.lock()) {
        if (self->options_.end) self->line(c + "|E|" + self->stamp());
        if (self->options_.waited) self->line(c + "|W|" + self->stamp());
      }
    });
  }
}

void Clog::detach() {
  std::vector<RemovableHandle> hs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    hs.swap(handles_);
  }
  for (auto& h : hs) h.remove();
}

void Clog::close() {
  detach();
  std::lock_guard<std::mutex> lock(mu_);
  if (file_ != nullptr) std::fclose(file_);
  file_ = nullptr;
}

}  // namespace fastcomms
