// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// The Ulysses layer's shared part: requests, the plan cache, the one set of call checks, the
// transport registry and the transport choice.
#include "fastcomms/ulysses/transport.hpp"

#include <algorithm>
#include <set>

#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/hierarchical.hpp"

namespace fastcomms {
namespace {

constexpr const char* kOp = "all_to_all_4d";

std::string call_prefix(int rank, int size, const std::string& name) {
  return detail::cat("[rank ", rank, "/", size, " ", name, "] ", kOp, ": ");
}

struct Registry {
  std::mutex mu;
  std::map<std::string, TransportFactory> factories;
  NvlinkProbe probe;
};

Registry& registry() {
  static Registry* r = new Registry;  // never destroyed: registrations run at static init
  return *r;
}

}  // namespace

plan::UlyssesRequest ulysses_request(const std::array<int64_t, 4>& shape, int64_t element_size,
                                     const UlyssesArgs& args, int rank, int size,
                                     const std::string& comm_name, plan::Path path) {
  return {.world_size = size,
          .rank = rank,
          .mode = args.mode,
          .shape = shape,
          .element_size = element_size,
          .seq_splits = args.seq_splits,
          .head_splits = args.head_splits,
          .kv_replicas = args.kv_replicas,
          .path = path,
          .op_name = kOp,
          .comm_name = comm_name};
}

plan::UlyssesRequest ulysses_request(const TensorView& x, const UlyssesArgs& args, int rank,
                                     int size, const std::string& comm_name, plan::Path path) {
  const std::string prefix = call_prefix(rank, size, comm_name);
  FASTCOMMS_CHECK(x.shape.size() == 4, kInvalidArgument, prefix, "x must be 4-D (b, s, h, d), got ",
                  x.describe());
  FASTCOMMS_CHECK(x.is_contiguous(), kInvalidArgument, prefix, "x must be contiguous, got ",
                  x.describe(), " with non-dense strides");
  return ulysses_request({x.shape[0], x.shape[1], x.shape[2], x.shape[3]},
                         static_cast<int64_t>(x.element_size()), args, rank, size, comm_name, path);
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
          req.seq_splits.has_value(),
          req.kv_replicas};
  std::lock_guard<std::mutex> lock(mu_);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  auto p = std::make_shared<const plan::UlyssesPlan>(plan::make_ulysses_plan(req));
  if (plans_.size() > 256) plans_.clear();  // bounded: shapes rarely vary that much
  plans_.emplace(std::move(key), p);
  return p;
}

void check_ulysses_out(const TensorView& x, const TensorView& out, const plan::UlyssesPlan& p,
                       const std::string& where) {
  FASTCOMMS_CHECK(out.dtype == x.dtype, kTypeError, where, "out has dtype ", dtype_name(out.dtype),
                  ", x has ", dtype_name(x.dtype));
  FASTCOMMS_CHECK(out.device == x.device, kInvalidArgument, where, "out is on ", out.device.str(),
                  ", x on ", x.device.str());
  FASTCOMMS_CHECK(out.is_contiguous(), kInvalidArgument, where, "out must be contiguous, got ",
                  out.describe());
  FASTCOMMS_CHECK(out.shape == std::vector<int64_t>(p.out_shape.begin(), p.out_shape.end()),
                  kInvalidArgument, where, "out has shape ", out.describe(), ", expected [",
                  p.out_shape[0], ", ", p.out_shape[1], ", ", p.out_shape[2], ", ", p.out_shape[3],
                  "]");
}

// -- UlyssesTransport --------------------------------------------------------------------------

UlyssesTransport::UlyssesTransport(int rank, int size, std::string name)
    : rank_(rank), size_(size), name_(std::move(name)) {
  FASTCOMMS_CHECK(size >= 1 && rank >= 0 && rank < size, kInvalidArgument, prefix(), "rank ", rank,
                  " is not in a group of ", size);
}

std::string UlyssesTransport::prefix() const { return call_prefix(rank_, size_, name_); }

