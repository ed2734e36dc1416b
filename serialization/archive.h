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

#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "cereal/cereal.hpp"
#include "serialization/message.h"
#include "tensor/tensor.h"

namespace ferry {

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
    if (size > remaining()) {
      throw cereal::Exception(absl::StrCat("payload truncated: needed ", size, " more bytes, ", remaining(), " left"));
    }
    if (size == 0) return;  // an empty vector's data() may be null, which memcpy must not get
    std::memcpy(data, pos_, size);
    pos_ += size;
  }
  // A length read from the wire; one that exceeds the bytes left cannot be honest.
  void check_size(uint64_t size, size_t min_element_bytes) const {
    if (min_element_bytes > 0 && size > remaining() / min_element_bytes) {
      throw cereal::Exception(
          absl::StrCat("payload declares ", size, " elements but only ", remaining(), " bytes are left"));
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
