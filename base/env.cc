#include "base/env.h"

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>

namespace ferry::internal {

std::optional<std::string> env_string(const char* name) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  return std::string(text);
}

int64_t env_int(const char* name, int64_t fallback, int64_t min, int64_t max) {
  std::optional<std::string> text = env_string(name);
  if (!text.has_value()) return fallback;
  errno = 0;
  char* end = nullptr;
  long long v = std::strtoll(text->c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < min || v > max) {
    std::fprintf(stderr, "ferry: %s=%s is not an integer in [%" PRId64 ", %" PRId64 "]; using %" PRId64 "\n", name,
                 text->c_str(), min, max, fallback);
    return fallback;
  }
  return static_cast<int64_t>(v);
}

}  // namespace ferry::internal
