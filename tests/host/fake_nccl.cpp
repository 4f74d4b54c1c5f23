// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#include "fake_nccl.hpp"

#include "fastcomms/core/half.hpp"

#include <algorithm>
#include <cstring>
#include <deque>
#include <optional>
#include <sstream>
#include <utility>

namespace fastcomms::test {

enum class Kind { kAllReduce, kBroadcast, kReduce, kAllGather, kReduceScatter, kSend, kRecv };

// One launch on a stream: one call, or every call of one group.
struct FakeNccl::Launch {
  int device = -1;
  const Comm* comm = nullptr;
  int parts_left = 0;
  bool held = false;     // hold(): complete only after release()
  bool aborted = false;  // its communicator was aborted: complete, the bytes never moved
};

struct FakeNccl::Stream {
  int device = -1;
  bool destroyed = false;
  bool legacy = false;  // a device's default stream (the null handle): never destroyed
  std::vector<std::shared_ptr<Launch>> deps;  // launches not yet known complete
};

struct FakeNccl::Event {
  int device = -1;
  bool destroyed = false;
  std::vector<std::shared_ptr<Launch>> deps;  // what it waits for, as of its last record
};

// One call of a launch.
struct FakeNccl::Part {
  Kind kind = Kind::kAllReduce;
  const char* name = "";
  Comm* comm = nullptr;
  Stream* stream = nullptr;
  const void* send = nullptr;
  void* recv = nullptr;
  size_t count = 0;
  ncclDataType_t dt = ncclUint8;
  ncclRedOp_t op = ncclSum;
  double factor = 1.0;  // a PREMUL_SUM op's, read at the call (the op may be destroyed after it)
  // a PREMUL_SUM op's device scalar (ncclScalarDevice): read when the collective runs, as NCCL's
  // kernel reads it, so a test can tell a value read at the call from one read on the device
  const void* factor_ptr = nullptr;
  ncclDataType_t factor_dt = ncclFloat32;
  int peer = 0;  // the root of rooted collectives, the peer of a send or receive
  std::shared_ptr<Launch> launch;
};

struct FakeNccl::Comm {
  std::shared_ptr<World> world;
  int rank = 0, size = 1, device = -1;
  bool aborted = false, destroyed = false;
  uint64_t coll_seq = 0, split_seq = 0;
  int next_op = ncclNumOps;
  struct Premul {
    double factor = 1.0;           // a host scalar's value
    const void* device = nullptr;  // or a device scalar's address
    ncclDataType_t dt = ncclFloat32;
  };
  std::map<int, Premul> premul;  // PREMUL_SUM ops and their factors
  std::set<void*> registrations;
};

// The ranks of one communicator (one unique id, or one colour of one split).
struct FakeNccl::World {
  struct SplitRound {
    std::map<int, std::pair<int, int>> entries;  // parent rank -> (colour, key)
    std::vector<Comm*> result;
    bool done = false;
  };
  int size = 0;
  int joined = 0;
  std::vector<Comm*> ranks;
  std::map<uint64_t, std::vector<std::optional<Part>>> colls;  // by each rank's call order
  std::map<std::pair<int, int>, std::pair<std::deque<Part>, std::deque<Part>>> channels;
  std::map<uint64_t, SplitRound> splits;
};

namespace {

// NCCL's group state is the calling thread's; so is the current device.
// As in NCCL, a call that fails inside a group fails the group: ncclGroupEnd issues none of its
// calls and returns that error.
struct ThreadGroup {
  int depth = 0;
  ncclResult_t error = ncclSuccess;
  std::vector<FakeNccl::Part> parts;
};
thread_local ThreadGroup t_group;
thread_local int t_device = 0;
thread_local cudaStreamCaptureMode t_capture_mode = cudaStreamCaptureModeGlobal;

size_t type_size(ncclDataType_t dt) {
  switch (dt) {
    case ncclInt8:
    case ncclUint8:
    case ncclFloat8e4m3:
    case ncclFloat8e5m2:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      return 0;
  }
}

template <typename T>
void reduce_typed(const std::vector<const void*>& in, const std::vector<double>& factors,
                  ncclRedOp_t op, size_t n, char* out) {
  T* o = reinterpret_cast<T*>(out);
  const bool premul = op >= ncclNumOps;
  for (size_t i = 0; i < n; ++i) {
    T acc{};
    for (size_t r = 0; r < in.size(); ++r) {
      T x = static_cast<const T*>(in[r])[i];
      if (premul) x = static_cast<T>(static_cast<double>(x) * factors[r]);
      if (r == 0) {
        acc = x;
      } else if (op == ncclProd) {
        acc = static_cast<T>(acc * x);
      } else if (op == ncclMin) {
        acc = std::min(acc, x);
      } else if (op == ncclMax) {
        acc = std::max(acc, x);
      } else {  // sum, avg, premul sum
        acc = static_cast<T>(acc + x);
      }
    }
    if (op == ncclAvg) acc = static_cast<T>(acc / static_cast<T>(in.size()));
    o[i] = acc;
  }
}

// Half types as NCCL's kernels compute them: each input times the factor (both in the type) and
// each step of the reduction rounded to the type (a product or sum of two half values, computed in
// double, is rounded once). AVG: the sum, divided.
template <float (*Load)(uint16_t), uint16_t (*Store)(float)>
void reduce_half(const std::vector<const void*>& in, const std::vector<double>& factors,
                 ncclRedOp_t op, size_t n, char* out) {
  auto* o = reinterpret_cast<uint16_t*>(out);
  const bool premul = op >= ncclNumOps;
  const auto round = [](double v) {
    return static_cast<double>(Load(Store(static_cast<float>(v))));
  };
  for (size_t i = 0; i < n; ++i) {
    double acc = 0;
    for (size_t r = 0; r < in.size(); ++r) {
      double x = Load(static_cast<const uint16_t*>(in[r])[i]);
      if (premul) x = round(x * round(factors[r]));
      if (r == 0)
        acc = x;
      else if (op == ncclProd)
        acc = round(acc * x);
      else if (op == ncclMin)
        acc = std::min(acc, x);
      else if (op == ncclMax)
        acc = std::max(acc, x);
      else
        acc = round(acc + x);
    }
    if (op == ncclAvg) acc = round(acc / static_cast<double>(in.size()));
    o[i] = Store(static_cast<float>(acc));
  }
}

// One scalar of a PREMUL_SUM type (the bytes NCCL reads for it), as a double.
double read_scalar(const void* p, ncclDataType_t dt) {
  switch (dt) {
    case ncclFloat16:
      return fastcomms::half_to_float(*static_cast<const uint16_t*>(p));
    case ncclBfloat16:
      return fastcomms::bf16_to_float(*static_cast<const uint16_t*>(p));
    case ncclFloat32:
      return *static_cast<const float*>(p);
    default:
      return *static_cast<const double*>(p);
  }
}

// Reduces n elements of every input into out; false for a type the fake does not reduce.
bool reduce_all(ncclDataType_t dt, const std::vector<const void*>& in,
                const std::vector<double>& factors, ncclRedOp_t op, size_t n, char* out) {
  switch (dt) {
    case ncclInt8:
      return reduce_typed<int8_t>(in, factors, op, n, out), true;
    case ncclUint8:
      return reduce_typed<uint8_t>(in, factors, op, n, out), true;
    case ncclInt32:
      return reduce_typed<int32_t>(in, factors, op, n, out), true;
    case ncclInt64:
      return reduce_typed<int64_t>(in, factors, op, n, out), true;
    case ncclFloat32:
      return reduce_typed<float>(in, factors, op, n, out), true;
    case ncclFloat64:
      return reduce_typed<double>(in, factors, op, n, out), true;
    case ncclFloat16:
      return reduce_half<fastcomms::half_to_float, fastcomms::float_to_half>(in, factors, op, n,
                                                                             out),
             true;
    case ncclBfloat16:
      return reduce_half<fastcomms::bf16_to_float, fastcomms::float_to_bf16>(in, factors, op, n,
                                                                             out),
             true;
    default:
      return false;
  }
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::kAllReduce:
      return "ncclAllReduce";
    case Kind::kBroadcast:
      return "ncclBroadcast";
    case Kind::kReduce:
      return "ncclReduce";
    case Kind::kAllGather:
      return "ncclAllGather";
    case Kind::kReduceScatter:
      return "ncclReduceScatter";
    case Kind::kSend:
      return "ncclSend";
    case Kind::kRecv:
      return "ncclRecv";
  }
  return "?";
}

// A call the fake refuses: inside a group it fails the group too.
ncclResult_t refuse(ncclResult_t r) {
  if (t_group.depth > 0) t_group.error = r;
  return r;
}

template <typename T>
const void* handle_key(T h) {
  return reinterpret_cast<const void*>(h);
}

}  // namespace

