// File: serialization/error.h
//
// Errors travel as their own message type, carrying the name of the worker where they
// arose and the absl::Status (code and message), so a remote failure reaches the
// caller's future with the same canonical code it had at its origin.
//
//   Message m = make_error_message(request.id(), "worker1", absl::NotFoundError("..."));
//   absl::Status s = error_from_message(m);   // NOT_FOUND, "..."
#pragma once

#include <cstdint>
#include <string_view>

#include "absl/status/status.h"
#include "serialization/message.h"

namespace ferry {

// An error reply to call `id`. The status must not be OK.
Message make_error_message(uint64_t id, std::string_view origin_worker, const absl::Status& status);

// The status an error message carries. The message is returned as sent (it names the
// origin worker already); a malformed error payload becomes a kDataLoss status.
absl::Status error_from_message(const Message& message);

}  // namespace ferry
