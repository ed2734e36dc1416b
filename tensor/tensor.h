// File: tensor/tensor.h
//
// Tensor: a contiguous, shaped, typed buffer on the CPU (64-byte aligned) or on a
// CUDA device. Copies of a Tensor share its storage, like torch.Tensor; clone() makes
// an independent copy. Operations that can fail (bad shapes, dtypes, devices) return
// absl::Status or absl::StatusOr and never abort.
//
//   absl::StatusOr<Tensor> a = Tensor::from_values<float>({1, 2, 3, 4}, {2, 2});
//   absl::StatusOr<Tensor> b = a->matmul(*a);
//   float x = *b->at<float>({1, 0});  // 15
//   absl::StatusOr<Tensor> on_gpu = a->to(Device::cuda(0));
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "tensor/device.h"
#include "tensor/dtype.h"

namespace ferry {

// Thread-compatible: concurrent reads are safe; a write to the elements must not race
// with other access to the same storage.
class Tensor {
 public:
  // An undefined tensor (defined() is false): no storage, no shape.
  Tensor() = default;

  // Uninitialized elements. Errors: a negative dimension, or a CUDA device this
  // process does not have.
  static absl::StatusOr<Tensor> empty(std::vector<int64_t> shape, DType dtype, Device device = Device::cpu());
  static absl::StatusOr<Tensor> zeros(std::vector<int64_t> shape, DType dtype, Device device = Device::cpu());
  // A CPU tensor holding `values` with the given shape; the element count must match.
  template <typename T>
  static absl::StatusOr<Tensor> from_values(std::span<const T> values, std::vector<int64_t> shape);
  template <typename T>
  static absl::StatusOr<Tensor> from_values(std::initializer_list<T> values, std::vector<int64_t> shape) {
    return from_values<T>(std::span<const T>(values.begin(), values.size()), std::move(shape));
  }
  // A 1-D CPU tensor holding `values`.
  template <typename T>
  static Tensor from_vector(const std::vector<T>& values);
  // Wraps memory the caller already owns: `data` must hold nbytes() bytes on `device`
  // and its deleter runs when the last Tensor sharing it goes. No copy is made.
  static absl::StatusOr<Tensor> from_blob(std::shared_ptr<void> data, std::vector<int64_t> shape, DType dtype,
                                          Device device = Device::cpu());