FakeNccl::FakeNccl() = default;
FakeNccl::~FakeNccl() = default;

// ---- control ---------------------------------------------------------------------------------

void FakeNccl::fail(const std::string& call, ncclResult_t result, int device, int times) {
  std::lock_guard<std::mutex> lock(mu_);
  nccl_failures_.push_back({call, result, device, times});
}

void FakeNccl::fail_cuda(const std::string& call, cudaError_t error, int device, int times) {
  std::lock_guard<std::mutex> lock(mu_);
  cuda_failures_.push_back({call, error, device, times});
}

void FakeNccl::set_async_error(int device, ncclResult_t result) {
  std::lock_guard<std::mutex> lock(mu_);
  async_errors_[device] = result;
}

void FakeNccl::set_last_error(const std::string& text) {
  std::lock_guard<std::mutex> lock(mu_);
  last_error_ = text;
}

void FakeNccl::hold(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  held_.insert(device);
}

void FakeNccl::release(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  held_.erase(device);
  for (auto& l : launches_)
    if (l->device == device) l->held = false;
  cv_.notify_all();
  progress();
}

void FakeNccl::set_wait_limit(std::chrono::milliseconds limit) {
  std::lock_guard<std::mutex> lock(mu_);
  wait_limit_ = limit;
}

std::vector<FakeNccl::Call> FakeNccl::calls(int device) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<Call> out;
  for (const Call& c : calls_)
    if (device < 0 || c.device == device) out.push_back(c);
  return out;
}

int FakeNccl::count(const std::string& name, int device) const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(std::count_if(calls_.begin(), calls_.end(), [&](const Call& c) {
    return c.name == name && (device < 0 || c.device == device);
  }));
}

std::vector<FakeNccl::Split> FakeNccl::splits() const {
  std::lock_guard<std::mutex> lock(mu_);
  return splits_;
}

std::vector<FakeNccl::ConfigSeen> FakeNccl::configs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return configs_;
}

void FakeNccl::record_config(const char* call, int device, const ncclConfig_t* config) {
  ConfigSeen seen;
  seen.call = call;
  seen.device = device;
  seen.given = config != nullptr;
  if (config != nullptr) {
    // NCCL reads a config's strings during the call only: copied now, as NCCL would use them.
    seen.config = *config;
    seen.has_comm_name = config->commName != nullptr;
    seen.has_net_name = config->netName != nullptr;
    if (seen.has_comm_name) seen.comm_name = config->commName;
    if (seen.has_net_name) seen.net_name = config->netName;
    seen.config.commName = nullptr;
    seen.config.netName = nullptr;
    if (config->size != sizeof(ncclConfig_t) || config->magic != 0xcafebeef)
      violation(std::string(call) + ": a config not made from NCCL_CONFIG_INITIALIZER");
  }
  configs_.push_back(std::move(seen));
}

std::vector<std::string> FakeNccl::violations() const {
  std::lock_guard<std::mutex> lock(mu_);
  return violations_;
}

