// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
// NOTE [authenticated rendezvous] (fastcomms/core/auth_store.hpp).
#include "fastcomms/core/auth_store.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

#include "fastcomms/error.hpp"

#ifdef FASTCOMMS_WITH_OPENSSL
#include <dlfcn.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#endif

namespace fastcomms {
namespace {

constexpr uint8_t kMagic[4] = {'f', 'c', 'a', '1'};  // record format version 1
constexpr size_t kMac = 32;                          // HMAC-SHA256

#ifdef FASTCOMMS_WITH_OPENSSL
// NOTE [libcrypto at run time]: OpenSSL's libcrypto is opened when a token is first used, not
// linked: the library (and its wheel) needs no libcrypto to load, and the system's copy, kept up
// to date by the distribution, is the one that runs. The headers only give the prototypes.
struct Crypto {
  decltype(&HMAC) hmac = nullptr;
  decltype(&EVP_sha256) sha256 = nullptr;
  decltype(&CRYPTO_memcmp) memcmp = nullptr;
  std::string error;
};

const Crypto& crypto() {
  static const Crypto c = [] {
    Crypto r;
    void* h = nullptr;
    for (const char* name : {"libcrypto.so.3", "libcrypto.so"}) {
      if ((h = dlopen(name, RTLD_NOW | RTLD_LOCAL)) != nullptr) break;
    }
    if (h == nullptr) {
      r.error =
          detail::cat("OpenSSL's libcrypto (libcrypto.so.3) could not be opened: ", dlerror());
      return r;
    }
    r.hmac = reinterpret_cast<decltype(&HMAC)>(dlsym(h, "HMAC"));
    r.sha256 = reinterpret_cast<decltype(&EVP_sha256)>(dlsym(h, "EVP_sha256"));
    r.memcmp = reinterpret_cast<decltype(&CRYPTO_memcmp)>(dlsym(h, "CRYPTO_memcmp"));
    if (!r.hmac || !r.sha256 || !r.memcmp)
      r.error = "libcrypto lacks HMAC, EVP_sha256 or CRYPTO_memcmp";
    return r;
  }();
  FASTCOMMS_CHECK(c.error.empty(), kUnsupported,
                  "store authentication (FASTCOMMS_STORE_TOKEN): ", c.error,
                  "; install OpenSSL 3 (Debian/Ubuntu: libssl3)");
  return c;
}
#endif

std::vector<uint8_t> mac(const std::string& secret, const std::string& key, const uint8_t* value,
                         size_t n) {
#ifdef FASTCOMMS_WITH_OPENSSL
  // The MAC covers the key, a separator the key cannot contain in its length prefix, and the value.
  std::vector<uint8_t> msg;
  const uint64_t klen = key.size();
  msg.resize(sizeof klen + key.size() + n);
  std::memcpy(msg.data(), &klen, sizeof klen);
  std::memcpy(msg.data() + sizeof klen, key.data(), key.size());
  if (n) std::memcpy(msg.data() + sizeof klen + key.size(), value, n);
  std::vector<uint8_t> out(EVP_MAX_MD_SIZE);
  unsigned int len = 0;
  const Crypto& c = crypto();
  const unsigned char* r = c.hmac(c.sha256(), secret.data(), static_cast<int>(secret.size()),
                                  msg.data(), msg.size(), out.data(), &len);
  FASTCOMMS_CHECK(r != nullptr && len == kMac, kInternal, "store authentication: HMAC failed");
  out.resize(kMac);
  return out;
#else
  (void)secret, (void)key, (void)value, (void)n;
  throw Error(ErrorCode::kUnsupported,
              "store authentication: this build has no OpenSSL (FASTCOMMS_STORE_TOKEN cannot be "
              "used)");
#endif
}

bool equal_ct(const uint8_t* a, const uint8_t* b, size_t n) {
#ifdef FASTCOMMS_WITH_OPENSSL
  return crypto().memcmp(a, b, n) == 0;
#else
  unsigned char d = 0;
  for (size_t i = 0; i < n; ++i) d |= a[i] ^ b[i];
  return d == 0;
#endif
}

}  // namespace

bool looks_sealed(const std::vector<uint8_t>& record) {
  return record.size() >= sizeof kMagic + kMac &&
         std::memcmp(record.data(), kMagic, sizeof kMagic) == 0;
}

bool auth_store_available() {
#ifdef FASTCOMMS_WITH_OPENSSL
  return true;
#else
  return false;
#endif
}

AuthStore::AuthStore(std::shared_ptr<Store> base, std::string secret)
    : ForwardingStore(std::move(base)), secret_(std::move(secret)) {
  FASTCOMMS_CHECK(base_ != nullptr, kInvalidArgument, "AuthStore: a base store is required");
  FASTCOMMS_CHECK(!secret_.empty(), kInvalidArgument, "AuthStore: the secret is empty");
  FASTCOMMS_CHECK(auth_store_available(), kUnsupported,
                  "store authentication: this build has no OpenSSL (FASTCOMMS_STORE_TOKEN cannot "
                  "be used)");
}

std::vector<uint8_t> AuthStore::seal(const std::string& key,
                                     const std::vector<uint8_t>& value) const {
  std::vector<uint8_t> rec(sizeof kMagic);
  std::memcpy(rec.data(), kMagic, sizeof kMagic);
  const auto m = mac(secret_, key, value.data(), value.size());
  rec.insert(rec.end(), m.begin(), m.end());
  rec.insert(rec.end(), value.begin(), value.end());
  return rec;
}

std::vector<uint8_t> AuthStore::open(const std::string& key,
                                     const std::vector<uint8_t>& record) const {
  const auto refuse = [&](const char* why) {
    return Error(ErrorCode::kInvalidArgument,
                 detail::cat("store authentication: the value of rendezvous key '", key,
                             "' is refused (", why,
                             "): written by a process without this FASTCOMMS_STORE_TOKEN, copied "
                             "from another key, or corrupted; check that every rank uses the same "
                             "secret and that nothing else writes to the store"));
  };
  if (record.size() < sizeof kMagic + kMac) throw refuse("too short to carry a MAC");
  if (std::memcmp(record.data(), kMagic, sizeof kMagic) != 0) throw refuse("no MAC header");
  const uint8_t* value = record.data() + sizeof kMagic + kMac;
  const size_t n = record.size() - sizeof kMagic - kMac;
  const auto m = mac(secret_, key, value, n);
  if (!equal_ct(m.data(), record.data() + sizeof kMagic, kMac)) throw refuse("MAC mismatch");
  return std::vector<uint8_t>(value, value + n);
}

void AuthStore::set(const std::string& key, const std::vector<uint8_t>& value) {
  base_->set(key, seal(key, value));
}

std::vector<uint8_t> AuthStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return open(key, base_->get(key, timeout));
}

