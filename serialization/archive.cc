#include "serialization/archive.h"

#include "base/env.h"
#include "base/logging.h"
#include "base/status.h"

namespace ferry {

size_t inline_tensor_bytes() {
  static const size_t bytes = static_cast<size_t>(
      internal::env_int("FERRY_INLINE_TENSOR_BYTES", static_cast<int64_t>(kDefaultInlineTensorBytes), 0, 1LL << 30));
  return bytes;
}

uint64_t max_message_bytes() {
  static const uint64_t bytes = static_cast<uint64_t>(internal::env_int(
      "FERRY_MAX_MESSAGE_BYTES", static_cast<int64_t>(kDefaultMaxMessageBytes), 1LL << 20, 1LL << 62));
  return bytes;
}

absl::Status check_message_size(uint64_t payload_bytes, std::span<const uint64_t> tensor_bytes, uint64_t limit) {
  uint64_t total = payload_bytes;
  uint64_t largest = 0;
  size_t largest_index = 0;
  bool overflow = false;
  for (size_t i = 0; i < tensor_bytes.size(); ++i) {
    if (tensor_bytes[i] > largest) {
      largest = tensor_bytes[i];
      largest_index = i;
    }
    if (tensor_bytes[i] > UINT64_MAX - total) {
      overflow = true;
    } else {
      total += tensor_bytes[i];
    }
  }
  if (!overflow && total <= limit) return absl::OkStatus();
  std::string biggest =
      tensor_bytes.empty() ? "" : absl::StrCat("; its largest tensor (#", largest_index, ") has ", largest, " bytes");
  return absl::ResourceExhaustedError(absl::StrCat(
      "message announces ", overflow ? std::string("more than 2^64") : absl::StrCat(total), " bytes (", payload_bytes,
      " of payload and ", tensor_bytes.size(), tensor_bytes.size() == 1 ? " tensor" : " tensors", biggest,
      "), over the limit of ", limit, " bytes per message (FERRY_MAX_MESSAGE_BYTES)"));
}

}  // namespace ferry

namespace ferry::internal {
namespace {

// How a tensor is stored in a payload.
enum class TensorForm : uint8_t { kUndefined = 0, kInline = 1, kTable = 2 };

constexpr uint32_t kMaxDims = 64;

}  // namespace

void save_tensor(PayloadWriter& ar, const Tensor& t) {
  if (!t.defined()) {
    ar(static_cast<uint8_t>(TensorForm::kUndefined));
    return;
  }
  bool inline_bytes = t.device().is_cpu() && t.nbytes() <= ar.inline_threshold();
  ar(static_cast<uint8_t>(inline_bytes ? TensorForm::kInline : TensorForm::kTable), static_cast<uint8_t>(t.dtype()),
     static_cast<uint32_t>(t.shape().size()));
  ar.save_binary(t.shape().data(), t.shape().size() * sizeof(int64_t));
  if (inline_bytes) {
    ar.save_binary(t.data(), t.nbytes());
  } else {
    ar(static_cast<uint32_t>(ar.table().size()));
    ar.table().push_back(t);
  }
}

void load_tensor(PayloadReader& ar, Tensor& t) {
  uint8_t form = 0;
  ar(form);
  if (form == static_cast<uint8_t>(TensorForm::kUndefined)) {
    t = Tensor();
    return;
  }
  if (form != static_cast<uint8_t>(TensorForm::kInline) && form != static_cast<uint8_t>(TensorForm::kTable)) {
    throw cereal::Exception(absl::StrCat("tensor has unknown form ", form));
  }
  uint8_t dtype = 0;
  uint32_t ndim = 0;
  ar(dtype, ndim);
  if (!is_valid_dtype(dtype)) throw cereal::Exception(absl::StrCat("tensor has invalid dtype ", dtype));
  if (ndim > kMaxDims) throw cereal::Exception(absl::StrCat("tensor has ", ndim, " dimensions (at most 64)"));
  std::vector<int64_t> shape(ndim);
  ar.load_binary(shape.data(), ndim * sizeof(int64_t));
  if (form == static_cast<uint8_t>(TensorForm::kInline)) {
    // Check the declared size against the bytes present before allocating anything.
    uint64_t bytes = dtype_size(static_cast<DType>(dtype));
    for (int64_t d : shape) {
      if (d < 0) throw cereal::Exception(absl::StrCat("tensor has negative dimension ", d));
      if (d != 0 && bytes > ar.remaining() / static_cast<uint64_t>(d)) bytes = ar.remaining() + 1;
      else bytes *= static_cast<uint64_t>(d);
    }
    if (bytes > ar.remaining()) {
      throw cereal::Exception(absl::StrCat("inline tensor declares more bytes than the ", ar.remaining(),
                                           " left in the payload"));
    }
    absl::StatusOr<Tensor> out = Tensor::empty(std::move(shape), static_cast<DType>(dtype));
    if (!out.ok()) throw cereal::Exception(std::string(out.status().message()));
    ar.load_binary(out->data(), out->nbytes());
    t = *std::move(out);
    return;
  }
  uint32_t index = 0;
  ar(index);
  if (index >= ar.table().size()) {
    throw cereal::Exception(absl::StrCat("tensor table index ", index, " out of range (", ar.table().size(),
                                         " tensors received)"));
  }
  const Tensor& buffer = ar.table()[index];
  absl::StatusOr<Tensor> out = Tensor::from_blob(buffer.storage(), std::move(shape), static_cast<DType>(dtype),
                                                 buffer.device());
  if (!out.ok()) throw cereal::Exception(std::string(out.status().message()));
  if (out->nbytes() != buffer.nbytes()) {
    throw cereal::Exception(absl::StrCat("tensor ", index, " declares ", out->nbytes(), " bytes but ",
                                         buffer.nbytes(), " were received"));
  }
  t = *std::move(out);
}

}  // namespace ferry::internal
