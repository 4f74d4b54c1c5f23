// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once
// A backend that hands its ops to another object with the same op signatures: the gloo backend
// to its implementation, the nvlink backend to the nccl communicator it wraps. A subclass
// overrides what it does differently (nvlink: the peer-to-peer all-to-all).
#include "fastcomms/core/backend.hpp"

namespace fastcomms {

template <typename Target>
class ForwardingBackend : public Backend {
 public:
  WorkPtr send(const TensorView& t, int dst, const OpContext& c) override {
    return target().send(t, dst, c);
  }
  WorkPtr recv(const TensorView& t, int src, const OpContext& c) override {
    return target().recv(t, src, c);
  }
  WorkPtr batch_p2p(const std::vector<P2POp>& ops, const OpContext& c) override {
    return target().batch_p2p(ops, c);
  }
  WorkPtr broadcast(const TensorView& t, int root, const OpContext& c) override {
    return target().broadcast(t, root, c);
  }
  WorkPtr all_reduce(const TensorView& t, const ReduceOp& op, const OpContext& c) override {
    return target().all_reduce(t, op, c);
  }
  WorkPtr reduce(const TensorView& t, int root, const ReduceOp& op, const OpContext& c) override {
    return target().reduce(t, root, op, c);
  }
  WorkPtr all_gather(const std::vector<TensorView>& outs, const TensorView& in,
                     const OpContext& c) override {
    return target().all_gather(outs, in, c);
  }
  WorkPtr all_gather_single(const TensorView& out, const TensorView& in,
                            const OpContext& c) override {
    return target().all_gather_single(out, in, c);
  }
  WorkPtr reduce_scatter(const TensorView& out, const std::vector<TensorView>& ins,
                         const ReduceOp& op, const OpContext& c) override {
    return target().reduce_scatter(out, ins, op, c);
  }
  WorkPtr reduce_scatter_single(const TensorView& out, const TensorView& in, const ReduceOp& op,
                                const OpContext& c) override {
    return target().reduce_scatter_single(out, in, op, c);
  }
  WorkPtr all_to_all_v_single(const TensorView& out, const TensorView& in,
                              const std::vector<int64_t>& out_splits,
                              const std::vector<int64_t>& in_splits, const OpContext& c) override {
    return target().all_to_all_v_single(out, in, out_splits, in_splits, c);
  }
  WorkPtr all_to_all(const std::vector<TensorView>& outs, const std::vector<TensorView>& ins,
                     const OpContext& c) override {
    return target().all_to_all(outs, ins, c);
  }
  WorkPtr barrier(const OpContext& c) override { return target().barrier(c); }
  WorkPtr scatter(const TensorView& out, const std::vector<TensorView>& ins, int root,
                  const OpContext& c) override {
    return target().scatter(out, ins, root, c);
  }
  WorkPtr gather(const std::vector<TensorView>& outs, const TensorView& in, int root,
                 const OpContext& c) override {
    return target().gather(outs, in, root, c);
  }
  void abort() override { target().abort(); }
  void finalize() override { target().finalize(); }

 protected:
  /// What the ops go to; alive as long as this backend.
  virtual Target& target() const = 0;
};

}  // namespace fastcomms
