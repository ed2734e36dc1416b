#include "base/logging.h"

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <string>

#include <unistd.h>

namespace ferry {
namespace {

LogLevel level_from_env() {
  const char* text = std::getenv("FERRY_LOG_LEVEL");
  LogLevel level = LogLevel::kWarning;
  if (text != nullptr && !parse_log_level(text, &level)) {
    std::fprintf(stderr,
                 "ferry: FERRY_LOG_LEVEL=%s is not a level (expected debug, info, "
                 "warning, error or off); using warning\n",
                 text);
  }
  return level;
}

std::atomic<int>& level_storage() {
  static std::atomic<int> level{static_cast<int>(level_from_env())};
  return level;
}

const char* level_letter(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return "D";
    case LogLevel::kInfo: return "I";
    case LogLevel::kWarning: return "W";
    case LogLevel::kError: return "E";
    case LogLevel::kOff: return "-";
  }
  return "?";
}

}  // namespace

LogLevel log_level() { return static_cast<LogLevel>(level_storage().load(std::memory_order_relaxed)); }

void set_log_level(LogLevel level) { level_storage().store(static_cast<int>(level)); }

bool parse_log_level(std::string_view text, LogLevel* level) {
  std::string lower;
  for (char c : text) lower.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
  if (lower == "debug") *level = LogLevel::kDebug;
  else if (lower == "info") *level = LogLevel::kInfo;
  else if (lower == "warning" || lower == "warn") *level = LogLevel::kWarning;
  else if (lower == "error") *level = LogLevel::kError;
  else if (lower == "off" || lower == "none") *level = LogLevel::kOff;
  else return false;
  return true;
}

namespace internal {

LogLine::LogLine(LogLevel level, const char* file, int line, bool fatal)
    : level_(level), fatal_(fatal) {
  const char* base = file;
  for (const char* p = file; *p != '\0'; ++p) {
    if (*p == '/') base = p + 1;
  }
  auto now = std::chrono::system_clock::now();
  std::time_t secs = std::chrono::system_clock::to_time_t(now);
  auto micros = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
  std::tm tm{};
  localtime_r(&secs, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof(stamp), "%H:%M:%S", &tm);
  stream_ << "[ferry " << level_letter(level_) << " " << stamp << "." << micros << " pid " << getpid()
          << " " << base << ":" << line << "] ";
}

LogLine::~LogLine() {
  stream_ << '\n';
  std::string text = stream_.str();
  // One write call per line so concurrent lines do not interleave.
  std::fwrite(text.data(), 1, text.size(), stderr);
  if (fatal_) {
    std::fflush(stderr);
    std::abort();
  }
}

}  // namespace internal
}  // namespace ferry
