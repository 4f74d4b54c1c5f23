// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// NOTE [authenticated rendezvous]: with a shared secret (FASTCOMMS_STORE_TOKEN, or
/// FASTCOMMS_STORE_TOKEN_FILE naming a file only its owner may read or write) every value a
/// communicator writes to its rendezvous store carries an HMAC-SHA256 over the full key and the
/// value, and every value it reads is checked before use: a value a process without the secret
/// planted, one copied from another key, or one left by an earlier incarnation of the name (its
/// keys differ, NOTE [store incarnations]) is refused with a clear error instead of being
/// trusted (an address to connect to, an NCCL id, an IPC handle). Not covered: the integer
/// counters of add() (the store computes them; a forged one can only make the rendezvous fail)
/// and anyone who can read the secret. Built with OpenSSL's libcrypto; without it a token is
/// refused at communicator creation.

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fastcomms/core/store.hpp"

namespace fastcomms {

/// A store whose values are authenticated with a shared secret (NOTE [authenticated
/// rendezvous]). add(), check(), delete_key() and wait() pass through.
class AuthStore : public ForwardingStore {
 public:
  /// @param base the store values land in
  /// @param secret the shared secret (non-empty)
  AuthStore(std::shared_ptr<Store> base, std::string secret);
  using Store::get;
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key, std::chrono::milliseconds timeout) override;

  /// The payload of an authenticated record `record` read at `key`, or kInvalidArgument naming
  /// the key when it is not one this secret made (exposed for the fuzz target).
  std::vector<uint8_t> open(const std::string& key, const std::vector<uint8_t>& record) const;
  /// The record set() writes for `value` at `key`.
  std::vector<uint8_t> seal(const std::string& key, const std::vector<uint8_t>& value) const;

 private:
  std::string secret_;
};

/// True when `record` looks like what AuthStore::seal() writes (its header; no MAC check): how a
/// rank without the secret recognizes a peer that has one.
bool looks_sealed(const std::vector<uint8_t>& record);

/// True when this build can authenticate (OpenSSL was found).
bool auth_store_available();

/// The shared secret from FASTCOMMS_STORE_TOKEN or FASTCOMMS_STORE_TOKEN_FILE (nullopt when
/// neither is set). The file must be a regular file that only its owner (this user) may read or
/// write; both set, or an empty secret, is an error.
std::optional<std::string> store_token_from_env();

}  // namespace fastcomms
