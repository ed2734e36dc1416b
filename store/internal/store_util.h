// Helpers shared by ferry's store implementations: counter encoding, error text.
// Internal: not installed, not for use outside store/.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "store/store.h"

namespace ferry::internal {

// `key` quoted for an error message, with unprintable bytes escaped, and shortened
// when long so that a huge key cannot flood a log.
std::string quote_key(std::string_view key);
// "key 'a'" or "keys 'a', 'b'".
std::string describe_keys(const std::vector<std::string>& keys);

// The kDeadlineExceeded error of a blocking operation: names the op, the keys still
// missing and how long it waited.
absl::Status wait_timeout_error(std::string_view op, const std::vector<std::string>& missing,
                                std::chrono::milliseconds waited);

// Counters are stored as decimal text (so `get` of a counter reads naturally and other
// tools can parse it). A missing key counts as 0.
absl::StatusOr<int64_t> parse_counter(std::string_view key, const Bytes& value);
Bytes format_counter(int64_t value);
// value + delta, or kOutOfRange on overflow.
absl::StatusOr<int64_t> add_counter(std::string_view key, int64_t value, int64_t delta);

absl::Status multi_set_size_error(size_t keys, size_t values);

// Milliseconds since `start` on the steady clock, rounded down.
std::chrono::milliseconds elapsed_since(std::chrono::steady_clock::time_point start);

}  // namespace ferry::internal
