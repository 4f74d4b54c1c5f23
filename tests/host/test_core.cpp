// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// core/: stores, tensor views, work, the factory (static and dlopen), communicator validation.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <utility>

#include "fastcomms/core/factory.hpp"
#include "fastcomms/core/log.hpp"
#include "fastcomms/core/work.hpp"
#include "harness.hpp"

namespace fastcomms::test {
namespace {

using namespace std::chrono_literals;

template <typename Fn>
void expect_error(Fn&& fn, ErrorCode code, const std::string& message) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected: " << message;
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    EXPECT_EQ(std::string(e.what()), message);
  }
}

void exercise_store(Store& s, const std::string& shown_prefix = "") {
  s.set_string("a", "hello");
  EXPECT_EQ(s.get_string("a", 1s), "hello");
  EXPECT_TRUE(s.check({"a"}));
  EXPECT_FALSE(s.check({"a", "b"}));
  EXPECT_EQ(s.add("n", 5), 5);
  EXPECT_EQ(s.add("n", -2), 3);
  EXPECT_TRUE(s.delete_key("a"));
  EXPECT_FALSE(s.delete_key("a"));
  const auto t0 = std::chrono::steady_clock::now();
  expect_error([&] { s.get("missing/key", 100ms); }, ErrorCode::kTimeout,
               "store: timed out after 100 ms waiting for '" + shown_prefix + "missing/key'");
  EXPECT_GE(std::chrono::steady_clock::now() - t0, 100ms);
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    s.set_string("late", "x");
  });
  s.wait({"late"}, 5s);
  setter.join();
}

TEST(Store, Memory) {
  MemoryStore s;
  exercise_store(s);
}

TEST(Store, FileAcrossProcesses) {
  char tmpl[] = "/tmp/fastcomms-store-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = std::string(tmpl) + "/store";
  {
    FileStore s(dir);
    exercise_store(s);
    struct stat st {};
    ASSERT_EQ(::stat(dir.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0700u);
    s.set_string("perm", "x");
    std::string file;
    for (const auto& name : {"k_perm"}) file = dir + "/" + name;
    ASSERT_EQ(::stat(file.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, 0600u);
  }
  // Four processes add concurrently: no increment is lost.
  std::vector<pid_t> pids;
  for (int p = 0; p < 4; ++p) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      FileStore s(dir);
      for (int i = 0; i < 50; ++i) s.add("counter", 1);
      ::_exit(0);
    }
    pids.push_back(pid);
  }
  for (pid_t pid : pids) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  FileStore s(dir);
  EXPECT_EQ(s.add("counter", 0), 200);
  (void)!std::system(("rm -rf " + std::string(tmpl)).c_str());
}

TEST(Store, PrefixIsolates) {
  auto base = std::make_shared<MemoryStore>();
  PrefixStore a("a", base), b("b", base);
  a.set_string("k", "1");
  EXPECT_TRUE(a.check({"k"}));
  EXPECT_FALSE(b.check({"k"}));
  EXPECT_TRUE(base->check({"a/k"}));
  exercise_store(a, "a/");
}

// NOTE [store keys released at finalize]: a key deleted before finalize is forgotten, so a key
// space that writes and deletes a key per call (the call check's records) does not remember one
// more key per call.
TEST(Store, TrackingForgetsDeletedKeys) {
  auto base = std::make_shared<MemoryStore>();
  KeyTrackingStore t(base);
  t.set_string("keep", "1");
  for (int i = 0; i < 100; ++i) {
    const std::string k = "calls/" + std::to_string(i);
    t.set_string(k, "x");
    EXPECT_TRUE(t.delete_key(k));
  }
  EXPECT_EQ(t.written(), std::vector<std::string>{"keep"});
  EXPECT_FALSE(t.delete_key("never-written"));  // forgetting what it never wrote is harmless
  EXPECT_EQ(t.written(), std::vector<std::string>{"keep"});
}

TEST(Tensor, ViewsAndDtypes) {
  float buf[16];
  TensorView v = TensorView::contiguous(buf, DType::kFloat32, {4, 4});
  EXPECT_TRUE(v.is_contiguous());
  EXPECT_EQ(v.numel(), 16);
  EXPECT_EQ(v.nbytes(), 64);
  EXPECT_EQ(v.describe(), "float32[4, 4] cpu");
  v.strides = {1, 4};  // a transpose
  EXPECT_FALSE(v.is_contiguous());
  EXPECT_EQ(dtype_from_name("bf16"), DType::kBFloat16);
  EXPECT_EQ(dtype_size(DType::kFloat8E5M2), 1u);
  expect_error([] { dtype_from_name("float7"); }, ErrorCode::kInvalidArgument,
               "unknown dtype 'float7'");
}

