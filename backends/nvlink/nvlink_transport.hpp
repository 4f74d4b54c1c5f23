// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

// The "nvlink" Ulysses transport (private to backends/nvlink): NvlinkUlysses behind the Ulysses
// layer's interface. Owned: made for a Ulysses group, released by destroy(). Lent: the nvlink
// backend's own engine, which destroy() leaves to the communicator.

#include <memory>
#include <mutex>
#include <string>

#include "backends/nvlink/nvlink_ulysses.hpp"
#include "fastcomms/ulysses/transport.hpp"

namespace fastcomms {

class NvlinkTransport final : public UlyssesTransport {
 public:
  /// Collective over init.store: sets up the engine's pads and buffers.
  NvlinkTransport(const TransportInit& init, bool owned,
                  const NvlinkTuning& tuning = NvlinkTuning::from_env());
  std::string kind() const override { return "nvlink"; }
  std::shared_ptr<void> empty_output(int64_t bytes) override;
  bool all_to_all_4d_fp8(const TensorView& x, const TensorView& out, const TensorView* scales,
                         const UlyssesArgs& args, DType wire, void* stream) override;
  std::shared_ptr<UlyssesTransport> async_lane() override;
  UlyssesMemoryStats memory_stats() const override;
  void check_errors() override;
  void destroy() override;
  void tune(const std::string& knob, const std::string& value) override;
  /// The engine (throws after destroy()).
  NvlinkUlysses& engine() const;

 protected:
  plan::Path path() const override { return plan::Path::kPeerToPeer; }
  void check_input(const TensorView& x) const override;
  WorkPtr run(const TensorView& x, const TensorView& out, const UlyssesArgs& args,
              const plan::UlyssesRequest& req, const std::shared_ptr<const plan::UlyssesPlan>& plan,
              void* stream) override;

 private:
  TransportInit init_;
  bool owned_;
  std::shared_ptr<NvlinkUlysses> engine_;
  std::mutex mu_;
  std::shared_ptr<NvlinkTransport> async_;
};

}  // namespace fastcomms
