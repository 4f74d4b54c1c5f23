// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/ulysses.hpp"

#include <array>
#include <cstring>

#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

constexpr const char* kOp = "all_to_all_4d";

// NOTE [ulysses chunk header]: every chunk of the collective path starts with a header
// holding the sender's view of the call (geometry key, mode, b, d, element size, dtype). The
// receiver compares each peer's header with its own before it unpacks, so ranks that issued
// different calls all raise instead of mixing bytes, at no extra round trip. Gloo delivers a
// short message without complaint when counts disagree; the header still arrives first.
constexpr int kHeaderWords = 6;
constexpr int64_t kHeaderBytes = kHeaderWords * 8;
using Header = std::array<int64_t, kHeaderWords>;
constexpr const char* kHeaderFields[kHeaderWords] = {"", "mode", "b", "d", "element size", "dtype"};

// Finishes the collective path on the caller's thread: waits for the exchange, checks the
// headers, then unpacks.
class UnpackWork : public Work {
 public:
  UnpackWork(WorkPtr inner, std::shared_ptr<const plan::UlyssesPlan> plan,
             std::shared_ptr<UlyssesScratch> send, std::shared_ptr<UlyssesScratch> recv, void* out,
             Header mine, std::string prefix)
      : inner_(std::move(inner)),
        plan_(std::move(plan)),
        send_(std::move(send)),
        recv_(std::move(recv)),
        out_(out),
        mine_(mine),
        prefix_(std::move(prefix)) {}

  WorkStatus status() const override {
    const WorkStatus s = inner_->status();
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) return WorkStatus::kError;
    return s == WorkStatus::kCompleted && !unpacked_ ? WorkStatus::kInProgress : s;
  }

  void wait() override {
    inner_->wait();
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
    if (unpacked_) return;
    const plan::UlyssesPlan& p = *plan_;
    const int64_t e = p.element_size;
    auto* recv = recv_->data.get();
    try {
      for (int q = 0; q < p.world_size; ++q) {
        Header theirs;
        std::memcpy(theirs.data(), recv + p.recv_displs[q] * e + q * kHeaderBytes, kHeaderBytes);
        check_header(q, theirs);
      }
    } catch (...) {
      error_ = std::current_exception();
      send_.reset();
      recv_.reset();
      throw;
    }
    for (int q = 0; q < p.world_size; ++q)
      plan::copy_host(p.unpack[q], recv + (q + 1) * kHeaderBytes, out_);
    unpacked_ = true;
    send_.reset();
    recv_.reset();
  }

 private:
  void check_header(int r, const Header& theirs) const {
    for (int f = 1; f <= kHeaderWords; ++f) {
      const int field = f % kHeaderWords;  // the named fields first, the splits hash last
      if (theirs[field] == mine_[field]) continue;
      const std::string lead = detail::cat(prefix_, "ranks disagree on the call: rank ", r);
      if (field == 0)
        throw Error(ErrorCode::kInvalidArgument,
                    lead + "'s global sequence/head splits differ from this rank's");
      const auto show = [&](int64_t v) {
        return field == 5 ? std::string(dtype_name(static_cast<DType>(v))) : std::to_string(v);
      };
      throw Error(ErrorCode::kInvalidArgument,
                  detail::cat(lead, " has ", kHeaderFields[field], " ", show(theirs[field]),
                              ", this rank has ", show(mine_[field])));
    }
  }

  WorkPtr inner_;
  std::shared_ptr<const plan::UlyssesPlan> plan_;
  std::shared_ptr<UlyssesScratch> send_, recv_;
  void* out_;
  Header mine_;
  std::string prefix_;
  mutable std::mutex mu_;
  bool unpacked_ = false;
  std::exception_ptr error_;
};

}  // namespace

std::shared_ptr<UlyssesScratch> UlyssesGroup::scratch(std::shared_ptr<UlyssesScratch>& pool,
                                                      int64_t bytes) {
  // NOTE [ulysses scratch reuse]: a buffer is reused only when no in-flight async call still
  // holds it (use_count 1: the pool alone); otherwise a fresh one replaces it in the pool.
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool || pool.use_count() > 1 || pool->size < bytes) {
    auto fresh = std::make_shared<UlyssesScratch>();
    fresh->size = std::max<int64_t>(bytes, pool && pool.use_count() == 1 ? pool->size : 0);
    fresh->data.reset(new std::byte[static_cast<size_t>(std::max<int64_t>(fresh->size, 1))]);
    pool = fresh;
  }
  return pool;
}