TEST(Work, DeadlineGivesTimeout) {
  AsyncWork w("[rank 0/1 c op] ", std::chrono::steady_clock::now() + 50ms);
  w.start();
  EXPECT_EQ(w.status(), WorkStatus::kInProgress);
  EXPECT_FALSE(w.is_completed());
  expect_error([&] { w.wait(); }, ErrorCode::kTimeout,
               "[rank 0/1 c op] timed out: the op did not complete in time");
  EXPECT_EQ(w.status(), WorkStatus::kTimedOut);
  // An error rethrows on every wait.
  AsyncWork f("p ", std::chrono::steady_clock::time_point::max());
  f.fail(std::make_exception_ptr(Error(ErrorCode::kBackendError, "boom")));
  expect_error([&] { f.wait(); }, ErrorCode::kBackendError, "boom");
  expect_error([&] { f.wait(); }, ErrorCode::kBackendError, "boom");
  EXPECT_EQ(f.status(), WorkStatus::kError);
}

class Factory : public ::testing::Test {
 protected:
  void TearDown() override { ::unsetenv("FASTCOMMS_BACKEND_LIB_PATH_TOY"); }
  std::shared_ptr<Communicator> make(const std::string& backend) {
    CommOptions o;
    o.store = std::make_shared<MemoryStore>();
    o.name = "f";
    return Communicator::create(backend, 0, 1, Device{}, o);
  }
};

TEST_F(Factory, GlooIsBuiltIn) {
  EXPECT_TRUE(is_backend_registered("gloo"));
  auto c = make("gloo");
  EXPECT_EQ(c->backend_name(), "gloo");
}

TEST_F(Factory, UnknownWithoutVariable) {
  std::string built;
  for (const auto& n : registered_backends()) built += (built.empty() ? "" : ", ") + n;
  EXPECT_NE(built.find("gloo"), std::string::npos);
  expect_error([&] { make("toy"); }, ErrorCode::kInvalidArgument,
               "[rank 0/1 f] new_comm: backend 'toy' is not built in (built in: " + built +
                   ") and FASTCOMMS_BACKEND_LIB_PATH_TOY is not set to a backend library");
}

TEST_F(Factory, LoadsGoodLibrary) {
  ::setenv("FASTCOMMS_BACKEND_LIB_PATH_TOY", PLUGIN_GOOD, 1);
  auto c = make("toy");
  EXPECT_EQ(c->backend_name(), "toy");
  EXPECT_EQ(c->backend_version(), "toy 1.0");
  c->barrier();
  float x = 3;
  c->all_reduce(TensorView::contiguous(&x, DType::kFloat32, {1}), ReduceOp::sum());
  EXPECT_EQ(x, 3);
  // What the plugin does not support is refused by the communicator.
  expect_error([&] { c->broadcast(TensorView::contiguous(&x, DType::kFloat32, {1}), 0); },
               ErrorCode::kUnsupported,
               "[rank 0/1 f broadcast] backend 'toy' does not support broadcast");
}

TEST_F(Factory, RejectsOtherAbi) {
  ::setenv("FASTCOMMS_BACKEND_LIB_PATH_TOY", PLUGIN_BAD_ABI, 1);
  expect_error([&] { make("toy"); }, ErrorCode::kBackendError,
               std::string("backend 'toy': ") + PLUGIN_BAD_ABI +
                   " was built for backend ABI version " +
                   std::to_string(FASTCOMMS_BACKEND_ABI_VERSION + 998) +  // plugin_backend.cpp
                   ", this fastcomms has ABI version " +
                   std::to_string(FASTCOMMS_BACKEND_ABI_VERSION) + "; rebuild the backend");
}

TEST_F(Factory, RejectsMissingEntryPoint) {
  ::setenv("FASTCOMMS_BACKEND_LIB_PATH_TOY", PLUGIN_NO_ENTRY, 1);
  expect_error([&] { make("toy"); }, ErrorCode::kBackendError,
               std::string("backend 'toy': ") + PLUGIN_NO_ENTRY +
                   " does not export the entry point fastcomms_backend_entry");
}