FakeNccl::Live FakeNccl::live() const {
  std::lock_guard<std::mutex> lock(mu_);
  Live l;
  for (const auto& c : comms_) l.comms += !c->aborted && !c->destroyed;
  for (const auto& [h, s] : streams_) l.streams += !s->destroyed && !s->legacy;
  for (const auto& [h, e] : events_) l.events += !e->destroyed;
  l.buffers = static_cast<int>(buffers_.size());
  l.host_buffers = static_cast<int>(host_buffers_.size());
  return l;
}

int FakeNccl::group_depth() { return t_group.depth; }

// ---- helpers (mu_ held) ----------------------------------------------------------------------

void FakeNccl::violation(std::string what) { violations_.push_back(std::move(what)); }

void FakeNccl::record(const char* name, int device, const void* comm, const void* stream,
                      const void* event) {
  calls_.push_back(
      Call{name, device, comm, stream, event, t_group.depth > 0, std::this_thread::get_id()});
}

bool FakeNccl::take_failure(const char* call, int device, ncclResult_t* result) {
  for (auto& f : nccl_failures_)
    if (f.left > 0 && f.call == call && (f.device < 0 || f.device == device)) {
      --f.left;
      *result = f.result;
      if (t_group.depth > 0) t_group.error = f.result;
      return true;
    }
  return false;
}

bool FakeNccl::take_failure(const char* call, int device, cudaError_t* error) {
  for (auto& f : cuda_failures_)
    if (f.left > 0 && f.call == call && (f.device < 0 || f.device == device)) {
      --f.left;
      *error = f.error;
      return true;
    }
  return false;
}

FakeNccl::Comm* FakeNccl::comm_of(ncclComm_t comm, const char* call) {
  Comm* c = nullptr;
  for (const auto& p : comms_)
    if (handle_key(comm) == p.get()) c = p.get();
  if (c == nullptr) {
    violation(std::string(call) + " on a communicator NCCL never made");
    return nullptr;
  }
  if (c->aborted || c->destroyed) {
    std::ostringstream os;
    os << call << " on device " << c->device << " on a communicator after "
       << (c->aborted ? "ncclCommAbort" : "ncclCommDestroy");
    violation(os.str());
    return nullptr;
  }
  return c;
}

FakeNccl::Stream* FakeNccl::stream_of(cudaStream_t stream, const char* call) {
  if (stream == nullptr) {  // the legacy default stream of the current device
    Stream*& s = default_streams_[t_device];
    if (s == nullptr) {
      auto owned = std::make_unique<Stream>();
      owned->device = t_device;
      owned->legacy = true;
      s = owned.get();
      streams_[s] = std::move(owned);
    }
    return s;
  }
  auto it = streams_.find(handle_key(stream));
  if (it == streams_.end() || it->second->destroyed) {
    violation(std::string(call) +
              (it == streams_.end() ? " on an unknown stream" : " on a destroyed stream"));
    return nullptr;
  }
  return it->second.get();
}

FakeNccl::Event* FakeNccl::event_of(cudaEvent_t event, const char* call) {
  auto it = events_.find(handle_key(event));
  if (it == events_.end() || it->second->destroyed) {
    violation(std::string(call) +
              (it == events_.end() ? " on an unknown event" : " on a destroyed event"));
    return nullptr;
  }
  return it->second.get();
}

bool FakeNccl::done(const Launch& l) const { return l.aborted || (l.parts_left == 0 && !l.held); }

template <typename Pred>
bool FakeNccl::wait_for(std::unique_lock<std::mutex>& lock, Pred pred, const std::string& what) {
  if (cv_.wait_for(lock, wait_limit_, pred)) return true;
  violation(what + " waited longer than the fake's limit (a hang on a GPU)");
  return false;
}

void FakeNccl::finish(Launch& launch) {
  --launch.parts_left;
  cv_.notify_all();
  progress();
}

void FakeNccl::progress() {
  for (bool ran = true; ran;) {
    ran = false;
    for (auto it = copies_.begin(); it != copies_.end();) {
      if (!std::all_of(it->deps.begin(), it->deps.end(), [&](const auto& l) { return done(*l); })) {
        ++it;
        continue;
      }
      if (it->bytes > 0) std::memmove(it->dst, it->src, it->bytes);
      it->launch->parts_left = 0;
      it = copies_.erase(it);
      ran = true;
      cv_.notify_all();
    }
  }
}

const FakeNccl::HostAlloc* FakeNccl::host_alloc_of(const void* p) const {
  const char* c = static_cast<const char*>(p);
  auto it = host_buffers_.upper_bound(c);
  if (it == host_buffers_.begin()) return nullptr;
  --it;
  return c < it->first + it->second.size ? &it->second : nullptr;
}

void FakeNccl::check_nccl_buffer(const void* p, const char* call, const char* what) {
  const HostAlloc* h = host_alloc_of(p);
  if (h != nullptr && !(h->flags & cudaHostAllocMapped))
    violation(std::string(call) + ": the " + what +
              " is pinned host memory that is not mapped into the device's address space");
}

ncclResult_t FakeNccl::enqueue(Part part, Stream* stream) {
  if (t_group.depth > 0) {
    t_group.parts.push_back(std::move(part));
    return ncclSuccess;
  }
  auto launch = std::make_shared<Launch>();
  launch->device = stream->device;
  launch->comm = part.comm;
  launch->parts_left = 1;
  launch->held = held_.count(stream->device) > 0;
  launches_.push_back(launch);
  stream->deps.push_back(launch);
  submit(launch, part);
  return ncclSuccess;
}

