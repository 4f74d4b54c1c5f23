// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [nccl-lazy]: the "nccl-lazy" backend, torchcomms' LazyBackend<TorchCommNCCL>
// (comms/torchcomms/lazy/LazyBackend.hpp, nccl/TorchCommNCCLLazy.cpp): a nccl backend over every
// rank (the primary) runs the collectives, batch_p2p (one NCCL group may name several peers),
// split (whose result is a plain nccl communicator, as torchcomms' split of the primary is),
// windows and finalize's last step; each send and receive runs on a two-rank nccl backend of its
// own per peer, made on the first send or receive between the two ranks (no other rank takes
// part: its unique id goes through the store under "p2p-<lo>-<hi>"), so sends to different
// peers and collectives run on different streams, as c10d's ProcessGroupNCCL once did. In the
// pair the lower rank is rank 0. A pair communicator's NCCL config is the communicator's own
// (NOTE [nccl config hints]) named "<name>/p2p-<lo>-<hi>" (torchcomms gives its pair
// communicators NCCL's defaults and that name). Memory registration reaches the primary and
// every pair made so far (a pair made later does not get the earlier registrations, as in
// torchcomms); abort() reaches them all; finalize() finalizes the pairs, then the primary.
// get_nccl_comm_ptr is not offered (torchcomms' lazy backend object has no such method).
#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "backends/nccl/nccl_api.hpp"
#include "backends/nccl/nccl_backend.hpp"
#include "backends/nccl/nccl_config.hpp"
#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/forwarding_backend.hpp"
#include "fastcomms/core/store.hpp"
#include "fastcomms/error.hpp"

namespace fastcomms::nccl_backend {
namespace {

class NcclLazyBackend final : public ForwardingBackend<Backend> {
 public:
  NcclLazyBackend(const BackendInit& init, std::shared_ptr<NcclApi> api)
      : init_(init),
        api_(std::move(api)),
        config_(init.options.hints, init.options.name,
                detail::cat("[rank ", init.rank, "/", init.size, " ", init.options.name,
                            " new_comm] nccl-lazy: ")),
        primary_(make_nccl_backend(init, api_, config_)) {}

  std::string name() const override { return "nccl-lazy"; }
  std::string version() const override { return primary_->version(); }
  Capabilities capabilities() const override { return primary_->capabilities(); }

  WorkPtr send(const TensorView& t, int dst, const OpContext& c) override {
    return pair_for(dst, c.prefix).send(t, peer_in_pair(dst), c);
  }
  WorkPtr recv(const TensorView& t, int src, const OpContext& c) override {
    return pair_for(src, c.prefix).recv(t, peer_in_pair(src), c);
  }

  std::unique_ptr<Backend> split(const std::vector<int>& ranks, const std::string& name,
                                 const BackendInit* init) override {
    return primary_->split(ranks, name, init);
  }
  void register_memory(void* ptr, int64_t bytes, const std::string& where) override {
    primary_->register_memory(ptr, bytes, where);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [peer, pair] : pairs_) pair->register_memory(ptr, bytes, where);
  }
  void deregister_memory(void* ptr, const std::string& where) override {
    primary_->deregister_memory(ptr, where);
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [peer, pair] : pairs_) pair->deregister_memory(ptr, where);
  }
  bool supports_window() const override { return primary_->supports_window(); }
  std::shared_ptr<Window> new_window(const OpContext& c) override {
    return primary_->new_window(c);
  }
  bool checks_calls(const OpContext& ctx) const override { return primary_->checks_calls(ctx); }

  void abort() override {
    aborted_ = true;
    primary_->abort();
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [peer, pair] : pairs_) pair->abort();
  }
  void finalize() override {
    std::map<int, std::shared_ptr<Backend>> pairs;
    {
      std::lock_guard<std::mutex> lock(mu_);
      pairs = pairs_;  // kept for destruction after the primary, abort() still reaches them
    }
    for (auto& [peer, pair] : pairs) pair->finalize();
    primary_->finalize();
  }

  // For tests: the pair communicators made so far.
  size_t pairs() const {
    std::lock_guard<std::mutex> lock(mu_);
    return pairs_.size();
  }

 protected:
  Backend& target() const override { return *primary_; }

 private:
  // The peer's rank in the pair: the lower rank is 0.
  int peer_in_pair(int peer) const { return init_.rank < peer ? 1 : 0; }

  // The pair communicator with `peer`, made on first use. Made outside the lock (it waits for the
  // peer), so abort() is not held up; the caller's thread is the only one that makes pairs
  // (sends and receives are issued in order per thread, as the backend contract has them).
  Backend& pair_for(int peer, const std::string& prefix) {
    FASTCOMMS_CHECK(peer != init_.rank && peer >= 0 && peer < init_.size, kInvalidArgument, prefix,
                    "nccl-lazy: invalid peer rank ", peer, " (self=", init_.rank,
                    ", size=", init_.size, ")");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = pairs_.find(peer); it != pairs_.end()) return *it->second;
    }
    FASTCOMMS_CHECK(!aborted_, kAborted, prefix, "nccl-lazy: the communicator was aborted");
    const int lo = std::min(init_.rank, peer), hi = std::max(init_.rank, peer);
    const std::string key = detail::cat("p2p-", lo, "-", hi);
    BackendInit pair = init_;
    pair.rank = init_.rank == lo ? 0 : 1;
    pair.size = 2;
    pair.options.name = detail::cat(init_.options.name, "/", key);
    pair.options.store = std::make_shared<PrefixStore>(key, init_.options.store);
    NcclConfig config = config_;
    config.set_comm_name(pair.options.name);
    std::shared_ptr<Backend> made = make_nccl_backend(pair, api_, std::move(config));
    std::lock_guard<std::mutex> lock(mu_);
    if (aborted_) made->abort();  // aborted while the pair was made
    return *pairs_.emplace(peer, std::move(made)).first->second;
  }

  BackendInit init_;
  std::shared_ptr<NcclApi> api_;
  NcclConfig config_;  // NOTE [nccl config hints], the pairs' too
  std::unique_ptr<Backend> primary_;
  mutable std::mutex mu_;  // pairs_
  std::map<int, std::shared_ptr<Backend>> pairs_;
  std::atomic<bool> aborted_{false};
};

const StaticBackendRegistration kRegistration("nccl-lazy", [](const BackendInit& init) {
  return make_nccl_lazy_backend(init, real_nccl_api());
});

}  // namespace

std::unique_ptr<Backend> make_nccl_lazy_backend(const BackendInit& init,
                                                std::shared_ptr<NcclApi> api) {
  FASTCOMMS_CHECK(api != nullptr, kInvalidArgument, "[rank ", init.rank, "/", init.size, " ",
                  init.options.name, " new_comm] nccl-lazy: ", "the NCCL API must not be null");
  return std::make_unique<NcclLazyBackend>(init, std::move(api));
}

}  // namespace fastcomms::nccl_backend