std::array<int64_t, 4> UlyssesTransport::output_shape(const std::array<int64_t, 4>& shape,
                                                      int64_t element_size,
                                                      const UlyssesArgs& args) const {
  // Shapes follow the collective path's rules: the peer-to-peer path's alignment is a property
  // of the buffers, checked when a call runs.
  return plan::ulysses_output_shape(
      ulysses_request(shape, element_size, args, rank_, size_, name_, plan::Path::kCollective));
}

std::array<int64_t, 4> UlyssesTransport::output_shape(const TensorView& x,
                                                      const UlyssesArgs& args) const {
  return plan::ulysses_output_shape(
      ulysses_request(x, args, rank_, size_, name_, plan::Path::kCollective));
}

int64_t UlyssesTransport::max_out_bytes(const std::array<int64_t, 4>& shape, int64_t element_size,
                                        const UlyssesArgs& args) const {
  // Cached: the lent ring asks on every async call.
  return plans_
      .get(ulysses_request(shape, element_size, args, rank_, size_, name_, plan::Path::kCollective))
      ->max_out_bytes;
}

void UlyssesTransport::check_input(const TensorView&) const {}

WorkPtr UlyssesTransport::all_to_all_4d(const TensorView& x, const TensorView& out,
                                        const UlyssesArgs& args, void* stream) {
  const std::string where = prefix();
  const plan::UlyssesRequest req = ulysses_request(x, args, rank_, size_, name_, path());
  check_input(x);
  auto p = plan_for(req);
  check_ulysses_out(x, out, *p, where);
  return run(x, out, args, req, p, stream);
}

bool UlyssesTransport::all_to_all_4d_fp8(const TensorView&, const TensorView&, const TensorView*,
                                         const UlyssesArgs&, DType, void*) {
  return false;
}

std::shared_ptr<void> UlyssesTransport::empty_output(int64_t) { return nullptr; }

std::shared_ptr<UlyssesTransport> UlyssesTransport::async_lane() { return shared_from_this(); }

UlyssesMemoryStats UlyssesTransport::memory_stats() const { return {}; }

void UlyssesTransport::check_errors() {}

void UlyssesTransport::destroy() {}

void UlyssesTransport::tune(const std::string& knob, const std::string& value) {
  throw Error(ErrorCode::kInvalidArgument,
              detail::cat(prefix(), "the ", kind(), " transport has no knob '", knob, "' (value '",
                          value, "')"));
}

// -- registry ------------------------------------------------------------------------------------

void register_transport(const std::string& kind, TransportFactory factory) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.factories[kind] = std::move(factory);
}

bool has_transport(const std::string& kind) {
  if (kind == "collective") return true;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  return r.factories.count(kind) > 0;
}

UlyssesTransportPtr make_transport(const std::string& kind, const TransportInit& init) {
  if (kind == "collective") {
    FASTCOMMS_CHECK(init.comm != nullptr, kInvalidArgument, "[", init.name,
                    "] the collective Ulysses path needs a communicator");
    if (init.comm->device().type != DeviceType::kCUDA) return make_collective_transport(init.comm);
    return make_transport("cuda_collective", init);
  }
  if (kind == "hierarchical")
    return make_transport(
        init.device.type == DeviceType::kCUDA ? "hierarchical_nvlink" : "hierarchical_cpu", init);
  TransportFactory f;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    auto it = r.factories.find(kind);
    if (it != r.factories.end()) f = it->second;
  }
  FASTCOMMS_CHECK(f != nullptr, kUnsupported, "[rank ", init.rank, "/", init.size, " ", init.name,
                  "] all_to_all_4d: this build has no '", kind,
                  "' Ulysses transport (built without CUDA or NCCL)");
  return f(init);
}

void register_nvlink_probe(NvlinkProbe probe) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.probe = std::move(probe);
}