void FakeNccl::submit(const std::shared_ptr<Launch>& launch, Part& part) {
  part.launch = launch;
  World& w = *part.comm->world;
  const int rank = part.comm->rank;
  if (part.kind == Kind::kSend || part.kind == Kind::kRecv) {
    const auto key = part.kind == Kind::kSend ? std::make_pair(rank, part.peer)
                                              : std::make_pair(part.peer, rank);
    auto& [sends, recvs] = w.channels[key];
    (part.kind == Kind::kSend ? sends : recvs).push_back(part);
    while (!sends.empty() && !recvs.empty()) {
      Part s = std::move(sends.front()), r = std::move(recvs.front());
      sends.pop_front();
      recvs.pop_front();
      const size_t sb = s.count * type_size(s.dt), rb = r.count * type_size(r.dt);
      if (sb != rb) {
        std::ostringstream os;
        os << "ncclSend of " << sb << " bytes from rank " << key.first << " matched ncclRecv of "
           << rb << " bytes on rank " << key.second;
        violation(os.str());
      }
      if (!s.comm->aborted && !r.comm->aborted && sb > 0)
        std::memmove(r.recv, s.send, std::min(sb, rb));
      finish(*s.launch);
      finish(*r.launch);
    }
    return;
  }
  const uint64_t seq = part.comm->coll_seq++;
  auto& slot = w.colls[seq];
  if (slot.empty()) slot.resize(static_cast<size_t>(w.size));
  slot[static_cast<size_t>(rank)] = part;
  if (std::all_of(slot.begin(), slot.end(), [](const auto& p) { return p.has_value(); }))
    run_collective(w, seq);
}

void FakeNccl::run_collective(World& w, uint64_t seq) {
  std::vector<Part> parts;
  for (auto& p : w.colls[seq]) parts.push_back(std::move(*p));
  w.colls.erase(seq);
  const Part& p0 = parts[0];
  bool agree = true, aborted = false, same_kind = true, same_bytes = true, known = true;
  for (const Part& p : parts) {
    agree &= p.kind == p0.kind && p.count == p0.count && p.dt == p0.dt &&
             (p.op >= ncclNumOps) == (p0.op >= ncclNumOps) &&
             (p.op >= ncclNumOps || p.op == p0.op) &&
             (p.kind != Kind::kBroadcast && p.kind != Kind::kReduce ? true : p.peer == p0.peer);
    same_kind &= p.kind == p0.kind;
    same_bytes &= p.count * type_size(p.dt) == p0.count * type_size(p0.dt);
    known &= type_size(p.dt) != 0;
    aborted |= p.comm->aborted;
  }
  if (!agree) {
    std::ostringstream os;
    os << "mismatched collective #" << seq << ":";
    for (const Part& p : parts)
      os << " rank " << p.comm->rank << " " << kind_name(p.kind) << "(count " << p.count
         << ", type " << p.dt << ", op " << p.op << ", root " << p.peer << ")";
    violation(os.str());
    // Kinds or byte counts that differ: NCCL's kernels wait for bytes that never come (or read
    // past a buffer). The launches stay in flight until their communicator is aborted.
    if (!same_kind || !same_bytes) return;
  }
  const size_t P = parts.size();
  if (!known) {
    violation(std::string(kind_name(p0.kind)) + " of a type the fake does not know");
  } else if (!aborted) {
    // Each rank's kernel runs its own call over everyone's bytes (the same call on every rank
    // where they agree). Every output is computed before any is written (in-place calls).
    std::vector<const void*> in;
    std::vector<double> factors;
    for (const Part& p : parts) {
      in.push_back(p.send);
      factors.push_back(p.factor_ptr != nullptr ? read_scalar(p.factor_ptr, p.factor_dt)
                                                : p.factor);
    }
    std::vector<std::vector<char>> outs(P);
    std::vector<bool> writes(P, true);
    for (size_t r = 0; r < P; ++r) {
      const Part& v = parts[r];
      const size_t es = type_size(v.dt), n = v.count;
      std::vector<char>& out = outs[r];
      switch (v.kind) {
        case Kind::kBroadcast: {
          const auto* src = static_cast<const char*>(parts[static_cast<size_t>(v.peer)].send);
          out.assign(src, src + n * es);
          break;
        }
        case Kind::kAllGather:
          out.resize(P * n * es);
          for (size_t q = 0; q < P; ++q) std::memcpy(out.data() + q * n * es, in[q], n * es);
          break;
        case Kind::kAllReduce:
        case Kind::kReduce:
        case Kind::kReduceScatter: {
          const size_t total = v.kind == Kind::kReduceScatter ? n * P : n;
          std::vector<char> all(total * es);
          if (!reduce_all(v.dt, in, factors, v.op, total, all.data())) {
            violation(std::string(kind_name(v.kind)) + " of a type the fake does not reduce");
            writes[r] = false;
            break;
          }
          if (v.kind == Kind::kReduceScatter)
            out.assign(all.begin() + static_cast<std::ptrdiff_t>(r * n * es),
                       all.begin() + static_cast<std::ptrdiff_t>((r + 1) * n * es));
          else
            out = std::move(all);
          writes[r] = v.kind != Kind::kReduce || static_cast<int>(r) == v.peer;
          break;
        }
        default:
          writes[r] = false;
          break;
      }
    }
    for (size_t r = 0; r < P; ++r)
      if (writes[r] && !outs[r].empty()) std::memcpy(parts[r].recv, outs[r].data(), outs[r].size());
  }
  for (Part& p : parts) finish(*p.launch);
}

// ---- NCCL ------------------------------------------------------------------------------------

ncclResult_t FakeNccl::get_version(int* version) {
  std::lock_guard<std::mutex> lock(mu_);
  record("ncclGetVersion", t_device, nullptr, nullptr, nullptr);
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

const char* FakeNccl::get_error_string(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error (fake)";
    case ncclUnhandledCudaError:
      return "unhandled cuda error (fake)";
    case ncclSystemError:
      return "unhandled system error (fake)";
    case ncclInternalError:
      return "internal error (fake)";
    case ncclInvalidArgument:
      return "invalid argument (fake)";
    case ncclInvalidUsage:
      return "invalid usage (fake)";
    case ncclRemoteError:
      return "remote process exited or there was a network error (fake)";
    case ncclInProgress:
      return "NCCL operation in progress (fake)";
    default:
      return "unknown result code (fake)";
  }
}

const char* FakeNccl::get_last_error(ncclComm_t) {
  std::lock_guard<std::mutex> lock(mu_);
  return last_error_.c_str();  // set before the calls that read it, never during
}

