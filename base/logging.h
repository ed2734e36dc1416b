// File: base/logging.h
//
// A small leveled logger. The level comes from the environment variable
// FERRY_LOG_LEVEL (debug, info, warning, error, off; default warning), read once.
// Lines go to stderr whole, so lines from several threads never interleave.
//
//   FERRY_LOG(INFO) << "listening on " << address;
//
// FERRY_CHECK(cond) aborts with a message when an internal invariant is broken; it
// is never used for user input, which gets an absl::Status instead.
#pragma once

#include <sstream>
#include <string_view>

namespace ferry {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarning = 2, kError = 3, kOff = 4 };

// The process's level, parsed from FERRY_LOG_LEVEL on first use. Thread-safe.
LogLevel log_level();
// Overrides the level (tests, tools). Thread-safe.
void set_log_level(LogLevel level);
// Parses "debug", "info", "warning", "error" or "off" (case-insensitive); false if unknown.
bool parse_log_level(std::string_view text, LogLevel* level);

namespace internal {

// Accumulates one log line and writes it to stderr when destroyed.
class LogLine {
 public:
  LogLine(LogLevel level, const char* file, int line, bool fatal = false);
  ~LogLine();
  LogLine(const LogLine&) = delete;
  LogLine& operator=(const LogLine&) = delete;
  std::ostream& stream() { return stream_; }

 private:
  LogLevel level_;
  bool fatal_;
  std::ostringstream stream_;
};

// Swallows the stream expression of a disabled log statement.
struct LogVoidify {
  void operator&(std::ostream&) {}
};

}  // namespace internal
}  // namespace ferry

#define FERRY_LOG_LEVEL_DEBUG ::ferry::LogLevel::kDebug
#define FERRY_LOG_LEVEL_INFO ::ferry::LogLevel::kInfo
#define FERRY_LOG_LEVEL_WARNING ::ferry::LogLevel::kWarning
#define FERRY_LOG_LEVEL_ERROR ::ferry::LogLevel::kError

#define FERRY_LOG(severity)                                        \
  (FERRY_LOG_LEVEL_##severity < ::ferry::log_level())              \
      ? (void)0                                                    \
      : ::ferry::internal::LogVoidify() &                          \
            ::ferry::internal::LogLine(FERRY_LOG_LEVEL_##severity, \
                                       __FILE__, __LINE__)         \
                .stream()

#define FERRY_CHECK(cond)                                                      \
  (cond) ? (void)0                                                             \
         : ::ferry::internal::LogVoidify() &                                   \
               ::ferry::internal::LogLine(::ferry::LogLevel::kError, __FILE__, \
                                          __LINE__, /*fatal=*/true)            \
                       .stream()                                               \
                   << "check failed: " #cond " "

#ifdef NDEBUG
#define FERRY_DCHECK(cond) \
  while (false) FERRY_CHECK(cond)
#else
#define FERRY_DCHECK(cond) FERRY_CHECK(cond)
#endif
