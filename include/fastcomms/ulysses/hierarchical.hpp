// Copyright (c) fastcomms authors. SPDX-License-Identifier: Apache-2.0
#pragma once

/// @file
/// The hierarchical Ulysses all-to-all: a group whose ranks sit on several hosts. The blocks
/// between ranks of one host move over the host's own transport (NVLink peer-to-peer on CUDA), the
/// blocks between hosts over the group's collective backend, both in flight at once.
///
/// NOTE [hierarchical split]: a Ulysses call is a set of per-peer blocks (plan/). Splitting it by
/// host changes no byte's source or destination, only which engine carries it: the local engine
/// runs the peer-to-peer plan restricted to this host's ranks (its `puts` for those peers, at
/// their global offsets), and the remote part packs the collective plan's chunks for the other
/// hosts' ranks into a compact buffer (chunks in rank order, local peers' chunks left out), moves
/// it with one all_to_all_v of bytes whose counts are zero for local peers, and unpacks. So the
/// result is the flat call's, byte for byte, for every mode, split, dtype and kv_replicas.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fastcomms/ulysses/transport.hpp"

namespace fastcomms {

/// Which ranks of a group share a host.
struct HostMap {
  std::vector<int> host_of;  ///< Each rank's host, numbered in order of the hosts' first rank.
  std::vector<int> members;  ///< The ranks on this rank's host, ascending.
  int local_rank = 0;        ///< This rank's index in `members`.
  int hosts = 1;             ///< Hosts in the group.
  int max_per_host = 1;      ///< The most ranks any host holds.
};

/// The host map of `rank` from every rank's host name.
HostMap host_map(const std::vector<std::string>& host_names, int rank);

/// The host map of `rank` from every rank's host index (TransportInit::host_of).
HostMap host_map(const std::vector<int>& host_of, int rank);

/// The share of a collective-path plan that moves between this rank and the peers marked in
/// `include` (NOTE [hierarchical split]): the chunks are compacted in rank order, so the
/// descriptors' send and receive offsets are rebased and the byte counts of the peers left out
/// are zero.
struct ExchangePart {
  std::vector<plan::CopyDesc> pack;    ///< Per peer: input -> compact send buffer (empty: none).
  std::vector<plan::CopyDesc> unpack;  ///< Per peer: compact receive buffer -> output.
  std::vector<int64_t> send_bytes;     ///< Per peer.
  std::vector<int64_t> recv_bytes;     ///< Per peer.
  int64_t send_total = 0;              ///< Bytes of the compact send buffer.
  int64_t recv_total = 0;              ///< Bytes of the compact receive buffer.
};

/// The part of `p` (a collective-path plan) for the peers with include[q] true.
ExchangePart exchange_part(const plan::UlyssesPlan& p, const std::vector<bool>& include);

/// The call key the collective paths pass to the call check (NOTE [call check]): the plan's
/// geometry and the dtype, never 0.
uint64_t ulysses_call_key(const plan::UlyssesPlan& p, DType dtype);

/// A byte all-to-all_v over `comm` (CallOptions: `stream`, `key` as the call key), blocking on
/// CPU, enqueued on CUDA.
ByteExchange comm_exchange(std::shared_ptr<Communicator> comm);

/// This process's host name for the transport choice: FASTCOMMS_HOST_ID when set (tests that
/// split the ranks of one machine into "hosts"), else gethostname().
std::string host_name();

}  // namespace fastcomms
