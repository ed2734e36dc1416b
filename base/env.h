// File: base/env.h
//
// ferry's environment knobs, read in one place. Each knob is read once per process
// by whoever defines it; a malformed value is reported once on stderr and the default
// used, so a typo never crashes a worker.
//
//   static const int64_t spin_us = internal::env_int("FERRY_SPIN_US", 50, 0, 1000000);
//
// The knobs: FERRY_LOG_LEVEL (base/logging.h), FERRY_SPIN_US (base/future.h),
// FERRY_SOCKET_IFNAME (base/net.h), FERRY_RECEIVE_CACHE_MB (agents),
// FERRY_INLINE_TENSOR_BYTES (serialization), FERRY_AUTH_TOKEN (base/auth.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace ferry::internal {

// The value of `name`, or nullopt when it is unset or empty.
std::optional<std::string> env_string(const char* name);

// The integer value of `name`, or `fallback` when unset or empty. A value that is not
// an integer in [min, max] is reported on stderr and `fallback` is used.
int64_t env_int(const char* name, int64_t fallback, int64_t min, int64_t max);

}  // namespace ferry::internal