ncclResult_t FakeNccl::get_unique_id(ncclUniqueId* id) {
  std::lock_guard<std::mutex> lock(mu_);
  record("ncclGetUniqueId", t_device, nullptr, nullptr, nullptr);
  ncclResult_t r;
  if (take_failure("ncclGetUniqueId", t_device, &r)) return r;
  std::memset(id, 0, sizeof *id);
  const std::string text = "fake-nccl-id-" + std::to_string(next_id_++);
  std::memcpy(id->internal, text.data(), text.size());
  return ncclSuccess;
}

ncclResult_t FakeNccl::comm_init_rank_config(ncclComm_t* comm, int nranks, ncclUniqueId id,
                                             int rank, ncclConfig_t* config) {
  std::unique_lock<std::mutex> lock(mu_);
  record("ncclCommInitRankConfig", t_device, nullptr, nullptr, nullptr);
  record_config("ncclCommInitRankConfig", t_device, config);
  ncclResult_t r;
  if (take_failure("ncclCommInitRankConfig", t_device, &r)) return r;
  std::shared_ptr<World>& slot = by_id_[std::string(id.internal, sizeof id.internal)];
  if (!slot) {
    slot = std::make_shared<World>();
    slot->size = nranks;
    slot->ranks.assign(static_cast<size_t>(nranks), nullptr);
  }
  const std::shared_ptr<World> w = slot;
  if (w->size != nranks || rank < 0 || rank >= nranks || w->ranks[static_cast<size_t>(rank)]) {
    violation("ncclCommInitRankConfig: rank " + std::to_string(rank) + " of " +
              std::to_string(nranks) + " does not fit the id's communicator");
    return ncclInvalidArgument;
  }
  auto owned = std::make_unique<Comm>();
  Comm* c = owned.get();
  c->world = w;
  c->rank = rank;
  c->size = nranks;
  c->device = t_device;
  comms_.push_back(std::move(owned));
  w->ranks[static_cast<size_t>(rank)] = c;
  ++w->joined;
  cv_.notify_all();
  if (!wait_for(
          lock, [&] { return w->joined == w->size; }, "ncclCommInitRankConfig"))
    return ncclSystemError;
  *comm = reinterpret_cast<ncclComm_t>(c);
  return ncclSuccess;
}

ncclResult_t FakeNccl::comm_split(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                                  ncclConfig_t* config) {
  std::unique_lock<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "ncclCommSplit");
  record("ncclCommSplit", c ? c->device : t_device, comm, nullptr, nullptr);
  record_config("ncclCommSplit", c ? c->device : t_device, config);
  if (c == nullptr) return ncclInvalidArgument;
  ncclResult_t r;
  if (take_failure("ncclCommSplit", c->device, &r)) return r;
  if (t_group.depth > 0) violation("ncclCommSplit inside a group");
  const std::shared_ptr<World> w = c->world;
  World::SplitRound& round = w->splits[c->split_seq++];
  round.entries[c->rank] = {color, key};
  if (static_cast<int>(round.entries.size()) == w->size) {
    round.result.assign(static_cast<size_t>(w->size), nullptr);
    std::map<int, std::vector<std::pair<int, int>>> groups;  // colour -> (key, parent rank)
    for (const auto& [pr, ck] : round.entries)
      if (ck.first != NCCL_SPLIT_NOCOLOR) groups[ck.first].push_back({ck.second, pr});
    for (auto& [col, members] : groups) {
      std::sort(members.begin(), members.end());
      auto nw = std::make_shared<World>();
      nw->size = static_cast<int>(members.size());
      nw->joined = nw->size;
      for (size_t i = 0; i < members.size(); ++i) {
        auto owned = std::make_unique<Comm>();
        owned->world = nw;
        owned->rank = static_cast<int>(i);
        owned->size = nw->size;
        owned->device = w->ranks[static_cast<size_t>(members[i].second)]->device;
        nw->ranks.push_back(owned.get());
        round.result[static_cast<size_t>(members[i].second)] = owned.get();
        comms_.push_back(std::move(owned));
      }
    }
    round.done = true;
    cv_.notify_all();
  } else if (!wait_for(
                 lock, [&] { return round.done; }, "ncclCommSplit")) {
    return ncclSystemError;
  }
  Comm* mine = round.result[static_cast<size_t>(c->rank)];
  *newcomm = reinterpret_cast<ncclComm_t>(mine);
  splits_.push_back(Split{c->device, c->rank, c->size, color, key, mine ? mine->rank : -1,
                          mine ? mine->size : -1});
  return ncclSuccess;
}

ncclResult_t FakeNccl::comm_abort(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "ncclCommAbort");
  record("ncclCommAbort", c ? c->device : t_device, comm, nullptr, nullptr);
  if (c == nullptr) return ncclInvalidArgument;
  ncclResult_t r;
  if (take_failure("ncclCommAbort", c->device, &r)) return r;
  c->aborted = true;  // ends its kernels: every launch of it completes, its bytes unmoved
  for (auto& l : launches_)
    if (l->comm == c) l->aborted = true;
  cv_.notify_all();
  progress();
  return ncclSuccess;
}

ncclResult_t FakeNccl::comm_destroy(ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "ncclCommDestroy");
  record("ncclCommDestroy", c ? c->device : t_device, comm, nullptr, nullptr);
  if (c == nullptr) return ncclInvalidArgument;
  ncclResult_t r;
  if (take_failure("ncclCommDestroy", c->device, &r)) return r;
  if (!c->registrations.empty())
    violation("ncclCommDestroy on device " + std::to_string(c->device) + " with " +
              std::to_string(c->registrations.size()) + " registrations left");
  for (const auto& l : launches_)
    if (l->comm == c && !done(*l))
      violation("ncclCommDestroy on device " + std::to_string(c->device) +
                " with a launch in flight");
  c->destroyed = true;
  return ncclSuccess;
}

