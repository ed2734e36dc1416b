// File: agents/ring/options.h
//
// RingOptions: the ring transport's settings (agents/ring/factory.h), and validate(),
// which checks them as given. Every field left unset takes its default from a
// FERRY_RING_* variable when the transport is made, else the value its comment says.
//
//   RingOptions options{.ring_bytes = 1 << 20};
//   FERRY_RETURN_IF_ERROR(validate(options));
#pragma once

#include <chrono>
#include <cstddef>
#include <optional>

#include "absl/status/status.h"

namespace ferry {

// Plain values; copied into the transport, which keeps no reference to them.
struct RingOptions {
  // Bytes of each direction's ring: a power of two in [4 KiB, 1 GiB]. Unset (0):
  // FERRY_RING_KB, else 256 KiB.
  size_t ring_bytes = 0;
  // Tensors at least this large are read in place from the sender when the peer allows
  // it; smaller ones are copied through the ring. A read in place runs on a reader
  // thread, and on the 2-core machine handing it there and back cost more than the
  // copy up to a few MiB (echo, same run: 64 KiB 18 us by copy, 91 us in place; 1 MiB
  // 289 and 241 us; 16 MiB 3.0 and 2.3 ms; 64 MiB 14.6 and 12.2 ms). Unset (0):
  // FERRY_RING_IN_PLACE_KB, else 4 MiB. SIZE_MAX: never.
  size_t in_place_bytes = 0;
  // Bytes of tensors one connection holds for its peer to read in place, until the
  // peer acknowledges them: while it holds this many, the next tensors cross the ring
  // by copy, so a peer that never acknowledges costs at most this (and one message).
  // Unset (0): FERRY_RING_HELD_MB, else 64 MiB.
  size_t max_held_bytes = 0;
  // With at least this many connections, a poll reads only the rings whose peer
  // announced something new (a bit in this worker's bell) instead of checking every
  // ring: 256 workers on one host each have 510. Unset (0): 16. 1: always.
  size_t news_from = 0;
  // A tensor read in place of at least this many bytes is read by two threads at once,
  // each copying half, while the host is not crowded: one thread's copy is bound by the
  // core, not the memory. Unset (0): FERRY_RING_SPLIT_KB, else 8 MiB. SIZE_MAX: never.
  size_t split_bytes = 0;
  // Whether a connection a peer opened carries this worker's calls to that peer too
  // (Connection::carries_calls_to), so that two workers calling each other share one
  // connection instead of opening two. Unset: FERRY_RING_TWO_WAY (0 or 1), else yes.
  std::optional<bool> two_way = std::nullopt;
  // Whether processes of other users may connect (and be connected to). The ring's
  // socket lives in the network namespace, where any local user can reach it, and a
  // connection maps shared memory: by default only this worker's own user and root
  // get past the ring's hello. Set it for a job that spans users; the job token then
  // decides who is let in. Unset: FERRY_RING_ANY_USER (0 or 1), else no.
  std::optional<bool> any_user = std::nullopt;
  // How long a socket that connected may take to say its hello (a connector sends it
  // at once) before it is closed. Unset (0): 5 s.
  std::chrono::milliseconds hello_timeout{0};
  // How long a tensor read in place from a peer (process_vm_readv, on a reader thread)
  // may go without progress before the connection is closed, naming the peer: its
  // memory may never answer (a userfaultfd region nobody serves, a mapped file on
  // storage that stalls). Reads go in chunks of 16 MiB, so this bounds each chunk,
  // not a whole tensor. Unset (0): 5 s.
  std::chrono::milliseconds in_place_read_timeout{0};
};

// Checks `options` as given (before defaults): kInvalidArgument saying what was wrong.
absl::Status validate(const RingOptions& options);

}  // namespace ferry
