#include "process_group/internal/gloo_errors.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "base/logging.h"

namespace ferry::internal::pg {

std::string strip_location(std::string_view text) {
  std::string out(text);
  while (!out.empty() && out[0] == '[') {
    size_t close = out.find("] ");
    if (close == std::string::npos) break;
    std::string_view inside(out.data() + 1, close - 1);
    if (inside.find(':') == std::string_view::npos) break;
    out.erase(0, close + 2);
  }
  return out;
}

bool looks_like_timeout(std::string_view text) {
  const std::string lower = absl::AsciiStrToLower(internal::av(text));
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

absl::Status status_from_exception(std::string_view what, std::string_view context, std::string_view raw,
                                   bool io_error) {
  FERRY_LOG(INFO) << what << " (" << context << "): gloo error: " << raw;
  std::string text = strip_location(raw);
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (looks_like_timeout(text)) {
    code = absl::StatusCode::kDeadlineExceeded;
  } else if (io_error) {
    code = absl::StatusCode::kUnavailable;
  }
  return absl::Status(code, absl::StrCat(internal::av(what), " (", internal::av(context), "): ", text));
}

}  // namespace ferry::internal::pg