TEST_F(Factory, RejectsUnloadablePath) {
  ::setenv("FASTCOMMS_BACKEND_LIB_PATH_TOY", "/nonexistent/libtoy.so", 1);
  expect_error([&] { make("toy"); }, ErrorCode::kInvalidArgument,
               "FASTCOMMS_BACKEND_LIB_PATH_TOY=/nonexistent/libtoy.so: not a regular file");
}

// A library named by the environment runs its code when loaded, so it is checked first: only an
// absolute path, and neither the file nor its folder writable by every user (issue 16, item 9).
TEST_F(Factory, RefusesUntrustedLibrariesBeforeLoadingThem) {
  ::setenv("FASTCOMMS_BACKEND_LIB_PATH_TOY", "libtest_plugin_0.so", 1);
  expect_error([&] { make("toy"); }, ErrorCode::kInvalidArgument,
               "FASTCOMMS_BACKEND_LIB_PATH_TOY=libtest_plugin_0.so: a library to load must be "
               "named by an absolute path (a bare or relative name would be looked up where "
               "others may plant one)");
  char tmpl[] = "/tmp/fastcomms-trust-XXXXXX";
  ASSERT_NE(::mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl, lib = dir + "/libtoy.so";
  {
    std::ifstream in(PLUGIN_GOOD, std::ios::binary);
    std::ofstream out(lib, std::ios::binary);
    out << in.rdbuf();
  }
  ::setenv("FASTCOMMS_BACKEND_LIB_PATH_TOY", lib.c_str(), 1);
  ::chmod(lib.c_str(), 0666);
  expect_error([&] { make("toy"); }, ErrorCode::kInvalidArgument,
               "FASTCOMMS_BACKEND_LIB_PATH_TOY=" + lib +
                   ": refused, the file is writable by every user (loading it would run code "
                   "anyone could have written)");
  EXPECT_EQ(::dlopen(lib.c_str(), RTLD_NOW | RTLD_NOLOAD), nullptr) << "it was loaded anyway";
  ::chmod(lib.c_str(), 0755);
  ::chmod(dir.c_str(), 0777);
  expect_error([&] { make("toy"); }, ErrorCode::kInvalidArgument,
               "FASTCOMMS_BACKEND_LIB_PATH_TOY=" + lib + ": refused, its folder " + dir +
                   " is writable by every user (anyone could replace the library)");
  ::chmod(dir.c_str(), 0700);  // the control: the same file, trusted, loads
  EXPECT_EQ(make("toy")->backend_name(), "toy");
  std::remove(lib.c_str());
  ::rmdir(dir.c_str());
}

TEST(Validation, EveryRejectionSaysWhatAndWhere) {
  CommOptions o;
  o.store = std::make_shared<MemoryStore>();
  o.name = "val";
  auto c = Communicator::create("gloo", 0, 1, Device{}, o);
  HostTensor f(DType::kFloat32, 4), i32(DType::kInt32, 4), f3(DType::kFloat32, 3);
  HostTensor fp8(DType::kFloat8E4M3FN, 4);
  const ErrorCode kArg = ErrorCode::kInvalidArgument, kType = ErrorCode::kTypeError;
  expect_error([&] { c->send(f.view(), 1); }, kArg,
               "[rank 0/1 val send] dst must be in [0, 1), got 1");
  expect_error([&] { c->recv(f.view(), 0); }, kArg,
               "[rank 0/1 val recv] src must not be this rank (0)");
  TensorView t = HostTensor(DType::kFloat32, std::vector<int64_t>{4, 4}).view();
  std::vector<uint8_t> keep(64);
  t.data = keep.data();
  t.strides = {1, 4};
  expect_error([&] { c->all_reduce(t, ReduceOp::sum()); }, kArg,
               "[rank 0/1 val all_reduce] tensor must be contiguous, got float32[4, 4] cpu with "
               "non-dense strides");
  TensorView cuda = f.view();
  cuda.device = Device{DeviceType::kCUDA, 0};
  expect_error([&] { c->broadcast(cuda, 0); }, kArg,
               "[rank 0/1 val broadcast] tensor is on cuda:0, which backend 'gloo' does not "
               "serve");
  expect_error([&] { c->all_reduce(f.view(), ReduceOp::band()); }, kType,
               "[rank 0/1 val all_reduce] BAND needs an integer or bool tensor, got float32");
  expect_error([&] { c->all_reduce(fp8.view(), ReduceOp::sum()); }, ErrorCode::kUnsupported,
               "[rank 0/1 val all_reduce] reductions on float8_e4m3fn are not supported");
  expect_error([&] { c->all_reduce(i32.view(), ReduceOp::premul_sum(2)); }, kType,
               "[rank 0/1 val all_reduce] PREMUL_SUM needs a floating-point tensor, got int32");
  expect_error([&] { c->reduce(f.view(), 3, ReduceOp::sum()); }, kArg,
               "[rank 0/1 val reduce] root must be in [0, 1), got 3");
  expect_error(
      [&] {
        c->all_gather({f.view(), f.view()}, f.view());
      },
      kArg, "[rank 0/1 val all_gather] tensor_list must hold 1 tensors (one per rank), got 2");
  expect_error([&] { c->all_gather_single(f3.view(), f.view()); }, kArg,
               "[rank 0/1 val all_gather_single] output has 3 elements, expected input.numel() "
               "* size = 4 * 1");
  expect_error([&] { c->all_gather_single(i32.view(), f.view()); }, kType,
               "[rank 0/1 val all_gather_single] output has dtype int32, expected float32");
  expect_error([&] { c->all_to_all_v_single(f.view(), f.view(), {4}, {3}); }, kArg,
               "[rank 0/1 val all_to_all_v_single] input_split_sizes sums to 3, input.size(0) "
               "is 4");
  expect_error([&] { c->all_to_all_v_single(f.view(), f.view(), {-1}, {4}); }, kArg,
               "[rank 0/1 val all_to_all_v_single] output_split_sizes[0] must be >= 0, got -1");
  expect_error(
      [&] {
        c->all_to_all_v_single(f.view(), f.view(), {2, 2}, {4});
      },
      kArg,
      "[rank 0/1 val all_to_all_v_single] output_split_sizes must have 1 entries, got "
      "2");
  expect_error([&] { c->reduce_scatter_single(f.view(), f3.view(), ReduceOp::sum()); }, kArg,
               "[rank 0/1 val reduce_scatter_single] input has 3 elements, expected "
               "output.numel() * size = 4 * 1");
  expect_error([&] { c->batch_p2p({}); }, kArg, "[rank 0/1 val batch_op_issue] the batch is empty");
  expect_error(
      [&] {
        c->split({0, 0}, "s");
      },
      kArg, "[rank 0/1 val split] rank 0 appears twice in ranks");
  expect_error([&] { c->scatter(f.view(), {f3.view()}, 0); }, kArg,
               "[rank 0/1 val scatter] input_tensor_list[0] has 3 elements, output_tensor has 4");
  c->finalize();
  expect_error([&] { c->barrier(); }, kArg,
               "[rank 0/1 val barrier] the communicator was finalized");
}

TEST(Validation, SplitReturnsNullOutsideRanks) {
  run_threads(3, [](Communicator& comm) {
    auto sub = comm.split({2}, "solo");
    EXPECT_EQ(sub == nullptr, comm.rank() != 2);
    if (sub) {
      EXPECT_EQ(sub->size(), 1);
      EXPECT_EQ(sub->rank(), 0);
      EXPECT_EQ(sub->name(), "solo");
      sub->barrier();
    }
    // An empty list joins none and still advances the split counter: the next split is aligned.
    EXPECT_EQ(comm.split({}, "none"), nullptr);
    auto all = comm.split({0, 1, 2}, "all");
    ASSERT_NE(all, nullptr);
    all->barrier();
  });
}

}  // namespace
}  // namespace fastcomms::test

