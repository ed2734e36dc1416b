#include "serialization/error.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "serialization/types.h"

namespace ferry {

Message make_error_message(uint64_t id, std::string_view origin_worker, const absl::Status& status) {
  Message m(MessageType::kError, id);
  PayloadWriter w(m);
  w(std::string(origin_worker), static_cast<int32_t>(status.code()), std::string(status.message()));
  return m;
}

absl::Status error_from_message(const Message& message) {
  auto decoded = read_payload<std::string, int32_t, std::string>(message, "error payload");
  if (!decoded.ok()) return absl::DataLossError(decoded.status().message());
  auto& [origin, code, text] = *decoded;
  if (code <= 0 || code > static_cast<int32_t>(absl::StatusCode::kUnauthenticated)) {
    return absl::UnknownError(absl::StrCat("error from ", origin, " with unknown code ", code, ": ", text));
  }
  return absl::Status(static_cast<absl::StatusCode>(code), text);
}

}  // namespace ferry