UlyssesGroup::UlyssesGroup(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {
  FASTCOMMS_CHECK(comm_ != nullptr, kInvalidArgument, "UlyssesGroup: communicator is null");
}

plan::UlyssesRequest ulysses_request(const TensorView& x, const UlyssesArgs& args, int rank,
                                     int size, const std::string& comm_name, plan::Path path) {
  const std::string prefix =
      detail::cat("[rank ", rank, "/", size, " ", comm_name, "] ", kOp, ": ");
  FASTCOMMS_CHECK(x.shape.size() == 4, kInvalidArgument, prefix, "x must be 4-D (b, s, h, d), got ",
                  x.describe());
  FASTCOMMS_CHECK(x.is_contiguous(), kInvalidArgument, prefix, "x must be contiguous, got ",
                  x.describe(), " with non-dense strides");
  plan::UlyssesRequest req;
  req.world_size = size;
  req.rank = rank;
  req.mode = args.mode;
  for (int i = 0; i < 4; ++i) req.shape[i] = x.shape[i];
  req.element_size = static_cast<int64_t>(x.element_size());
  req.seq_splits = args.seq_splits;
  req.head_splits = args.head_splits;
  req.path = path;
  req.op_name = kOp;
  req.comm_name = comm_name;
  return req;
}

std::shared_ptr<const plan::UlyssesPlan> UlyssesPlanCache::get(const plan::UlyssesRequest& req) {
  Key key{req.world_size,
          req.rank,
          req.mode,
          static_cast<int>(req.path),
          req.shape,
          req.element_size,
          req.seq_splits.value_or(std::vector<int64_t>{}),
          req.head_splits.value_or(std::vector<int64_t>{}),
          req.seq_splits.has_value()};
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  auto p = std::make_shared<const plan::UlyssesPlan>(plan::make_ulysses_plan(req));
  if (plans_.size() > 256) plans_.clear();  // bounded: shapes rarely vary that much
  plans_.emplace(std::move(key), p);
  return p;
}

plan::UlyssesRequest UlyssesGroup::request(const TensorView& x, const UlyssesArgs& args) const {
  return ulysses_request(x, args, comm_->rank(), comm_->size(), comm_->name(),
                         plan::Path::kCollective);
}

std::array<int64_t, 4> UlyssesGroup::output_shape(const TensorView& x,
                                                  const UlyssesArgs& args) const {
  return plan::ulysses_output_shape(request(x, args));
}

WorkPtr UlyssesGroup::all_to_all_4d(const TensorView& x, const TensorView& out,
                                    const UlyssesArgs& args) {
  const plan::UlyssesRequest req = request(x, args);
  const std::string prefix =
      detail::cat("[rank ", comm_->rank(), "/", comm_->size(), " ", comm_->name(), "] ", kOp, ": ");
  auto p = plans_.get(req);
  FASTCOMMS_CHECK(out.dtype == x.dtype, kTypeError, prefix, "out has dtype ", dtype_name(out.dtype),
                  ", x has ", dtype_name(x.dtype));
  FASTCOMMS_CHECK(out.device == x.device, kInvalidArgument, prefix, "out is on ", out.device.str(),
                  ", x on ", x.device.str());
  FASTCOMMS_CHECK(out.is_contiguous(), kInvalidArgument, prefix, "out must be contiguous");
  FASTCOMMS_CHECK(out.shape == std::vector<int64_t>(p->out_shape.begin(), p->out_shape.end()),
                  kInvalidArgument, prefix, "out has shape ", out.describe(), ", expected [",
                  p->out_shape[0], ", ", p->out_shape[1], ", ", p->out_shape[2], ", ",
                  p->out_shape[3], "]");
  FASTCOMMS_CHECK(x.device.type == DeviceType::kCPU, kUnsupported, prefix,
                  "the C++ collective path packs CPU tensors; ", x.device.str(),
                  " tensors go through the CUDA transport");
  const int64_t e = p->element_size;
  const int P = p->world_size;
  const Header mine = {static_cast<int64_t>(p->geometry_key), p->mode, p->b, p->d, e,
                       static_cast<int64_t>(x.dtype)};
  // Chunk q of the send buffer: header, then the plan's chunk (see NOTE [ulysses chunk header]).
  auto send = scratch(send_pool_, p->send_elems * e + P * kHeaderBytes);
  auto recv = scratch(recv_pool_, p->recv_elems * e + P * kHeaderBytes);
  std::vector<int64_t> send_bytes(P), recv_bytes(P);
  for (int q = 0; q < P; ++q) {
    std::memcpy(send->data.get() + p->send_displs[q] * e + q * kHeaderBytes, mine.data(),
                kHeaderBytes);
    plan::copy_host(p->pack[q], x.data, send->data.get() + (q + 1) * kHeaderBytes);
    send_bytes[q] = p->send_counts[q] * e + kHeaderBytes;
    recv_bytes[q] = p->recv_counts[q] * e + kHeaderBytes;
  }
  const int64_t send_total = p->send_elems * e + P * kHeaderBytes;
  const int64_t recv_total = p->recv_elems * e + P * kHeaderBytes;
  CallOptions o;
  o.async_op = true;
  WorkPtr inner = comm_->all_to_all_v_single(
      TensorView::contiguous(recv->data.get(), DType::kUInt8, {recv_total}, x.device),
      TensorView::contiguous(send->data.get(), DType::kUInt8, {send_total}, x.device), recv_bytes,
      send_bytes, o);
  // The transport reads `send` and writes `recv` until the exchange completes, even when the
  // caller drops the returned Work (NOTE [work keeps its buffers]); while it does, the pools
  // see them in use and hand the next call fresh ones (NOTE [ulysses scratch reuse]).
  inner->hold(send);
  inner->hold(recv);
  auto work = std::make_shared<UnpackWork>(std::move(inner), p, send, recv, out.data, mine, prefix);
  if (!args.async_op) work->wait();
  return work;
}

}  // namespace fastcomms
