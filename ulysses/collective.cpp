// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The collective path of the Ulysses all-to-all on CPU tensors: pack with plan/'s descriptors
// (memcpy), one all_to_all_v_single on the communicator, unpack.
#include <array>
#include <cstring>

#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/transport.hpp"

namespace fastcomms {
namespace {

// NOTE [ulysses chunk header]: every chunk of the collective path starts with a header
// holding the sender's view of the call (geometry key, mode, b, d, element size, dtype). The
// receiver compares each peer's header with its own before it unpacks, so ranks that issued
// different calls all raise instead of mixing bytes, at no extra round trip. Gloo delivers a
// short message without complaint when counts disagree; the header still arrives first.
constexpr int kHeaderWords = 6;
constexpr int64_t kHeaderBytes = kHeaderWords * 8;
using Header = std::array<int64_t, kHeaderWords>;
constexpr const char* kHeaderFields[kHeaderWords] = {"", "mode", "b", "d", "element size", "dtype"};

// A grow-only host staging buffer (uninitialized).
struct UlyssesScratch {
  std::unique_ptr<std::byte[]> data;
  int64_t size = 0;
};

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

  // x was packed at issue and `out` is written only by wait(): once the exchange is over, the
  // caller's tensors are free (the internal buffers ride on the inner Work).
  bool tensors_released() const override { return inner_->is_completed(); }

  void wait() override {
    inner_->wait();
    inner_->waited();  // NOTE [wait observers]: this Work is the exchange's frontend
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

class CollectiveTransport final : public UlyssesTransport {
 public:
  explicit CollectiveTransport(std::shared_ptr<Communicator> comm)
      : UlyssesTransport(comm->rank(), comm->size(), comm->name()), comm_(std::move(comm)) {}
  std::string kind() const override { return "collective"; }

 protected:
  plan::Path path() const override { return plan::Path::kCollective; }
  void check_input(const TensorView& x) const override {
    FASTCOMMS_CHECK(x.device.type == DeviceType::kCPU, kUnsupported, prefix(),
                    "the CPU collective path packs CPU tensors; ", x.device.str(),
                    " tensors go through a CUDA transport");
  }
  WorkPtr run(const TensorView& x, const TensorView& out, const UlyssesArgs& args,
              const plan::UlyssesRequest& req, const std::shared_ptr<const plan::UlyssesPlan>& plan,
              void* stream) override;

 private:
  std::shared_ptr<UlyssesScratch> scratch(std::shared_ptr<UlyssesScratch>& pool, int64_t bytes);

  std::shared_ptr<Communicator> comm_;
  std::mutex mu_;
  std::shared_ptr<UlyssesScratch> send_pool_, recv_pool_;
};

std::shared_ptr<UlyssesScratch> CollectiveTransport::scratch(std::shared_ptr<UlyssesScratch>& pool,
                                                             int64_t bytes) {
  // NOTE [ulysses scratch reuse]: a buffer is reused only when no in-flight call still holds it
  // (use_count 1: the pool alone; an exchange's Work holds its buffers, NOTE [work keeps its
  // buffers]); otherwise a fresh one replaces it in the pool.
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool || pool.use_count() > 1 || pool->size < bytes) {
    auto fresh = std::make_shared<UlyssesScratch>();
    fresh->size = std::max<int64_t>(bytes, pool && pool.use_count() == 1 ? pool->size : 0);
    fresh->data.reset(new std::byte[static_cast<size_t>(std::max<int64_t>(fresh->size, 1))]);
    pool = fresh;
  }
  return pool;
}

WorkPtr CollectiveTransport::run(const TensorView& x, const TensorView& out,
                                 const UlyssesArgs& args, const plan::UlyssesRequest&,
                                 const std::shared_ptr<const plan::UlyssesPlan>& p, void*) {
  const std::string prefix = this->prefix();
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
  // Ranks whose calls disagree on the geometry so that the chunk sizes differ are caught by the
  // gloo backend's strict call check (FASTCOMMS_CHECK_CALLS=strict, NOTE [per-peer sizes
  // check]) before any byte moves; otherwise a chunk longer than expected fails the
  // communicator (NOTE [gloo I/O thread errors]) and the chunk headers catch the rest, naming
  // both geometries. So gloo's default mode is told that this _v form's sizes are checked here
  // (else it would run the strict check for it, NOTE [call check modes], which cost 40-58% of a
  // 1 MiB call on loopback, docs/benchmarks.md); strict, where asked for, still runs.
  o.options.hints["gloo.caller_checks_sizes"] = "1";
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

}  // namespace

UlyssesTransportPtr make_collective_transport(std::shared_ptr<Communicator> comm) {
  FASTCOMMS_CHECK(comm != nullptr, kInvalidArgument, "all_to_all_4d: communicator is null");
  return std::make_shared<CollectiveTransport>(std::move(comm));
}

}  // namespace fastcomms
