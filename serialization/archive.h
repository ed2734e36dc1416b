// File: serialization/archive.h
//
// The cereal archives ferry's payloads are written with. PayloadWriter appends a
// compact binary encoding to a Message's buffer; PayloadReader reads one back,
// checking every length against the bytes that are there, so a truncated or hostile
// payload is an error, never a crash or a huge allocation. Any type cereal can
// serialize works: scalars, std::string, std::vector, std::map, std::optional,
// std::tuple (include the matching cereal/types/*.hpp, or serialization/types.h for
// all of them) and user structs with a `serialize` method.
//
// Tensors inside the values are not copied into the payload: each goes into the
// message's tensor table and travels out of band (as a TensorPipe tensor, received
// into a buffer allocated once), and the payload records its dtype, shape and table
// index. Small CPU tensors (at most inline_threshold bytes) are cheaper inside the
// payload, so they are written inline.
//
//   Message m(MessageType::kResponse, id);
//   { PayloadWriter w(m); w(result); }
//   absl::StatusOr<std::tuple<int64_t, Tensor>> v = read_payload<int64_t, Tensor>(m);
#pragma once

#include <array>
#include <cstdint>
#include <cstring>
#include <deque>
#include <exception>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cereal/cereal.hpp"
#include "serialization/message.h"
#include "tensor/tensor.h"

namespace ferry {

// The largest message (payload plus tensors) a peer may announce before anything is
// allocated to receive it (see check_message_size). 16 GiB: far above any one RPC a
// rendezvous-sized job sends, far below what would exhaust a host.
inline constexpr uint64_t kDefaultMaxMessageBytes = uint64_t{16} << 30;

// The process's limit: FERRY_MAX_MESSAGE_BYTES if set (a byte count, at least 1 MiB),
// else kDefaultMaxMessageBytes. Read once; a malformed value logs a warning and the
// default applies.
uint64_t max_message_bytes();

// Checks what a peer announced for one message before any receive buffer is
// allocated: the payload's length and every tensor's byte length, whose sum (computed
// without overflow) must not exceed `limit`. kResourceExhausted names the sum, the
// largest tensor and the limit; the caller should then close that pipe.
//
//   FERRY_RETURN_IF_ERROR(check_message_size(payload_length, tensor_lengths));
[[nodiscard]] absl::Status check_message_size(uint64_t payload_bytes, std::span<const uint64_t> tensor_bytes,
                                              uint64_t limit = max_message_bytes());

// Tensors of at most this many bytes travel inside the payload (see
// docs/performance.md for how it was chosen).
inline constexpr size_t kDefaultInlineTensorBytes = 16 * 1024;

// The process's threshold: FERRY_INLINE_TENSOR_BYTES if set (0: every tensor out of
// band), else kDefaultInlineTensorBytes. Read once.
size_t inline_tensor_bytes();

// Writes values into a Message: bytes to its buffer, tensors to its tensor table.
// Thread-compatible; one writer per message at a time.
class PayloadWriter : public cereal::OutputArchive<PayloadWriter, cereal::AllowEmptyClassElision> {
 public:
  explicit PayloadWriter(Message& message, size_t inline_threshold = inline_tensor_bytes())
      : OutputArchive(this), out_(message.buffer()), table_(message.tensors()), inline_threshold_(inline_threshold) {}

  void save_binary(const void* data, size_t size) { out_.append(static_cast<const char*>(data), size); }
  std::vector<Tensor>& table() { return table_; }
  size_t inline_threshold() const { return inline_threshold_; }

 private:
  std::string& out_;
  std::vector<Tensor>& table_;
  size_t inline_threshold_;
};

// Reads values back from a Message. Errors are thrown as cereal::Exception inside
// cereal and turned into absl::Status by read_payload(); use that.
class PayloadReader : public cereal::InputArchive<PayloadReader, cereal::AllowEmptyClassElision> {
 public:
  // Reads from `message`'s payload, starting after any bytes already consumed.
  explicit PayloadReader(const Message& message)
      : InputArchive(this),
        pos_(message.payload().data()),
        end_(message.payload().data() + message.payload().size()),
        table_(message.tensors()) {}

