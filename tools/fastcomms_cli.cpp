// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// `fastcomms bench`: spawns N local ranks (processes over a file store, CPU tensors over gloo),
// runs the Ulysses all-to-all and all_to_all_single over a size sweep, checks every result, and
// prints a table with a live progress line.
#include <sys/wait.h>
#include <unistd.h>
#include <filesystem>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "fastcomms/core/store.hpp"
#include "fastcomms/error.hpp"
#include "fastcomms/ulysses/transport.hpp"

using namespace fastcomms;
using Clock = std::chrono::steady_clock;

namespace {

const char* kUsage =
    "usage: fastcomms bench [--backend gloo] [--nproc N] [--shape b,s,h,d] [--dtype NAME]\n"
    "                       [--iters N] [--warmup N] [--max-mib M]\n"
    "  Spawns N local ranks and times the Ulysses all-to-all (mode 0 then mode 1) against\n"
    "  permute + all_to_all_single + permute, checking every result bit for bit.\n"
    "  --shape fixes one shape (mode 0's input on each rank: b, s_local, heads, d); without it a\n"
    "  sweep over s_local runs up to --max-mib MiB per rank (default 64).\n";

struct Options {
  std::string backend = "gloo";
  int nproc = 2;
  std::vector<int64_t> shape;
  DType dtype = DType::kBFloat16;
  int iters = 20, warmup = 3;
  double max_mib = 64;
};

// Element `idx` of rank `rank`'s input: a hash, so any rank can recompute any input element.
inline uint64_t input_word(int rank, int64_t idx) {
  uint64_t x =
      (static_cast<uint64_t>(rank) << 40) ^ static_cast<uint64_t>(idx) ^ 0x9e3779b97f4a7c15ull;
  x ^= x >> 31;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 29;
  return x;
}

void fill_input(std::vector<uint8_t>& buf, int rank, size_t e) {
  for (size_t i = 0; i < buf.size() / e; ++i) {
    const uint64_t w = input_word(rank, static_cast<int64_t>(i));
    std::memcpy(buf.data() + i * e, &w, e);
  }
}

// Checks rank r's mode-0 output (b, S, h_r, d) against the inputs' definition.
bool check_mode0(const std::vector<uint8_t>& out, int r, int P, int64_t b, int64_t s, int64_t n,
                 int64_t d, size_t e) {
  const int64_t h = n / P, S = s * P;
  for (int64_t i = 0; i < b; ++i)
    for (int64_t t = 0; t < S; ++t) {
      const int p = static_cast<int>(t / s);
      const int64_t j = t % s;
      for (int64_t k = 0; k < h; ++k)
        for (int64_t c = 0; c < d; ++c) {
          const int64_t src = ((i * s + j) * n + r * h + k) * d + c;
          const int64_t dst = ((i * S + t) * h + k) * d + c;
          const uint64_t w = input_word(p, src);
          if (std::memcmp(out.data() + dst * e, &w, e) != 0) return false;
        }
    }
  return true;
}

std::vector<int64_t> parse_list(const std::string& s) {
  std::vector<int64_t> v;
  size_t pos = 0;
  while (pos <= s.size()) {
    const size_t comma = s.find(',', pos);
    const std::string item =
        s.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    char* end = nullptr;
    v.push_back(std::strtoll(item.c_str(), &end, 10));
    if (item.empty() || *end)
      throw Error(ErrorCode::kInvalidArgument, "'" + s + "' is not a list of integers");
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Row {
  int64_t b, s, n, d;
  double mib, ours_ms, base_ms, a2a_ms;
  int ok;
};

// permute + all_to_all_single + permute, as a PyTorch user writes it today (mode 0).
void baseline_mode0(Communicator& comm, const std::vector<uint8_t>& x, std::vector<uint8_t>& out,
                    std::vector<uint8_t>& send, std::vector<uint8_t>& recv, int64_t b, int64_t s,
                    int64_t n, int64_t d, size_t e) {
  const int P = comm.size();
  const int64_t h = n / P, row = d * static_cast<int64_t>(e);
  // x (b, s, P, h, d) -> send (P, s, b, h, d)
  for (int p = 0; p < P; ++p)
    for (int64_t j = 0; j < s; ++j)
      for (int64_t i = 0; i < b; ++i)
        std::memcpy(send.data() + (((p * s + j) * b + i) * h) * row,
                    x.data() + ((i * s + j) * n + p * h) * row, static_cast<size_t>(h * row));
  const DType raw = DType::kUInt8;
  comm.all_to_all_single(
      TensorView::contiguous(recv.data(), raw, {static_cast<int64_t>(recv.size())}),
      TensorView::contiguous(send.data(), raw, {static_cast<int64_t>(send.size())}));
  // recv (P, s, b, h, d) = (S, b, h, d) -> out (b, S, h, d)
  for (int64_t t = 0; t < s * P; ++t)
    for (int64_t i = 0; i < b; ++i)
      std::memcpy(out.data() + ((i * s * P + t) * h) * row, recv.data() + ((t * b + i) * h) * row,
                  static_cast<size_t>(h * row));
}

int run_rank(int rank, const Options& opt, const std::string& dir, int out_fd) {
  CommOptions co;
  co.store = std::make_shared<FileStore>(dir);
  co.name = "bench";
  co.timeout = std::chrono::seconds(120);
  auto comm = Communicator::create(opt.backend, rank, opt.nproc, Device{}, co);
  auto group = make_collective_transport(comm);
  const int P = opt.nproc;
  const size_t e = dtype_size(opt.dtype);
  std::vector<std::vector<int64_t>> shapes;
  if (!opt.shape.empty()) {
    shapes.push_back(opt.shape);
  } else {
    const int64_t heads = 8 * P * ((40 + 8 * P - 1) / (8 * P));  // ~40 heads, divisible by P
    for (int64_t s = 16;; s *= 4) {
      const double mib = static_cast<double>(s * heads * 128 * e) / (1 << 20);
      if (mib > opt.max_mib) break;
      shapes.push_back({1, s, heads, 128});
    }
  }
  std::vector<Row> rows;
  for (size_t si = 0; si < shapes.size(); ++si) {
    const auto& sh = shapes[si];
    const int64_t b = sh[0], s = sh[1], n = sh[2], d = sh[3];
    const size_t bytes = static_cast<size_t>(b * s * n * d) * e;
    std::vector<uint8_t> x(bytes), out(bytes), back(bytes), send(bytes), recv(bytes), base(bytes);
    fill_input(x, rank, e);
    const TensorView xv = TensorView::contiguous(x.data(), opt.dtype, {b, s, n, d});
    const TensorView ov = TensorView::contiguous(out.data(), opt.dtype, {b, s * P, n / P, d});
    const TensorView bv = TensorView::contiguous(back.data(), opt.dtype, {b, s, n, d});
    UlyssesArgs m0, m1;
    m1.mode = 1;
    int ok = 1;
    std::vector<double> ours, theirs, raw;
    for (int it = 0; it < opt.warmup + opt.iters; ++it) {
      if (rank == 0 && isatty(STDERR_FILENO)) {
        std::fprintf(stderr, "\r  [%zu/%zu] shape (%lld, %lld, %lld, %lld): iteration %d/%d   ",
                     si + 1, shapes.size(), (long long)b, (long long)s, (long long)n, (long long)d,
                     it + 1, opt.warmup + opt.iters);
      }
      std::fill(out.begin(), out.end(), 0xA5);  // poison
      comm->barrier();
      auto t0 = Clock::now();
      group->all_to_all_4d(xv, ov, m0, nullptr);
      auto t1 = Clock::now();
      std::fill(base.begin(), base.end(), 0x5A);
      comm->barrier();
      auto t2 = Clock::now();
      baseline_mode0(*comm, x, base, send, recv, b, s, n, d, e);
      auto t3 = Clock::now();
      comm->barrier();
      auto t4 = Clock::now();
      comm->all_to_all_single(
          TensorView::contiguous(recv.data(), DType::kUInt8, {static_cast<int64_t>(bytes)}),
          TensorView::contiguous(send.data(), DType::kUInt8, {static_cast<int64_t>(bytes)}));
      auto t5 = Clock::now();
      if (it == 0) {  // check ours, the baseline, and the round trip once per shape
        std::fill(back.begin(), back.end(), 0xA5);
        group->all_to_all_4d(ov, bv, m1, nullptr);
        ok = check_mode0(out, rank, P, b, s, n, d, e) && out == base && back == x;
      }
      if (it >= opt.warmup) {
        ours.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        theirs.push_back(std::chrono::duration<double, std::milli>(t3 - t2).count());
        raw.push_back(std::chrono::duration<double, std::milli>(t5 - t4).count());
      }
    }
    rows.push_back({b, s, n, d, static_cast<double>(bytes) / (1 << 20), median(ours),
                    median(theirs), median(raw), ok});
  }
  if (rank == 0 && isatty(STDERR_FILENO)) std::fprintf(stderr, "\r%80s\r", "");
  // Every rank reports its rows to the parent; the parent prints the slowest rank's numbers.
  for (const Row& r : rows) (void)!::write(out_fd, &r, sizeof r);
  comm->finalize();
  return 0;
}

int bench(int argc, char** argv) {
  Options opt;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw Error(ErrorCode::kInvalidArgument, a + " needs a value");
      return argv[++i];
    };
    if (a == "--backend")
      opt.backend = value();
    else if (a == "--nproc")
      opt.nproc = static_cast<int>(parse_list(value())[0]);
    else if (a == "--shape")
      opt.shape = parse_list(value());
    else if (a == "--dtype")
      opt.dtype = dtype_from_name(value());
    else if (a == "--iters")
      opt.iters = static_cast<int>(parse_list(value())[0]);
    else if (a == "--warmup")
      opt.warmup = static_cast<int>(parse_list(value())[0]);
    else if (a == "--max-mib")
      opt.max_mib = std::stod(value());
    else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      return 0;
    } else {
      throw Error(ErrorCode::kInvalidArgument, "bench: unknown argument '" + a + "'\n" + kUsage);
    }
  }
  if (opt.backend == "auto") opt.backend = "gloo";
  if (opt.backend != "gloo")
    throw Error(ErrorCode::kInvalidArgument,
                "bench: this build runs --backend gloo (CPU ranks); '" + opt.backend +
                    "' needs the GPU build");
  if (opt.nproc < 1 || opt.nproc > 64)
    throw Error(ErrorCode::kInvalidArgument, "bench: --nproc must be in [1, 64]");
  if (!opt.shape.empty()) {
    if (opt.shape.size() != 4 || opt.shape[2] % opt.nproc != 0)
      throw Error(ErrorCode::kInvalidArgument,
                  "bench: --shape needs b,s,h,d with h divisible by --nproc");
  }
  if (opt.iters < 1 || opt.warmup < 0)
    throw Error(ErrorCode::kInvalidArgument, "bench: --iters must be >= 1, --warmup >= 0");

