#include "store/internal/store_util.h"

#include <cstdio>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry::internal {

namespace {
constexpr size_t kMaxQuotedKeyBytes = 200;
}  // namespace

std::string quote_key(std::string_view key) {
  std::string out = "'";
  size_t n = std::min(key.size(), kMaxQuotedKeyBytes);
  for (size_t i = 0; i < n; ++i) {
    unsigned char c = static_cast<unsigned char>(key[i]);
    if (c == '\'' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    }
  }
  out += '\'';
  if (n < key.size()) absl::StrAppend(&out, "... (", key.size(), " bytes)");
  return out;
}

std::string describe_keys(const std::vector<std::string>& keys) {
  std::string out = keys.size() == 1 ? "key " : "keys ";
  for (size_t i = 0; i < keys.size(); ++i) {
    if (i > 0) out += ", ";
    out += quote_key(keys[i]);
  }
  return out;
}

absl::Status wait_timeout_error(std::string_view op, const std::vector<std::string>& missing,
                                std::chrono::milliseconds waited) {
  return absl::DeadlineExceededError(absl::StrCat("store ", av(op), ": timed out after ", waited.count(),
                                                  " ms waiting for ", describe_keys(missing)));
}

absl::StatusOr<int64_t> parse_counter(std::string_view key, const Bytes& value) {
  int64_t out = 0;
  std::string text(value.begin(), value.end());
  if (!absl::SimpleAtoi(text, &out)) {
    std::string shown = quote_key(text);
    return absl::InvalidArgumentError(absl::StrCat("store add: key ", quote_key(key),
                                                   " holds a value that is not a counter (expected a decimal "
                                                   "integer, found ",
                                                   shown, ")"));
  }
  return out;
}

Bytes format_counter(int64_t value) { return to_bytes(std::to_string(value)); }

absl::StatusOr<int64_t> add_counter(std::string_view key, int64_t value, int64_t delta) {
  int64_t out = 0;
  if (__builtin_add_overflow(value, delta, &out)) {
    return absl::OutOfRangeError(absl::StrCat("store add: key ", quote_key(key), " would overflow: ", value, " + ",
                                              delta, " does not fit in 64 bits"));
  }
  return out;
}

absl::Status multi_set_size_error(size_t keys, size_t values) {
  return absl::InvalidArgumentError(
      absl::StrCat("store multi_set: expected as many values as keys, got ", keys, " keys and ", values, " values"));
}

std::chrono::milliseconds elapsed_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
}

}  // namespace ferry::internal
