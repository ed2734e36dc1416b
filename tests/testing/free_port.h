// A free loopback port for rendezvous URLs, which cannot say "pick one": every rank
// must know the port in advance. (Racy in principle; fine on a test machine.) Tests
// call this; the search itself is base/net.h's free_port().
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "base/net.h"

namespace ferry::testing {

// 0 when no port could be found: the test then fails where it uses the port.
inline uint16_t free_port() {
  absl::StatusOr<uint16_t> port = internal::free_port();
  return port.ok() ? *port : 0;
}

}  // namespace ferry::testing