ncclResult_t FakeNccl::comm_get_async_error(ncclComm_t comm, ncclResult_t* async_error) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "ncclCommGetAsyncError");
  record("ncclCommGetAsyncError", c ? c->device : t_device, comm, nullptr, nullptr);
  if (c == nullptr) return ncclInvalidArgument;
  ncclResult_t r;
  if (take_failure("ncclCommGetAsyncError", c->device, &r)) return r;
  const auto it = async_errors_.find(c->device);
  *async_error = it == async_errors_.end() ? ncclSuccess : it->second;
  return ncclSuccess;
}

ncclResult_t FakeNccl::comm_register(ncclComm_t comm, void* buff, size_t size, void** handle) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "ncclCommRegister");
  record("ncclCommRegister", c ? c->device : t_device, comm, nullptr, nullptr);
  if (c == nullptr) return ncclInvalidArgument;
  ncclResult_t r;
  if (take_failure("ncclCommRegister", c->device, &r)) return r;
  if (buff == nullptr || size == 0) return ncclInvalidArgument;
  *handle = reinterpret_cast<void*>(static_cast<uintptr_t>(next_id_++));
  c->registrations.insert(*handle);
  return ncclSuccess;
}

ncclResult_t FakeNccl::comm_deregister(ncclComm_t comm, void* handle) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "ncclCommDeregister");
  record("ncclCommDeregister", c ? c->device : t_device, comm, nullptr, nullptr);
  if (c == nullptr) return ncclInvalidArgument;
  ncclResult_t r;
  if (take_failure("ncclCommDeregister", c->device, &r)) return r;
  if (!c->registrations.erase(handle)) {
    violation("ncclCommDeregister of a handle the communicator never gave");
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t FakeNccl::red_op_create_pre_mul_sum(ncclRedOp_t* op, void* scalar,
                                                 ncclDataType_t datatype,
                                                 ncclScalarResidence_t residence, ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "ncclRedOpCreatePreMulSum");
  record("ncclRedOpCreatePreMulSum", c ? c->device : t_device, comm, nullptr, nullptr);
  if (c == nullptr) return ncclInvalidArgument;
  ncclResult_t r;
  if (take_failure("ncclRedOpCreatePreMulSum", c->device, &r)) return r;
  Comm::Premul pm;
  pm.dt = datatype;
  if (datatype != ncclFloat16 && datatype != ncclBfloat16 && datatype != ncclFloat32 &&
      datatype != ncclFloat64) {
    violation("ncclRedOpCreatePreMulSum: a scalar of a type NCCL has no PREMUL_SUM for");
    return ncclInvalidArgument;
  }
  if (residence == ncclScalarDevice) {
    check_nccl_buffer(scalar, "ncclRedOpCreatePreMulSum", "device scalar");
    pm.device = scalar;  // read when the collective runs
  } else {
    pm.factor = read_scalar(scalar, datatype);  // NCCL copies a host scalar at this call
  }
  *op = static_cast<ncclRedOp_t>(c->next_op++);
  c->premul[*op] = pm;
  return ncclSuccess;
}

