// File: serialization/request_name.h
//
// What a request calls, read without decoding its payload.
//
//   std::string_view fn = request_name(message);   // "add", or "?"
#pragma once

#include <cstddef>
#include <string_view>

#include "serialization/message.h"

namespace ferry {

// The name of what a kRequest calls. Every request's payload opens with it, written as
// cereal writes a std::string (a size tag, then the bytes): rpc/ puts the function's
// name there (rpc/call.h), its own protocols theirs. It is part of the message's
// contract, not of one layer's payload, so that a layer below rpc/ (the agent core's
// statistics and traces) can name a call without knowing the rest of the payload.
// A view into `request`'s buffer; "?" when it is not a kRequest or does not open with
// a name of 1 to kMaxRequestName bytes.
inline constexpr size_t kMaxRequestName = 256;
std::string_view request_name(const Message& request);

}  // namespace ferry