  char tmpl[] = "/tmp/fastcomms-bench-XXXXXX";
  if (!::mkdtemp(tmpl)) throw Error(ErrorCode::kBackendError, "bench: mkdtemp failed");
  std::printf(
      "fastcomms bench: backend %s, %d ranks (processes), dtype %s, %d iterations after "
      "%d warm-up, median\n",
      opt.backend.c_str(), opt.nproc, std::string(dtype_name(opt.dtype)).c_str(), opt.iters,
      opt.warmup);
  std::fflush(stdout);
  std::vector<pid_t> pids;
  std::vector<int> fds;
  for (int r = 0; r < opt.nproc; ++r) {
    int p[2];
    if (::pipe(p) != 0) throw Error(ErrorCode::kBackendError, "bench: pipe failed");
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(p[0]);
      int rc = 1;
      try {
        rc = run_rank(r, opt, std::string(tmpl) + "/store", p[1]);
      } catch (const std::exception& ex) {
        std::fprintf(stderr, "\nfastcomms bench: rank %d: %s\n", r, ex.what());
      }
      ::close(p[1]);
      ::_exit(rc);
    }
    ::close(p[1]);
    pids.push_back(pid);
    fds.push_back(p[0]);
  }
  std::vector<std::vector<Row>> per_rank(opt.nproc);
  bool failed = false;
  for (int r = 0; r < opt.nproc; ++r) {
    Row row;
    while (::read(fds[r], &row, sizeof row) == static_cast<ssize_t>(sizeof row))
      per_rank[r].push_back(row);
    ::close(fds[r]);
    int status = 0;
    ::waitpid(pids[r], &status, 0);
    failed |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::error_code ec;  // no shell: the folder is removed directly
  std::filesystem::remove_all(tmpl, ec);
  if (failed || per_rank[0].empty()) {
    std::fprintf(stderr, "fastcomms bench: a rank failed\n");
    return 1;
  }
  std::printf("\n%-24s %9s %11s %9s %13s %12s %9s %6s\n", "shape (b,s_local,h,d)", "MiB/rank",
              "ulysses ms", "GB/s", "permute ms", "a2a-only ms", "speed-up", "check");
  int bad = 0;
  for (size_t i = 0; i < per_rank[0].size(); ++i) {
    Row worst = per_rank[0][i];
    for (int r = 1; r < opt.nproc; ++r) {
      const Row& o = per_rank[r][i];
      worst.ours_ms = std::max(worst.ours_ms, o.ours_ms);
      worst.base_ms = std::max(worst.base_ms, o.base_ms);
      worst.a2a_ms = std::max(worst.a2a_ms, o.a2a_ms);
      worst.ok &= o.ok;
    }
    bad += !worst.ok;
    char shape[64];
    std::snprintf(shape, sizeof shape, "(%lld, %lld, %lld, %lld)", (long long)worst.b,
                  (long long)worst.s, (long long)worst.n, (long long)worst.d);
    std::printf("%-24s %9.2f %11.3f %9.2f %13.3f %12.3f %8.2fx %6s\n", shape, worst.mib,
                worst.ours_ms, worst.mib * 1.048576 / worst.ours_ms, worst.base_ms, worst.a2a_ms,
                worst.base_ms / worst.ours_ms, worst.ok ? "OK" : "FAIL");
  }
  std::printf(
      "\nGB/s = bytes of one rank's input / time (slowest rank). speed-up = permute path / "
      "ulysses. check: bit-exact against the definition, against the permute path, and "
      "the mode-1 round trip.\n%s\n",
      bad ? "SOME CHECKS FAILED" : "all checks passed");
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2 || std::string(argv[1]) == "--help" || std::string(argv[1]) == "-h") {
      std::printf("usage: fastcomms bench [options]   (fastcomms bench --help)\n");
      return argc < 2 ? 2 : 0;
    }
    const std::string cmd = argv[1];
    if (cmd == "bench") return bench(argc - 2, argv + 2);
    std::fprintf(stderr, "fastcomms: unknown command '%s' (this build has: bench)\n", cmd.c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fastcomms: %s\n", e.what());
    return 2;
  }
}
