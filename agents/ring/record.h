// File: agents/ring/record.h (not installed)
//
// A ring worker's address record, the line it publishes for peers:
// "ring ring://<scope>/<socket>?probe=<pid>.<addr>.<value>" (hex), where the scope is
// the host's boot and network namespace (host_scope()) and the probe is a value at an
// address in the worker's memory that a peer reads to learn whether it can read that
// worker's tensors in place. Thread-safe; host_scope() reads /proc once per process.
//
//   RingRecord r;
//   if (parse_record(address, r) && r.scope == host_scope()) ...;  // reachable
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

namespace ferry::internal::ring {

// What a worker's ring record says.
struct RingRecord {
  std::string scope;
  std::string socket;
  pid_t pid = 0;
  uint64_t probe_addr = 0;
  uint64_t probe_value = 0;
};

// What makes two workers able to reach each other's abstract sockets: the same boot of
// the same host and the same network namespace.
const std::string& host_scope();

// The record of a worker listening on `socket`, in process `pid`, whose probe is
// `*probe` (read now; the worker keeps it there for as long as it listens). Ends in '\n'.
std::string record_line(const std::string& socket, pid_t pid, const uint64_t* probe);

// The ring line of `address` (a record of one or several transports' lines), if it
// has a well-formed one.
bool parse_record(const std::string& address, RingRecord& r);

}  // namespace ferry::internal::ring
