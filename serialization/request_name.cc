#include "serialization/request_name.h"

#include <cstdint>
#include <cstring>

namespace ferry {

std::string_view request_name(const Message& request) {
  if (request.type() != MessageType::kRequest) return "?";
  const std::string_view payload = request.payload();
  uint64_t size = 0;  // cereal's size_type
  if (payload.size() < sizeof(size)) return "?";
  std::memcpy(&size, payload.data(), sizeof(size));
  if (size == 0 || size > kMaxRequestName || size > payload.size() - sizeof(size)) return "?";
  return payload.substr(sizeof(size), size);
}

}  // namespace ferry