ncclResult_t FakeNccl::red_op_destroy(ncclRedOp_t op, ncclComm_t comm) {
  std::lock_guard<std::mutex> lock(mu_);
  Comm* c = comm_of(comm, "ncclRedOpDestroy");
  record("ncclRedOpDestroy", c ? c->device : t_device, comm, nullptr, nullptr);
  if (c == nullptr) return ncclInvalidArgument;
  ncclResult_t r;
  if (take_failure("ncclRedOpDestroy", c->device, &r)) return r;
  if (!c->premul.erase(op)) {
    violation("ncclRedOpDestroy of an op the communicator never made");
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

ncclResult_t FakeNccl::group_start() {
  std::lock_guard<std::mutex> lock(mu_);
  record("ncclGroupStart", t_device, nullptr, nullptr, nullptr);
  ncclResult_t r;
  if (take_failure("ncclGroupStart", t_device, &r)) return r;
  ++t_group.depth;
  return ncclSuccess;
}

ncclResult_t FakeNccl::group_end() {
  std::lock_guard<std::mutex> lock(mu_);
  record("ncclGroupEnd", t_device, nullptr, nullptr, nullptr);
  if (t_group.depth == 0) {
    violation("ncclGroupEnd without ncclGroupStart");
    return ncclInvalidUsage;
  }
  ncclResult_t r = ncclSuccess;
  const bool failed = take_failure("ncclGroupEnd", t_device, &r);
  if (--t_group.depth > 0) return failed ? r : ncclSuccess;
  std::vector<Part> parts = std::move(t_group.parts);
  t_group.parts.clear();
  if (!failed) r = t_group.error;
  t_group.error = ncclSuccess;
  if (r != ncclSuccess || parts.empty()) return r;  // a failed group issues nothing
  Stream* s = parts[0].stream;
  for (const Part& p : parts)
    if (p.stream != s) violation("one group on two streams");
  auto launch = std::make_shared<Launch>();
  launch->device = s->device;
  launch->comm = parts[0].comm;
  launch->parts_left = static_cast<int>(parts.size());
  launch->held = held_.count(s->device) > 0;
  launches_.push_back(launch);
  s->deps.push_back(launch);
  for (Part& p : parts) submit(launch, p);
  return ncclSuccess;
}

#define FAKE_NCCL_ISSUE(NAME, KIND, SEND, RECV, COUNT, DT, OP, PEER)                              \
  std::lock_guard<std::mutex> lock(mu_);                                                          \
  Comm* c = comm_of(comm, NAME);                                                                  \
  record(NAME, c ? c->device : t_device, comm, stream, nullptr);                                  \
  if (c == nullptr) return refuse(ncclInvalidArgument);                                           \
  ncclResult_t r;                                                                                 \
  if (take_failure(NAME, c->device, &r)) return r;                                                \
  Stream* s = stream_of(stream, NAME);                                                            \
  if (s == nullptr) return refuse(ncclInvalidArgument);                                           \
  check_nccl_buffer(SEND, NAME, "send buffer");                                                   \
  check_nccl_buffer(RECV, NAME, "receive buffer");                                                \
  if ((KIND == Kind::kSend || KIND == Kind::kRecv || KIND == Kind::kBroadcast ||                  \
       KIND == Kind::kReduce) &&                                                                  \
      (PEER < 0 || PEER >= c->size)) {                                                            \
    violation(std::string(NAME) + ": rank " + std::to_string(PEER) + " out of range");            \
    return refuse(ncclInvalidArgument);                                                           \
  }                                                                                               \
  double factor = 1.0;                                                                            \
  const void* factor_ptr = nullptr;                                                               \
  ncclDataType_t factor_dt = ncclFloat32;                                                         \
  if (OP >= ncclNumOps) {                                                                         \
    const auto f = c->premul.find(OP);                                                            \
    if (f == c->premul.end()) {                                                                   \
      violation(std::string(NAME) + " with an op the communicator does not have");                \
      return refuse(ncclInvalidArgument);                                                         \
    }                                                                                             \
    factor = f->second.factor;                                                                    \
    factor_ptr = f->second.device;                                                                \
    factor_dt = f->second.dt;                                                                     \
  }                                                                                               \
  return enqueue(Part{KIND, NAME, c, s, SEND, RECV, COUNT, DT, OP, factor, factor_ptr, factor_dt, \
                      PEER, nullptr},                                                             \
                 s)

ncclResult_t FakeNccl::all_reduce(const void* sendbuff, void* recvbuff, size_t count,
                                  ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream) {
  FAKE_NCCL_ISSUE("ncclAllReduce", Kind::kAllReduce, sendbuff, recvbuff, count, datatype, op, 0);
}

ncclResult_t FakeNccl::broadcast(const void* sendbuff, void* recvbuff, size_t count,
                                 ncclDataType_t datatype, int root, ncclComm_t comm,
                                 cudaStream_t stream) {
  FAKE_NCCL_ISSUE("ncclBroadcast", Kind::kBroadcast, sendbuff, recvbuff, count, datatype, ncclSum,
                  root);
}

ncclResult_t FakeNccl::reduce(const void* sendbuff, void* recvbuff, size_t count,
                              ncclDataType_t datatype, ncclRedOp_t op, int root, ncclComm_t comm,
                              cudaStream_t stream) {
  FAKE_NCCL_ISSUE("ncclReduce", Kind::kReduce, sendbuff, recvbuff, count, datatype, op, root);
}

ncclResult_t FakeNccl::all_gather(const void* sendbuff, void* recvbuff, size_t sendcount,
                                  ncclDataType_t datatype, ncclComm_t comm, cudaStream_t stream) {
  FAKE_NCCL_ISSUE("ncclAllGather", Kind::kAllGather, sendbuff, recvbuff, sendcount, datatype,
                  ncclSum, 0);
}

ncclResult_t FakeNccl::reduce_scatter(const void* sendbuff, void* recvbuff, size_t recvcount,
                                      ncclDataType_t datatype, ncclRedOp_t op, ncclComm_t comm,
                                      cudaStream_t stream) {
  FAKE_NCCL_ISSUE("ncclReduceScatter", Kind::kReduceScatter, sendbuff, recvbuff, recvcount,
                  datatype, op, 0);
}

ncclResult_t FakeNccl::send(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                            ncclComm_t comm, cudaStream_t stream) {
  FAKE_NCCL_ISSUE("ncclSend", Kind::kSend, sendbuff, nullptr, count, datatype, ncclSum, peer);
}

ncclResult_t FakeNccl::recv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                            ncclComm_t comm, cudaStream_t stream) {
  FAKE_NCCL_ISSUE("ncclRecv", Kind::kRecv, nullptr, recvbuff, count, datatype, ncclSum, peer);
}

#undef FAKE_NCCL_ISSUE

// ---- CUDA runtime ----------------------------------------------------------------------------

const char* FakeNccl::cuda_get_error_name(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorLaunchTimeout:
      return "cudaErrorLaunchTimeout";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    default:
      return "cudaError (another)";
  }
}

const char* FakeNccl::cuda_get_error_string(cudaError_t) { return "fake CUDA error"; }

#define FAKE_CUDA_ENTER(NAME, DEVICE, STREAM, EVENT) \
  record(NAME, DEVICE, nullptr, STREAM, EVENT);      \
  if (cudaError_t e_; take_failure(NAME, DEVICE, &e_)) return e_

