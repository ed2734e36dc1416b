// File: agents/core/records.h (not installed)
//
// The records the TENSORPIPE init handler and its dynamic groups keep in the store or
// send as control payloads: one cereal value in a sealed Message, so every length in
// it is bounds-checked on the way back.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "base/status.h"
#include "serialization/archive.h"
#include "serialization/message.h"
#include "store/store.h"

namespace ferry::internal {

template <typename T>
Bytes encode_record(const T& value) {
  Message m(MessageType::kResponse, 0);
  {
    PayloadWriter w(m);
    w(value);
  }
  std::string s = m.seal();
  return Bytes(s.begin(), s.end());
}

// Errors: a record that does not parse as a T, naming `what`.
template <typename T>
absl::StatusOr<T> decode_record(const Bytes& bytes, const char* what) {
  FERRY_ASSIGN_OR_RETURN(Message m, Message::parse(std::string(bytes.begin(), bytes.end()), {}));
  FERRY_ASSIGN_OR_RETURN(auto values, read_payload<T>(m, what));
  return std::get<0>(std::move(values));
}

}  // namespace ferry::internal