#ifdef FASTCOMMS_WITH_CUDA
#include "fastcomms/cuda/nvml.hpp"
namespace fastcomms::test {
namespace {
TEST(NvmlProbe, UnknownWithoutNvmlNeverYes) {
  // Point the probe at a library that does not exist: the answer must be "unknown" with a
  // reason, never a matrix that claims NVLink.
  ::setenv("FASTCOMMS_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1", 1);
  std::string why;
  const auto m = cuda::nvlink_matrix({0, 1}, &why);
  ::unsetenv("FASTCOMMS_NVML_LIBRARY");
  EXPECT_FALSE(m.has_value());
  EXPECT_NE(why.find("cannot load NVML"), std::string::npos) << why;
}
}  // namespace
}  // namespace fastcomms::test
#endif

// NOTE [authenticated rendezvous]: sealed values open only with the same secret at the same key;
// the token file must be private to its owner.
#include "fastcomms/core/auth_store.hpp"

TEST(AuthStore, SealedValuesOpenOnlyWithTheSecretAtTheirKey) {
  if (!fastcomms::auth_store_available()) GTEST_SKIP() << "built without OpenSSL";
  auto base = std::make_shared<fastcomms::MemoryStore>();
  fastcomms::AuthStore a(base, "one"), b(base, "two");
  a.set("addr", {1, 2, 3});
  EXPECT_EQ(a.get("addr", std::chrono::milliseconds(100)), (std::vector<uint8_t>{1, 2, 3}));
  EXPECT_THROW(b.get("addr", std::chrono::milliseconds(100)), fastcomms::Error);  // other secret
  base->set("copy", base->get("addr", std::chrono::milliseconds(100)));
  EXPECT_THROW(a.get("copy", std::chrono::milliseconds(100)), fastcomms::Error);  // other key
  auto rec = base->get("addr", std::chrono::milliseconds(100));
  rec.back() ^= 1;
  base->set("addr", rec);
  try {
    a.get("addr", std::chrono::milliseconds(100));
    FAIL() << "a flipped bit was accepted";
  } catch (const fastcomms::Error& e) {
    EXPECT_EQ(e.code(), fastcomms::ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("'addr'"), std::string::npos) << e.what();
  }
  base->set("raw", {9});  // planted without the secret
  EXPECT_THROW(a.get("raw", std::chrono::milliseconds(100)), fastcomms::Error);
  EXPECT_EQ(a.add("n", 2), 2);  // counters pass through
}