  bool defined() const { return data_ != nullptr; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t numel() const { return numel_; }
  size_t nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  // The first byte; on a CUDA device, a device pointer.
  void* data() const { return data_.get(); }
  // The shared owner of the bytes (for zero-copy hand-over to a transport).
  const std::shared_ptr<void>& storage() const { return data_; }

  // Typed access to a CPU tensor's elements. Precondition: T matches dtype() and the
  // tensor is on the CPU (checked; a violation is a programming error and aborts).
  template <typename T>
  T* data_ptr() const;
  template <typename T>
  std::span<T> span() const { return std::span<T>(data_ptr<T>(), static_cast<size_t>(numel_)); }

  // One element by multi-dimensional index; works on any device. Errors: T does not
  // match dtype(), wrong number of indices, an index out of range.
  template <typename T>
  absl::StatusOr<T> at(absl::Span<const int64_t> index) const;
  template <typename T>
  absl::Status set(absl::Span<const int64_t> index, T value);
  // All elements, copied to host, in row-major order. Error: T does not match dtype().
  template <typename T>
  absl::StatusOr<std::vector<T>> to_vector() const;

  // This tensor on `device`: itself (sharing storage) when already there, else a copy.
  absl::StatusOr<Tensor> to(Device device) const;
  // A copy with its own storage on the same device.
  absl::StatusOr<Tensor> clone() const;
  // The same storage seen with another shape of the same element count.
  absl::StatusOr<Tensor> reshape(std::vector<int64_t> shape) const;

  // True when both are undefined, or have the same dtype, shape and bit-identical
  // elements (devices may differ: CUDA elements are compared through host copies).
  bool equal(const Tensor& other) const;
  friend bool operator==(const Tensor& a, const Tensor& b) { return a.equal(b); }

  // Sets every element to `value` (converted to dtype(); bool: value != 0).
  absl::Status fill(double value);
  // Element-wise sum; both must have the same shape, dtype and device.
  absl::StatusOr<Tensor> add(const Tensor& other) const;
  // Every element times `scalar`, in a new tensor of the same dtype.
  absl::StatusOr<Tensor> mul(double scalar) const;
  // Matrix product of two 2-D CPU tensors of the same floating or integer dtype.
  absl::StatusOr<Tensor> matmul(const Tensor& other) const;
  // The transpose of a 2-D tensor, in new storage.
  absl::StatusOr<Tensor> transpose() const;

  // "Tensor(float32, [2, 3], cpu)".
  std::string to_string() const;

 private:
  absl::Status check_element(DType requested, absl::Span<const int64_t> index, int64_t* offset) const;
  absl::Status read_bytes(int64_t offset, void* out, size_t bytes) const;
  absl::Status write_bytes(int64_t offset, const void* in, size_t bytes);

  std::shared_ptr<void> data_;
  std::vector<int64_t> shape_;
  int64_t numel_ = 0;
  DType dtype_ = DType::kFloat32;
  Device device_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& tensor);

namespace internal {
void check_typed_access(const Tensor& t, DType requested);
std::string shape_string(absl::Span<const int64_t> shape);
}  // namespace internal

template <typename T>
absl::StatusOr<Tensor> Tensor::from_values(std::span<const T> values, std::vector<int64_t> shape) {
  absl::StatusOr<Tensor> t = empty(std::move(shape), dtype_of<T>);
  if (!t.ok()) return t;
  if (static_cast<size_t>(t->numel()) != values.size()) {
    return absl::InvalidArgumentError(absl::StrCat("from_values: ", values.size(), " values do not fill shape ",
                                                   internal::shape_string(t->shape()), " (", t->numel(),
                                                   " elements)"));
  }
  std::copy(values.begin(), values.end(), t->data_ptr<T>());
  return t;
}

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& values) {
  absl::StatusOr<Tensor> t = empty({static_cast<int64_t>(values.size())}, dtype_of<T>);
  // A CPU allocation of a valid shape fails only when memory is exhausted.
  if (!t.ok()) std::abort();
  std::copy(values.begin(), values.end(), t->data_ptr<T>());
  return *std::move(t);
}

template <typename T>
T* Tensor::data_ptr() const {
  internal::check_typed_access(*this, dtype_of<T>);
  return static_cast<T*>(data_.get());
}

template <typename T>
absl::StatusOr<T> Tensor::at(absl::Span<const int64_t> index) const {
  int64_t offset = 0;
  if (absl::Status s = check_element(dtype_of<T>, index, &offset); !s.ok()) return s;
  T value{};
  if (absl::Status s = read_bytes(offset * static_cast<int64_t>(sizeof(T)), &value, sizeof(T)); !s.ok()) return s;
  return value;
}

template <typename T>
absl::Status Tensor::set(absl::Span<const int64_t> index, T value) {
  int64_t offset = 0;
  if (absl::Status s = check_element(dtype_of<T>, index, &offset); !s.ok()) return s;
  return write_bytes(offset * static_cast<int64_t>(sizeof(T)), &value, sizeof(T));
}

template <typename T>
absl::StatusOr<std::vector<T>> Tensor::to_vector() const {
  if (dtype_of<T> != dtype_) {
    return absl::InvalidArgumentError(absl::StrCat("to_vector<", dtype_name(dtype_of<T>), ">() on a tensor of dtype ",
                                                   dtype_name(dtype_)));
  }
  if constexpr (std::is_same_v<T, bool>) {
    // std::vector<bool> is packed, so read the bytes first.
    std::vector<uint8_t> bytes(static_cast<size_t>(numel_));
    if (absl::Status s = read_bytes(0, bytes.data(), nbytes()); !s.ok()) return s;
    return std::vector<bool>(bytes.begin(), bytes.end());
  } else {
    std::vector<T> out(static_cast<size_t>(numel_));
    if (absl::Status s = read_bytes(0, out.data(), nbytes()); !s.ok()) return s;
    return out;
  }
}

}  // namespace ferry