std::pair<std::optional<NvlinkMatrix>, std::string> nvlink_matrix(const std::vector<int>& devices) {
  NvlinkProbe probe;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    probe = r.probe;
  }
  if (!probe) return {std::nullopt, "this build has no CUDA layer"};
  return probe(devices);
}

std::pair<bool, std::string> nvlink_decision(const std::vector<std::string>& who,
                                             const NvlinkProbe& probe) {
  std::set<std::string> hosts;
  std::set<int> devices;
  for (const std::string& w : who) {
    const size_t bar = w.rfind('|');
    FASTCOMMS_CHECK(bar != std::string::npos && bar + 1 < w.size(), kInvalidArgument,
                    "nvlink_decision: malformed entry '", w, "' (expected host|device)");
    hosts.insert(w.substr(0, bar));
    size_t used = 0;
    int dev = -1;
    try {
      dev = std::stoi(w.substr(bar + 1), &used);
    } catch (const std::exception&) {
      used = 0;
    }
    FASTCOMMS_CHECK(used == w.size() - bar - 1 && dev >= 0, kInvalidArgument,
                    "nvlink_decision: malformed device in '", w, "'");
    devices.insert(dev);
  }
  if (hosts.size() != 1) return {false, detail::cat("the ranks span ", hosts.size(), " hosts")};
  const std::vector<int> devs(devices.begin(), devices.end());
  const auto list = [](const std::vector<int>& v) {
    std::string s = "[";
    for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return s + "]";
  };
  if (devs.size() == 1)
    return {true, detail::cat("all ", who.size(), " ranks share GPU ", devs[0], " of one host")};
  auto [matrix, why] =
      probe ? probe(devs)
            : std::make_pair(std::optional<NvlinkMatrix>{}, std::string("no NVML probe"));
  if (!matrix)
    return {false, detail::cat("NVML cannot say whether GPUs ", list(devs), " are NVLink-joined (",
                               why, ")")};
  std::string missing;
  for (size_t i = 0; i < devs.size(); ++i)
    for (size_t j = i + 1; j < devs.size(); ++j) {
      auto it = matrix->find({devs[i], devs[j]});
      if (it == matrix->end() || !it->second)
        missing += detail::cat(missing.empty() ? "" : ", ", "(", devs[i], ", ", devs[j], ")");
    }
  if (!missing.empty()) return {false, "GPU pairs [" + missing + "] are not NVLink-joined"};
  return {true, detail::cat("GPUs ", list(devs), " of one host, every pair NVLink-joined (NVML)")};
}

