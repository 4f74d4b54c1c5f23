// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fastcomms/core/ulysses.hpp"

#include <cstring>

#include "fastcomms/error.hpp"

namespace fastcomms {
namespace {

constexpr const char* kOp = "all_to_all_4d";

// Finishes the collective path on the caller's thread: waits for the exchange, then unpacks.
class UnpackWork : public Work {
 public:
  UnpackWork(WorkPtr inner, std::shared_ptr<const plan::UlyssesPlan> plan,
             std::shared_ptr<std::vector<std::byte>> send,
             std::shared_ptr<std::vector<std::byte>> recv, void* out)
      : inner_(std::move(inner)),
        plan_(std::move(plan)),
        send_(std::move(send)),
        recv_(std::move(recv)),
        out_(out) {}

  WorkStatus status() const override {
    const WorkStatus s = inner_->status();
    std::lock_guard<std::mutex> lock(mu_);
    return s == WorkStatus::kCompleted && !unpacked_ ? WorkStatus::kInProgress : s;
  }

  void wait() override {
    inner_->wait();
    std::lock_guard<std::mutex> lock(mu_);
    if (unpacked_) return;
    for (const plan::CopyDesc& c : plan_->unpack) plan::copy_host(c, recv_->data(), out_);
    unpacked_ = true;
    send_.reset();
    recv_.reset();
  }

 private:
  WorkPtr inner_;
  std::shared_ptr<const plan::UlyssesPlan> plan_;
  std::shared_ptr<std::vector<std::byte>> send_, recv_;
  void* out_;
  mutable std::mutex mu_;
  bool unpacked_ = false;
};

}  // namespace

UlyssesGroup::UlyssesGroup(std::shared_ptr<Communicator> comm) : comm_(std::move(comm)) {
  FASTCOMMS_CHECK(comm_ != nullptr, kInvalidArgument, "UlyssesGroup: communicator is null");
}

plan::UlyssesRequest UlyssesGroup::request(const TensorView& x, const UlyssesArgs& args) const {
  const std::string prefix =
      detail::cat("[rank ", comm_->rank(), "/", comm_->size(), " ", comm_->name(), "] ", kOp, ": ");
  FASTCOMMS_CHECK(x.shape.size() == 4, kInvalidArgument, prefix, "x must be 4-D (b, s, h, d), got ",
                  x.describe());
  FASTCOMMS_CHECK(x.is_contiguous(), kInvalidArgument, prefix, "x must be contiguous, got ",
                  x.describe(), " with non-dense strides");
  plan::UlyssesRequest req;
  req.world_size = comm_->size();
  req.rank = comm_->rank();
  req.mode = args.mode;
  for (int i = 0; i < 4; ++i) req.shape[i] = x.shape[i];
  req.element_size = static_cast<int64_t>(x.element_size());
  req.seq_splits = args.seq_splits;
  req.head_splits = args.head_splits;
  req.path = plan::Path::kCollective;
  req.op_name = kOp;
  req.comm_name = comm_->name();
  return req;
}

std::array<int64_t, 4> UlyssesGroup::output_shape(const TensorView& x,
                                                  const UlyssesArgs& args) const {
  return plan::ulysses_output_shape(request(x, args));
}

std::shared_ptr<const plan::UlyssesPlan> UlyssesGroup::plan_for(const plan::UlyssesRequest& req) {
  auto key =
      std::make_tuple(req.mode, req.shape[0], req.shape[1], req.shape[2], req.shape[3],
                      req.element_size, req.seq_splits.value_or(std::vector<int64_t>{}),
                      req.head_splits.value_or(std::vector<int64_t>{}), req.seq_splits.has_value());
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  auto p = std::make_shared<const plan::UlyssesPlan>(plan::make_ulysses_plan(req));
  if (plans_.size() > 64) plans_.clear();  // bounded: shapes rarely vary that much
  plans_.emplace(std::move(key), p);
  return p;
}

void UlyssesGroup::check_agreement(const plan::UlyssesPlan& p, DType dt) {
  const int P = comm_->size();
  constexpr int kFields = 6;
  const int64_t mine[kFields] = {static_cast<int64_t>(p.geometry_key),
                                 p.mode,
                                 p.b,
                                 p.d,
                                 p.element_size,
                                 static_cast<int64_t>(dt)};
  std::vector<int64_t> all(static_cast<size_t>(kFields) * P);
  comm_->all_gather_single(
      TensorView::contiguous(all.data(), DType::kInt64, {kFields * P}),
      TensorView::contiguous(const_cast<int64_t*>(mine), DType::kInt64, {kFields}));
  const char* names[kFields] = {"", "mode", "b", "d", "element size", "dtype"};
  const std::string prefix = detail::cat("[rank ", comm_->rank(), "/", P, " ", comm_->name(), "] ",
                                         kOp, ": ranks disagree on the call: rank ");
  for (int r = 0; r < P; ++r) {
    for (int f = 1; f <= kFields; ++f) {
      const int field = f % kFields;  // compare the named fields first, the splits hash last
      const int64_t theirs = all[static_cast<size_t>(r) * kFields + field];
      if (theirs == mine[field]) continue;
      if (field == 0) {
        throw Error(ErrorCode::kInvalidArgument,
                    detail::cat(prefix, r,
                                "'s global sequence/head splits differ from this "
                                "rank's"));
      }
      const auto show = [&](int64_t v) {
        return field == 5 ? std::string(dtype_name(static_cast<DType>(v))) : std::to_string(v);
      };
      throw Error(ErrorCode::kInvalidArgument,
                  detail::cat(prefix, r, " has ", names[field], " ", show(theirs),
                              ", this rank has ", show(mine[field])));
    }
  }
}

WorkPtr UlyssesGroup::all_to_all_4d(const TensorView& x, const TensorView& out,
                                    const UlyssesArgs& args) {
  const plan::UlyssesRequest req = request(x, args);
  const std::string prefix =
      detail::cat("[rank ", comm_->rank(), "/", comm_->size(), " ", comm_->name(), "] ", kOp, ": ");
  auto p = plan_for(req);
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
  if (args.check_agreement && comm_->size() > 1) check_agreement(*p, x.dtype);

  const int64_t e = p->element_size;
  auto send = std::make_shared<std::vector<std::byte>>(static_cast<size_t>(p->send_elems * e));
  auto recv = std::make_shared<std::vector<std::byte>>(static_cast<size_t>(p->recv_elems * e));
  for (const plan::CopyDesc& c : p->pack) plan::copy_host(c, x.data, send->data());
  std::vector<int64_t> send_bytes(p->send_counts.size()), recv_bytes(p->recv_counts.size());
  for (size_t i = 0; i < send_bytes.size(); ++i) {
    send_bytes[i] = p->send_counts[i] * e;
    recv_bytes[i] = p->recv_counts[i] * e;
  }
  CallOptions o;
  o.async_op = true;
  WorkPtr inner = comm_->all_to_all_v_single(
      TensorView::contiguous(recv->data(), DType::kUInt8, {p->recv_elems * e}, x.device),
      TensorView::contiguous(send->data(), DType::kUInt8, {p->send_elems * e}, x.device),
      recv_bytes, send_bytes, o);
  auto work = std::make_shared<UnpackWork>(std::move(inner), p, send, recv, out.data);
  if (!args.async_op) work->wait();
  return work;
}

}  // namespace fastcomms
