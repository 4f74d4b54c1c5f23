// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The hierarchical Ulysses all-to-all's shared part (NOTE [hierarchical split]): host maps, the
// compacted exchange of a plan's share, the byte all-to-all over a communicator, and the CPU
// transport (the host's ranks over a split of the group's communicator, the other hosts' over
// the communicator itself). The CUDA transport, whose host part is the NVLink engine, lives in
// backends/nvlink.
#include "fastcomms/ulysses/hierarchical.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>

#include "fastcomms/error.hpp"

namespace fastcomms {

HostMap host_map(const std::vector<int>& host_of, int rank) {
  FASTCOMMS_CHECK(rank >= 0 && rank < static_cast<int>(host_of.size()), kInvalidArgument,
                  "host_map: rank ", rank, " is not in a group of ", host_of.size());
  HostMap m;
  // Renumbered in order of each host's first rank, so every rank numbers the hosts alike.
  std::map<int, int> number;
  for (const int h : host_of) number.emplace(h, static_cast<int>(number.size()));
  std::vector<int> count(number.size(), 0);
  for (size_t r = 0; r < host_of.size(); ++r) {
    m.host_of.push_back(number[host_of[r]]);
    ++count[m.host_of.back()];
  }
  m.hosts = static_cast<int>(number.size());
  m.max_per_host = *std::max_element(count.begin(), count.end());
  for (size_t r = 0; r < host_of.size(); ++r)
    if (m.host_of[r] == m.host_of[rank]) {
      if (static_cast<int>(r) == rank) m.local_rank = static_cast<int>(m.members.size());
      m.members.push_back(static_cast<int>(r));
    }
  return m;
}

HostMap host_map(const std::vector<std::string>& host_names, int rank) {
  std::map<std::string, int> id;
  std::vector<int> of;
  for (const std::string& h : host_names) of.push_back(id.emplace(h, id.size()).first->second);
  return host_map(of, rank);
}

ExchangePart exchange_part(const plan::UlyssesPlan& p, const std::vector<bool>& include) {
  const int P = p.world_size;
  FASTCOMMS_CHECK(static_cast<int>(include.size()) == P, kInvalidArgument,
                  "exchange_part: a mask of ", include.size(), " peers for a group of ", P);
  FASTCOMMS_CHECK(p.path == plan::Path::kCollective, kInvalidArgument,
                  "exchange_part: needs a collective-path plan");
  const int64_t e = p.element_size;
  ExchangePart part;
  part.pack.resize(P);
  part.unpack.resize(P);
  part.send_bytes.assign(P, 0);
  part.recv_bytes.assign(P, 0);
  for (int q = 0; q < P; ++q) {
    if (!include[q]) continue;
    // The plan's chunk for q starts at send_displs[q] elements; here at send_total bytes.
    part.pack[q] = p.pack[q];
    if (!part.pack[q].empty()) part.pack[q].dst_offset += part.send_total - p.send_displs[q] * e;
    part.unpack[q] = p.unpack[q];
    if (!part.unpack[q].empty())
      part.unpack[q].src_offset += part.recv_total - p.recv_displs[q] * e;
    part.send_bytes[q] = p.send_counts[q] * e;
    part.recv_bytes[q] = p.recv_counts[q] * e;
    part.send_total += part.send_bytes[q];
    part.recv_total += part.recv_bytes[q];
  }
  return part;
}

uint64_t ulysses_call_key(const plan::UlyssesPlan& p, DType dtype) {
  return (p.geometry_key * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(dtype) + 1) | 1u;
}

ByteExchange comm_exchange(std::shared_ptr<Communicator> comm) {
  return [comm = std::move(comm)](
             const TensorView& recv, const TensorView& send, const std::vector<int64_t>& recv_bytes,
             const std::vector<int64_t>& send_bytes, void* stream, uint64_t key) {
    CallOptions o;
    o.stream = stream;
    o.call_key = key;
    WorkPtr w = comm->all_to_all_v_single(recv, send, recv_bytes, send_bytes, o);
    if (w && comm->device().type != DeviceType::kCUDA) w->wait();
  };
}

std::string host_name() {
  if (const char* id = std::getenv("FASTCOMMS_HOST_ID"); id != nullptr && *id != '\0')
    return std::string("FASTCOMMS_HOST_ID=") + id;
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

namespace {

// A byte buffer view whose pointer is never null (gloo reads no byte of an empty one, but the
// communicator's checks want a pointer).
TensorView bytes_view(std::vector<std::byte>& v, const Device& device) {
  static std::byte none;
  return TensorView::contiguous(v.empty() ? &none : v.data(), DType::kUInt8,
                                {static_cast<int64_t>(v.size())}, device);
}

// NOTE [hierarchical split] on CPU: the host's ranks exchange over a split of the group's
// communicator, the other hosts' over the communicator itself, one after the other (on CPU there
// is no second engine to overlap; the split is what the tests check, bit for bit).
class HostHierarchicalTransport final : public UlyssesTransport {
 public:
  explicit HostHierarchicalTransport(const TransportInit& init)
      : UlyssesTransport(init.rank, init.size, init.name),
        map_(host_map(init.host_of, init.rank)),
        device_(init.device) {
    FASTCOMMS_CHECK(static_cast<int>(init.host_of.size()) == init.size, kInvalidArgument, prefix(),
                    "the hierarchical path needs every rank's host (", init.host_of.size(),
                    " for a group of ", init.size, ")");
    FASTCOMMS_CHECK(init.comm != nullptr, kInvalidArgument, prefix(),
                    "the hierarchical path on CPU needs a fastcomms communicator (its split serves "
                    "the host's ranks)");
    remote_ = init.exchange ? init.exchange : comm_exchange(init.comm);
    local_comm_ = init.comm->split(map_.members, init.name + "/host");
    local_ = comm_exchange(local_comm_);
    local_mask_.assign(size_, false);
    for (const int q : map_.members) local_mask_[q] = true;
    remote_mask_.resize(size_);
    for (int q = 0; q < size_; ++q) remote_mask_[q] = !local_mask_[q];
  }
  std::string kind() const override { return "hierarchical"; }
  UlyssesMemoryStats memory_stats() const override { return {0, calls_}; }
  void destroy() override {
    if (local_comm_) local_comm_->finalize();
    local_comm_.reset();
  }
  void tune(const std::string& knob, const std::string& value) override {
    // A test fault, the armed control of the tests: the exchange between hosts left out.
    FASTCOMMS_CHECK(
        knob == "fault" && (value == "none" || value == "skip_remote"), kInvalidArgument, prefix(),
        "the hierarchical transport on CPU has one knob, fault = none|skip_remote; got ", knob,
        " = '", value, "'");
    skip_remote_ = value == "skip_remote";
  }

 protected:
  plan::Path path() const override { return plan::Path::kCollective; }
  void check_input(const TensorView& x) const override {
    FASTCOMMS_CHECK(x.device.type == DeviceType::kCPU, kInvalidArgument, prefix(), "x is on ",
                    x.device.str(), ", the group serves the CPU");
  }
  WorkPtr run(const TensorView& x, const TensorView& out, const UlyssesArgs&,
              const plan::UlyssesRequest&, const std::shared_ptr<const plan::UlyssesPlan>& plan,
              void*) override {
    const plan::UlyssesPlan& p = *plan;
    ++calls_;
    const uint64_t key = ulysses_call_key(p, x.dtype);
    const ExchangePart local = exchange_part(p, local_mask_);
    const ExchangePart remote = exchange_part(p, remote_mask_);
    std::vector<int64_t> local_send, local_recv;
    for (const int q : map_.members) {
      local_send.push_back(local.send_bytes[q]);
      local_recv.push_back(local.recv_bytes[q]);
    }
    std::vector<std::byte> ls(local.send_total), lr(local.recv_total), rs(remote.send_total),
        rr(remote.recv_total);
    for (int q = 0; q < size_; ++q) {
      const ExchangePart& part = local_mask_[q] ? local : remote;
      if (!part.pack[q].empty())
        plan::copy_host(part.pack[q], x.data, (local_mask_[q] ? ls : rs).data());
    }
    local_(bytes_view(lr, device_), bytes_view(ls, device_), local_recv, local_send, nullptr, key);
    if (!skip_remote_)
      remote_(bytes_view(rr, device_), bytes_view(rs, device_), remote.recv_bytes,
              remote.send_bytes, nullptr, key);
    for (int q = 0; q < size_; ++q) {
      if (skip_remote_ && !local_mask_[q]) continue;
      const ExchangePart& part = local_mask_[q] ? local : remote;
      if (!part.unpack[q].empty())
        plan::copy_host(part.unpack[q], (local_mask_[q] ? lr : rr).data(), out.data);
    }
    return std::make_shared<CompletedWork>();
  }

 private:
  HostMap map_;
  Device device_;
  ByteExchange local_, remote_;
  std::shared_ptr<Communicator> local_comm_;
  std::vector<bool> local_mask_, remote_mask_;
  uint64_t calls_ = 0;
  bool skip_remote_ = false;
};

const StaticTransportRegistration kRegistration("hierarchical_cpu", [](const TransportInit& init) {
  return std::make_shared<HostHierarchicalTransport>(init);
});

}  // namespace
}  // namespace fastcomms