  void load_binary(void* data, size_t size) {
    if (size == 0) return;  // `data` may be null (an empty vector's); memcpy must not see it
    if (size > remaining()) {
      throw cereal::Exception(absl::StrCat("payload truncated: needed ", size, " more bytes, ", remaining(), " left"));
    }
    if (size == 0) return;  // an empty vector's data() may be null, which memcpy must not get
    std::memcpy(data, pos_, size);
    pos_ += size;
  }
  // A length read from the wire; one that exceeds the bytes left cannot be honest.
  // Each element takes at least `min_element_bytes` (at least 1) in the encoding.
  void check_size(uint64_t size, size_t min_element_bytes) const {
    if (min_element_bytes > 0 && size > remaining() / min_element_bytes) {
      throw cereal::Exception(absl::StrCat("payload declares ", size, " elements of at least ", min_element_bytes,
                                           " bytes each but only ", remaining(), " bytes are left"));
    }
  }
  size_t remaining() const { return static_cast<size_t>(end_ - pos_); }
  const char* position() const { return pos_; }
  void skip(size_t n) { pos_ += n; }
  const std::vector<Tensor>& table() const { return table_; }

 private:
  const char* pos_;
  const char* end_;
  const std::vector<Tensor>& table_;
};

// ---- cereal's archive hooks for the two archives (found by argument-dependent lookup).

template <class T>
inline std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_SAVE_FUNCTION_NAME(PayloadWriter& ar, const T& t) {
  ar.save_binary(std::addressof(t), sizeof(t));
}
template <class T>
inline std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_LOAD_FUNCTION_NAME(PayloadReader& ar, T& t) {
  ar.load_binary(std::addressof(t), sizeof(t));
  if constexpr (std::is_same_v<T, bool>) {
    // A bool byte other than 0 or 1 is undefined behaviour to use.
    unsigned char raw;
    std::memcpy(&raw, &t, 1);
    if (raw > 1) throw cereal::Exception("payload holds an invalid bool byte");
  }
}
template <class Archive, class T>
inline std::enable_if_t<std::is_same_v<Archive, PayloadWriter> || std::is_same_v<Archive, PayloadReader>>
CEREAL_SERIALIZE_FUNCTION_NAME(Archive& ar, cereal::NameValuePair<T>& t) {
  ar(t.value);
}
template <class T>
inline void CEREAL_SAVE_FUNCTION_NAME(PayloadWriter& ar, const cereal::SizeTag<T>& t) {
  uint64_t size = static_cast<uint64_t>(t.size);
  ar.save_binary(&size, sizeof(size));
}
template <class T>
inline void CEREAL_LOAD_FUNCTION_NAME(PayloadReader& ar, cereal::SizeTag<T>& t) {
  uint64_t size = 0;
  ar.load_binary(&size, sizeof(size));
  // Every container element takes at least a byte in this encoding, except empty
  // classes, which ferry's payloads do not send in bulk.
  ar.check_size(size, 1);
  t.size = static_cast<std::remove_reference_t<T>>(size);
}
// ---- The fewest bytes a value of a type takes in a payload: a count read from the
// wire is checked against the bytes left times this before a container is sized.

namespace internal {
template <typename T, typename = void>
struct MinEncodedBytes {
  // Unknown types (user structs) may encode in no bytes at all (an empty struct):
  // counted as one, so a count still cannot exceed the bytes left.
  static constexpr size_t value = 1;
};
template <typename T>
struct MinEncodedBytes<T, std::enable_if_t<std::is_arithmetic_v<T>>> {
  static constexpr size_t value = sizeof(T);
};
template <typename T>
inline constexpr size_t kMinEncodedBytes = MinEncodedBytes<T>::value;
// Containers: their 8-byte size tag.
template <typename C, typename Tr, typename A>
struct MinEncodedBytes<std::basic_string<C, Tr, A>> : std::integral_constant<size_t, 8> {};
template <typename T, typename A>
struct MinEncodedBytes<std::vector<T, A>> : std::integral_constant<size_t, 8> {};
template <typename T, typename A>
struct MinEncodedBytes<std::deque<T, A>> : std::integral_constant<size_t, 8> {};
template <typename T, typename A>
struct MinEncodedBytes<std::list<T, A>> : std::integral_constant<size_t, 8> {};
template <typename K, typename V, typename C, typename A>
struct MinEncodedBytes<std::map<K, V, C, A>> : std::integral_constant<size_t, 8> {};
template <typename K, typename V, typename H, typename E, typename A>
struct MinEncodedBytes<std::unordered_map<K, V, H, E, A>> : std::integral_constant<size_t, 8> {};
template <typename K, typename C, typename A>
struct MinEncodedBytes<std::set<K, C, A>> : std::integral_constant<size_t, 8> {};
template <typename K, typename H, typename E, typename A>
struct MinEncodedBytes<std::unordered_set<K, H, E, A>> : std::integral_constant<size_t, 8> {};
// An optional's engaged flag; a tensor's form byte.
template <typename T>
struct MinEncodedBytes<std::optional<T>> : std::integral_constant<size_t, 1> {};
template <>
struct MinEncodedBytes<Tensor> : std::integral_constant<size_t, 1> {};
template <typename A, typename B>
struct MinEncodedBytes<std::pair<A, B>> : std::integral_constant<size_t, kMinEncodedBytes<A> + kMinEncodedBytes<B>> {};
template <typename... Ts>
struct MinEncodedBytes<std::tuple<Ts...>> : std::integral_constant<size_t, (size_t{0} + ... + kMinEncodedBytes<Ts>)> {};
template <typename T, size_t N>
struct MinEncodedBytes<std::array<T, N>> : std::integral_constant<size_t, N * kMinEncodedBytes<T>> {};
}  // namespace internal

// How much memory a vector's load reserves up front, at most: beyond it the vector
// grows as its elements decode.
inline constexpr size_t kMaxVectorReserveBytes = size_t{1} << 20;

// Vectors (the container payloads use most, and the one cereal sizes up front) check
// their count against the element type's smallest encoding first. Arithmetic elements
// then take exactly their encoding, so the vector is sized at once; any other element
// may encode in far fewer bytes than sizeof(T) (a Tensor, an optional or a user struct
// in one), so the vector grows as elements decode, and a count the bytes do not back
// fails at the first bad element with memory in proportion to what was present.
template <class T, class A>
  requires(!std::is_same_v<T, bool>)
inline void CEREAL_LOAD_FUNCTION_NAME(PayloadReader& ar, std::vector<T, A>& v) {
  uint64_t n = 0;
  ar.load_binary(&n, sizeof(n));
  ar.check_size(n, std::max<size_t>(internal::kMinEncodedBytes<T>, 1));
  v.clear();
  if constexpr (std::is_arithmetic_v<T>) {
    v.resize(static_cast<size_t>(n));
    ar.load_binary(v.data(), static_cast<size_t>(n) * sizeof(T));
  } else {
    v.reserve(static_cast<size_t>(std::min<uint64_t>(n, std::max<size_t>(kMaxVectorReserveBytes / sizeof(T), 1))));
    for (uint64_t i = 0; i < n; ++i) ar(v.emplace_back());
  }
}

template <class T>
inline void CEREAL_SAVE_FUNCTION_NAME(PayloadWriter& ar, const cereal::BinaryData<T>& bd) {
  ar.save_binary(bd.data, static_cast<size_t>(bd.size));
}
template <class T>
inline void CEREAL_LOAD_FUNCTION_NAME(PayloadReader& ar, cereal::BinaryData<T>& bd) {
  ar.load_binary(bd.data, static_cast<size_t>(bd.size));
}

// ---- Tensor.

namespace internal {
void save_tensor(PayloadWriter& ar, const Tensor& t);
void load_tensor(PayloadReader& ar, Tensor& t);
}  // namespace internal

inline void CEREAL_SAVE_FUNCTION_NAME(PayloadWriter& ar, const Tensor& t) { internal::save_tensor(ar, t); }
inline void CEREAL_LOAD_FUNCTION_NAME(PayloadReader& ar, Tensor& t) { internal::load_tensor(ar, t); }

// Converts what escapes cereal while reading into a status naming `what`.
template <typename Fn>
absl::Status read_guarded(std::string_view what, Fn&& fn) {
  try {
    fn();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("cannot decode ", std::string(what), ": ", e.what()));
  }
}

// Reads values of the given types from the start of `message`'s payload and checks
// that nothing is left over.
template <typename... Ts>
absl::StatusOr<std::tuple<Ts...>> read_payload(const Message& message, std::string_view what = "payload") {
  std::tuple<Ts...> values;
  absl::Status s = read_guarded(what, [&] {
    PayloadReader reader(message);
    std::apply([&](auto&... v) { (reader(v), ...); }, values);
    if (reader.remaining() != 0) {
      throw cereal::Exception(absl::StrCat(reader.remaining(), " unexpected bytes after the last value"));
    }
  });
  if (!s.ok()) return s;
  return values;
}

}  // namespace ferry

CEREAL_REGISTER_ARCHIVE(ferry::PayloadWriter)
CEREAL_REGISTER_ARCHIVE(ferry::PayloadReader)
CEREAL_SETUP_ARCHIVE_TRAITS(ferry::PayloadReader, ferry::PayloadWriter)
