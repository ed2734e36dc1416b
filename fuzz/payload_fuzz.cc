// Fuzzes the wire decoders an RPC message meets: Message::parse, the payload reader
// over the value types calls use (strings, containers, optionals, tuples, tensors
// inline and through the tensor table), error payloads, and the per-message size
// check. The first byte picks the shape; the rest is the sealed message. fuzz/run.sh
// passes -max_len=1048576, so counts reach past a vector's up-front reserve.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "serialization/archive.h"
#include "serialization/error.h"
#include "serialization/message.h"
#include "serialization/types.h"

namespace {

struct Point {
  int32_t x = 0;
  double y = 0;
  std::vector<std::string> tags;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(x, y, tags);
  }
};

// Large in memory, one byte on the wire: a vector of these must grow as elements
// decode, never be sized from its count up front (issue 27, finding 4). `made` counts
// default constructions, `read` elements decoded.
struct Bulky {
  static inline size_t made = 0;
  static inline size_t read = 0;
  bool flag = false;
  char pad[512] = {};
  Bulky() { ++made; }
  template <class Archive>
  void serialize(Archive& ar) {
    ar(flag);
    ++read;
  }
};

template <typename... Ts>
void decode(const ferry::Message& m) {
  auto v = ferry::read_payload<Ts...>(m);
  (void)v;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t shape = data[0];
  std::string wire(reinterpret_cast<const char*>(data + 1), size - 1);
  // Received tensors: none, or two small buffers the table may name.
  std::vector<ferry::Tensor> tensors;
  if (shape & 0x80) {
    tensors.push_back(*ferry::Tensor::zeros({16}, ferry::DType::kUInt8));
    tensors.push_back(*ferry::Tensor::zeros({2, 3}, ferry::DType::kFloat32));
  }
  std::vector<uint64_t> lengths;
  for (size_t i = 0; i + 8 <= wire.size() && i < 64; i += 8) {
    uint64_t v;
    std::memcpy(&v, wire.data() + i, 8);
    lengths.push_back(v);
  }
  (void)ferry::check_message_size(wire.size(), lengths, uint64_t{1} << 30);

  absl::StatusOr<ferry::Message> m = ferry::Message::parse(std::move(wire), std::move(tensors));
  if (!m.ok()) return 0;
  switch (shape & 0x0f) {
    case 0: decode<std::string, int64_t>(*m); break;
    case 1: decode<std::vector<std::string>>(*m); break;
    case 2: decode<std::map<std::string, std::vector<int32_t>>>(*m); break;
    case 3: decode<ferry::Tensor>(*m); break;
    case 4: decode<std::tuple<ferry::Tensor, std::vector<ferry::Tensor>>>(*m); break;
    case 5: decode<std::optional<std::vector<double>>, bool>(*m); break;
    case 6: decode<std::vector<Point>>(*m); break;
    case 7: decode<std::unordered_map<std::string, std::pair<int64_t, std::string>>>(*m); break;
    case 8: decode<std::vector<std::vector<std::vector<uint8_t>>>>(*m); break;
    case 9: decode<std::array<int16_t, 4>, std::vector<bool>>(*m); break;
    case 10: {
      Bulky::made = Bulky::read = 0;
      decode<std::vector<Bulky>>(*m);
      // At most the one that failed to decode was made beyond those decoded.
      if (Bulky::made > Bulky::read + 1) {
        std::fprintf(stderr, "a vector made %zu elements for %zu decoded\n", Bulky::made, Bulky::read);
        std::abort();
      }
      break;
    }
    default: (void)ferry::error_from_message(*m); break;
  }
  return 0;
}