TransportChoice select_transport(const TransportInit& init_in, const std::string& transport,
                                 bool require_nvlink, std::optional<std::vector<std::string>> who) {
  TransportInit init = init_in;
  const std::string where =
      detail::cat("[rank ", init.rank, "/", init.size, " ", init.name, "] UlyssesGroup: ");
  FASTCOMMS_CHECK(transport == "auto" || transport == "nvlink" || transport == "hierarchical" ||
                      transport == "collective",
                  kInvalidArgument, where,
                  "transport must be auto, nvlink, hierarchical or collective, got '", transport,
                  "'");
  FASTCOMMS_CHECK(!(require_nvlink && (transport == "collective" || transport == "hierarchical")),
                  kInvalidArgument, where, "require_nvlink=True contradicts transport='", transport,
                  "'");
  const auto collective = [&](std::string why) {
    TransportChoice c;
    c.kind = init.device.type == DeviceType::kCUDA ? "cuda_collective" : "collective";
    c.reason = std::move(why);
    if (init.comm) c.transport = make_transport("collective", init);
    return c;
  };
  if (transport == "collective") return collective("transport='collective' was asked");
  const bool hierarchical_asked = transport == "hierarchical";
  const auto refuse_or = [&](const std::string& why) {
    FASTCOMMS_CHECK(transport != "nvlink" && !require_nvlink, kUnsupported, where,
                    "the NVLink transport is not available: ", why);
    FASTCOMMS_CHECK(!hierarchical_asked, kUnsupported, where,
                    "the hierarchical transport is not available: ", why);
    return collective(why);
  };
  // A communicator whose backend owns an engine lends it (no second set of windows).
  if (init.comm && !hierarchical_asked) {
    if (auto lent = init.comm->lend(kLentUlyssesTransport)) {
      TransportChoice c;
      c.transport = std::static_pointer_cast<UlyssesTransport>(lent);
      c.kind = c.transport->kind();
      c.reason = "the communicator's " + init.comm->backend_name() + " backend lends its engine";
      return c;
    }
  }
  const bool cuda = init.device.type == DeviceType::kCUDA;
  if (!cuda && !hierarchical_asked)
    return refuse_or(
        detail::cat("the group's device is ", init.device.str(), ", not a CUDA device"));
  if (cuda && !has_transport("nvlink")) return refuse_or("this build has no CUDA layer");
  const auto gather = [&](const std::string& mine, const std::string& tag) {
    if (init.gather) return init.gather(mine);
    FASTCOMMS_CHECK(init.store != nullptr, kInvalidArgument, where,
                    "a store is needed to agree on the transport");
    const std::string key = detail::cat(init.name, "/", tag, "/");
    init.store->set_string(key + std::to_string(init.rank), mine);
    std::vector<std::string> all;
    for (int q = 0; q < init.size; ++q) {
      const auto v = init.store->get(key + std::to_string(q), init.timeout);
      all.emplace_back(v.begin(), v.end());
    }
    return all;
  };
  if (!who) who = gather(detail::cat(host_name(), "|", cuda ? init.device.index : 0), "who");
  const auto probe = [](const std::vector<int>& d) { return nvlink_matrix(d); };
  std::vector<std::string> hosts;
  for (const std::string& w : *who) hosts.push_back(w.substr(0, w.rfind('|')));
  const HostMap map = host_map(hosts, init.rank);
  if (map.hosts == 1) {
    if (hierarchical_asked)
      return refuse_or(detail::cat("the ", init.size,
                                   " ranks are on one host (use 'nvlink' or "
                                   "'auto' there)"));
    auto [ok, why] = nvlink_decision(*who, probe);
    if (!ok) return refuse_or(why);
    TransportChoice c;
    c.transport = make_transport("nvlink", init);
    c.kind = "nvlink";
    c.reason = why;
    return c;
  }
  // NOTE [hierarchical choice]: several hosts. NVLink alone cannot serve the group; the
  // hierarchical path can where some host holds two ranks or more and every host's ranks are
  // NVLink-joined. Only the ranks of a host can ask NVML about its GPUs, so each host's verdict
  // is gathered and every rank decides from the same list.
  const std::string span = detail::cat("the ranks span ", map.hosts, " hosts");
  if (transport == "nvlink" || require_nvlink) return refuse_or(span);
  if (map.max_per_host < 2)
    return refuse_or(span + ", one rank on each: nothing moves inside a host");
  if (cuda) {
    std::vector<std::string> mine;
    for (const int q : map.members) mine.push_back((*who)[q]);
    const auto [ok, why] = nvlink_decision(mine, probe);
    const auto verdicts = gather(ok ? std::string("1") : "0" + why, "hosts");
    for (int q = 0; q < init.size; ++q)
      if (verdicts[q].empty() || verdicts[q][0] != '1')
        return refuse_or(detail::cat(span, "; on the host of rank ", q, ": ",
                                     verdicts[q].empty() ? "?" : verdicts[q].substr(1)));
  }
  init.host_of = map.host_of;
  TransportChoice c;
  c.transport = make_transport("hierarchical", init);
  c.kind = "hierarchical";
  c.reason = detail::cat(span, " (", map.max_per_host, " ranks on the largest)",
                         cuda ? ", each host's ranks NVLink-joined: NVLink inside a host, "
                              : ": a split of the communicator inside a host, ",
                         init.comm ? init.comm->backend_name() : std::string("the process group"),
                         " between hosts");
  return c;
}

}  // namespace fastcomms