std::optional<std::string> store_token_from_env() {
  const char* token = std::getenv("FASTCOMMS_STORE_TOKEN");
  const char* file = std::getenv("FASTCOMMS_STORE_TOKEN_FILE");
  const bool has_token = token != nullptr && *token != 0;
  const bool has_file = file != nullptr && *file != 0;
  FASTCOMMS_CHECK(!(has_token && has_file), kInvalidArgument,
                  "set FASTCOMMS_STORE_TOKEN or FASTCOMMS_STORE_TOKEN_FILE, not both");
  if (has_token) return std::string(token);
  if (!has_file) return std::nullopt;
  struct stat st {};
  FASTCOMMS_CHECK(::stat(file, &st) == 0 && S_ISREG(st.st_mode), kInvalidArgument,
                  "FASTCOMMS_STORE_TOKEN_FILE: '", file, "' is not a regular file");
  FASTCOMMS_CHECK(st.st_uid == ::getuid() && (st.st_mode & (S_IRWXG | S_IRWXO)) == 0,
                  kInvalidArgument, "FASTCOMMS_STORE_TOKEN_FILE: '", file,
                  "' must belong to this user and be readable by no one else (chmod 600)");
  std::ifstream in(file, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string s = ss.str();
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  FASTCOMMS_CHECK(!s.empty(), kInvalidArgument, "FASTCOMMS_STORE_TOKEN_FILE: '", file,
                  "' is empty");
  return s;
}

}  // namespace fastcomms
