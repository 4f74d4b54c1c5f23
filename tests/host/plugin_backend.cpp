// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// A tiny backend library for the dlopen tests, built three ways (PLUGIN_MODE): a good one, one
// with another ABI version, and one without the entry point.
#include "fastcomms/core/factory.hpp"

namespace {

class ToyBackend : public fastcomms::Backend {
 public:
  explicit ToyBackend(const fastcomms::BackendInit& init) : size_(init.size) {}
  std::string name() const override { return "toy"; }
  std::string version() const override { return "toy 1.0"; }
  fastcomms::Capabilities capabilities() const override {
    fastcomms::Capabilities c;
    c.ops = (uint64_t{1} << static_cast<int>(fastcomms::OpKind::kBarrier)) |
            (uint64_t{1} << static_cast<int>(fastcomms::OpKind::kAllReduce));
    c.cpu_tensors = true;
    return c;
  }
  fastcomms::WorkPtr barrier(const fastcomms::OpContext&) override {
    return std::make_shared<fastcomms::CompletedWork>();
  }
  // A world of one: the reduction is the input (the toy only supports size 1).
  fastcomms::WorkPtr all_reduce(const fastcomms::TensorView&, const fastcomms::ReduceOp&,
                                const fastcomms::OpContext&) override {
    return std::make_shared<fastcomms::CompletedWork>();
  }

 private:
  int size_;
};

}  // namespace

#if PLUGIN_MODE == 0
FASTCOMMS_DEFINE_BACKEND_ENTRY("toy", ToyBackend)
#elif PLUGIN_MODE == 1
extern "C" __attribute__((visibility("default"))) const FastcommsBackendEntry*
fastcomms_backend_entry() {
  static const FastcommsBackendEntry entry{
      FASTCOMMS_BACKEND_ABI_VERSION + 998, "toy",
      [](const fastcomms::BackendInit* init) -> fastcomms::Backend* {
        return new ToyBackend(*init);
      }};
  return &entry;
}
#else
extern "C" __attribute__((visibility("default"))) int not_the_entry_point() { return 0; }
#endif