cudaError_t FakeNccl::cuda_get_last_error() {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaGetLastError", t_device, nullptr, nullptr);
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_get_device(int* device) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaGetDevice", t_device, nullptr, nullptr);
  *device = t_device;
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_set_device(int device) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaSetDevice", device, nullptr, nullptr);
  if (device < 0) return cudaErrorInvalidDevice;
  t_device = device;
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_device_get_stream_priority_range(int* least, int* greatest) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaDeviceGetStreamPriorityRange", t_device, nullptr, nullptr);
  *least = 0;
  *greatest = -5;
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_stream_create_with_priority(cudaStream_t* stream, unsigned int flags,
                                                       int) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaStreamCreateWithPriority", t_device, nullptr, nullptr);
  if (flags != cudaStreamNonBlocking) violation("a stream that is not non-blocking");
  auto s = std::make_unique<Stream>();
  s->device = t_device;
  *stream = reinterpret_cast<cudaStream_t>(s.get());
  streams_[s.get()] = std::move(s);
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_stream_destroy(cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream* s = stream_of(stream, "cudaStreamDestroy");
  FAKE_CUDA_ENTER("cudaStreamDestroy", s ? s->device : t_device, stream, nullptr);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  s->destroyed = true;
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_stream_synchronize(cudaStream_t stream) {
  std::unique_lock<std::mutex> lock(mu_);
  Stream* s = stream_of(stream, "cudaStreamSynchronize");
  FAKE_CUDA_ENTER("cudaStreamSynchronize", s ? s->device : t_device, stream, nullptr);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  const auto deps = s->deps;
  const auto all_done = [&] {
    return std::all_of(deps.begin(), deps.end(), [&](const auto& l) { return done(*l); });
  };
  if (!wait_for(lock, all_done, "cudaStreamSynchronize")) return cudaErrorLaunchTimeout;
  std::erase_if(s->deps, [&](const auto& l) { return done(*l); });
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_stream_wait_event(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream* s = stream_of(stream, "cudaStreamWaitEvent");
  Event* e = event_of(event, "cudaStreamWaitEvent");
  FAKE_CUDA_ENTER("cudaStreamWaitEvent", s ? s->device : t_device, stream, event);
  if (s == nullptr || e == nullptr) return cudaErrorInvalidResourceHandle;
  for (const auto& l : e->deps)
    if (!done(*l)) s->deps.push_back(l);
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_stream_is_capturing(cudaStream_t stream,
                                               cudaStreamCaptureStatus* status) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream* s = stream_of(stream, "cudaStreamIsCapturing");
  FAKE_CUDA_ENTER("cudaStreamIsCapturing", s ? s->device : t_device, stream, nullptr);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  *status = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_thread_exchange_stream_capture_mode(cudaStreamCaptureMode* mode) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaThreadExchangeStreamCaptureMode", t_device, nullptr, nullptr);
  std::swap(*mode, t_capture_mode);
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_event_create_with_flags(cudaEvent_t* event, unsigned int) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaEventCreateWithFlags", t_device, nullptr, nullptr);
  auto e = std::make_unique<Event>();
  e->device = t_device;
  *event = reinterpret_cast<cudaEvent_t>(e.get());
  events_[e.get()] = std::move(e);
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_event_destroy(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* e = event_of(event, "cudaEventDestroy");
  FAKE_CUDA_ENTER("cudaEventDestroy", e ? e->device : t_device, nullptr, event);
  if (e == nullptr) return cudaErrorInvalidResourceHandle;
  e->destroyed = true;
  e->deps.clear();
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_event_record(cudaEvent_t event, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* e = event_of(event, "cudaEventRecord");
  Stream* s = stream_of(stream, "cudaEventRecord");
  FAKE_CUDA_ENTER("cudaEventRecord", s ? s->device : t_device, stream, event);
  if (s == nullptr || e == nullptr) return cudaErrorInvalidResourceHandle;
  if (e->device != s->device)
    violation("an event of device " + std::to_string(e->device) +
              " recorded on a stream of device " + std::to_string(s->device));
  std::erase_if(s->deps, [&](const auto& l) { return done(*l); });
  e->deps = s->deps;
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_event_query(cudaEvent_t event) {
  std::lock_guard<std::mutex> lock(mu_);
  Event* e = event_of(event, "cudaEventQuery");
  FAKE_CUDA_ENTER("cudaEventQuery", e ? e->device : t_device, nullptr, event);
  if (e == nullptr) return cudaErrorInvalidResourceHandle;
  for (const auto& l : e->deps)
    if (!done(*l)) return cudaErrorNotReady;
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_malloc(void** ptr, size_t size) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaMalloc", t_device, nullptr, nullptr);
  auto mem = std::make_unique<char[]>(std::max<size_t>(size, 1));
  *ptr = mem.get();
  buffers_[*ptr] = std::move(mem);
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_free(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaFree", t_device, nullptr, nullptr);
  if (ptr != nullptr && !buffers_.erase(ptr)) {
    violation("cudaFree of memory cudaMalloc never gave");
    return cudaErrorInvalidValue;
  }
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_memset_async(void* ptr, int value, size_t count, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream* s = stream_of(stream, "cudaMemsetAsync");
  FAKE_CUDA_ENTER("cudaMemsetAsync", s ? s->device : t_device, stream, nullptr);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  std::memset(ptr, value, count);  // host memory: done at once
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_memcpy_async(void* dst, const void* src, size_t count,
                                        cudaMemcpyKind kind, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mu_);
  Stream* s = stream_of(stream, "cudaMemcpyAsync");
  FAKE_CUDA_ENTER("cudaMemcpyAsync", s ? s->device : t_device, stream, nullptr);
  if (s == nullptr) return cudaErrorInvalidResourceHandle;
  // A copy from or to pageable memory would block the host (or run at once, unordered).
  if ((kind == cudaMemcpyHostToDevice && host_alloc_of(src) == nullptr) ||
      (kind == cudaMemcpyDeviceToHost && host_alloc_of(dst) == nullptr))
    violation("cudaMemcpyAsync with pageable host memory");
  if (kind != cudaMemcpyHostToDevice && kind != cudaMemcpyDeviceToHost)
    violation("cudaMemcpyAsync of a kind the fake does not model");
  auto launch = std::make_shared<Launch>();
  launch->device = s->device;
  launch->parts_left = 1;
  launches_.push_back(launch);
  std::erase_if(s->deps, [&](const auto& l) { return done(*l); });
  copies_.push_back(Copy{dst, src, count, s->deps, launch});
  s->deps.push_back(launch);
  progress();
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_host_alloc(void** ptr, size_t size, unsigned int flags) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaHostAlloc", t_device, nullptr, nullptr);
  auto mem = std::make_unique<char[]>(std::max<size_t>(size, 1));
  char* p = mem.get();
  *ptr = p;
  host_buffers_[p] = HostAlloc{std::move(mem), std::max<size_t>(size, 1), flags};
  return cudaSuccess;
}

cudaError_t FakeNccl::cuda_free_host(void* ptr) {
  std::lock_guard<std::mutex> lock(mu_);
  FAKE_CUDA_ENTER("cudaFreeHost", t_device, nullptr, nullptr);
  if (ptr == nullptr) return cudaSuccess;
  auto it = host_buffers_.find(static_cast<const char*>(ptr));
  if (it == host_buffers_.end()) {
    violation("cudaFreeHost of memory cudaHostAlloc never gave");
    return cudaErrorInvalidValue;
  }
  for (const Copy& c : copies_)
    if (host_alloc_of(c.dst) == &it->second || host_alloc_of(c.src) == &it->second)
      violation("cudaFreeHost of memory an asynchronous copy still uses");
  host_buffers_.erase(it);
  return cudaSuccess;
}

#undef FAKE_CUDA_ENTER

}  // namespace fastcomms::test