TEST(AuthStore, TokenFromTheEnvironment) {
  unsetenv("FASTCOMMS_STORE_TOKEN");
  unsetenv("FASTCOMMS_STORE_TOKEN_FILE");
  EXPECT_FALSE(fastcomms::store_token_from_env().has_value());
  setenv("FASTCOMMS_STORE_TOKEN", "abc", 1);
  EXPECT_EQ(fastcomms::store_token_from_env().value(), "abc");
  char path[] = "/tmp/fastcomms_tokenXXXXXX";
  const int fd = mkstemp(path);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(write(fd, "s3cret\n", 7), 7);
  close(fd);
  setenv("FASTCOMMS_STORE_TOKEN_FILE", path, 1);
  EXPECT_THROW(fastcomms::store_token_from_env(), fastcomms::Error);  // both set
  unsetenv("FASTCOMMS_STORE_TOKEN");
  chmod(path, 0600);
  EXPECT_EQ(fastcomms::store_token_from_env().value(), "s3cret");
  chmod(path, 0644);  // readable by others: refused
  EXPECT_THROW(fastcomms::store_token_from_env(), fastcomms::Error);
  unlink(path);
  EXPECT_THROW(fastcomms::store_token_from_env(), fastcomms::Error);  // missing
  unsetenv("FASTCOMMS_STORE_TOKEN_FILE");
}

// The one log (include/fastcomms/core/log.hpp): FASTCOMMS_LOG_LEVEL's values.
TEST(Log, LevelsParse) {
  using fastcomms::log::Level;
  Level l = Level::kWarn;
  const std::pair<const char*, Level> cases[] = {{"off", Level::kOff},
                                                 {"error", Level::kError},
                                                 {"warn", Level::kWarn},
                                                 {"info", Level::kInfo},
                                                 {"debug", Level::kDebug}};
  for (const auto& [text, want] : cases) {
    EXPECT_TRUE(fastcomms::log::parse_level(text, &l)) << text;
    EXPECT_EQ(l, want) << text;
  }
  EXPECT_FALSE(fastcomms::log::parse_level("verbose", &l));
  EXPECT_FALSE(fastcomms::log::parse_level("", &l));
  // an error line is written at the default threshold, a debug line is not
  EXPECT_TRUE(fastcomms::log::enabled(Level::kError));
  if (std::getenv("FASTCOMMS_LOG_LEVEL") == nullptr)
    EXPECT_FALSE(fastcomms::log::enabled(Level::kDebug));
  try {
    throw std::runtime_error("the text");
  } catch (...) {
    EXPECT_EQ(fastcomms::log::current_exception_text(), "the text");
  }
}
