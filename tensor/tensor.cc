#include "tensor/tensor.h"

#include <cstdlib>
#include <cstring>
#include <limits>

#include "absl/strings/str_join.h"
#include "base/logging.h"
#include "base/status.h"
#include "tensor/cuda.h"

namespace ferry {
namespace {

constexpr size_t kCpuAlignment = 64;

absl::StatusOr<int64_t> count_elements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("negative dimension ", d, " in shape ", internal::shape_string(shape)));
    }
    if (d != 0 && n > std::numeric_limits<int64_t>::max() / d) {
      return absl::InvalidArgumentError(absl::StrCat("shape ", internal::shape_string(shape), " is too large"));
    }
    n *= d;
  }
  return n;
}

// The element count, checked so that the byte count (numel * element size) fits too.
absl::StatusOr<int64_t> count_bytes_checked(const std::vector<int64_t>& shape, DType dtype) {
  FERRY_ASSIGN_OR_RETURN(int64_t numel, count_elements(shape));
  if (numel > std::numeric_limits<int64_t>::max() / static_cast<int64_t>(dtype_size(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", internal::shape_string(shape), " of ", dtype_name(dtype),
                                                   " is too large"));
  }
  return numel;
}

absl::StatusOr<std::shared_ptr<void>> allocate(size_t bytes, Device device) {
  if (device.is_cpu()) {
    size_t rounded = (bytes + kCpuAlignment - 1) / kCpuAlignment * kCpuAlignment;
    void* ptr = std::aligned_alloc(kCpuAlignment, rounded == 0 ? kCpuAlignment : rounded);
    if (ptr == nullptr) {
      return absl::ResourceExhaustedError(absl::StrCat("out of memory allocating ", bytes, " bytes on cpu"));
    }
    return std::shared_ptr<void>(ptr, [](void* p) { std::free(p); });
  }
  FERRY_RETURN_IF_ERROR(check_device_available(device));
  std::shared_ptr<CudaRuntime> runtime = cuda_runtime();
  int index = device.index();
  // From the device's stream-ordered pool, on its default stream: the memory returns to
  // the pool when the default stream passes the point where the last reference went.
  // Whoever used it on another stream orders the default stream after that use.
  const CudaStream stream{index, nullptr};
  FERRY_ASSIGN_OR_RETURN(void* ptr, runtime->allocate_async(index, bytes, stream));
  return std::shared_ptr<void>(ptr, [runtime, stream](void* p) { runtime->deallocate_async(stream.device, p, stream); });
}

// Copies between any two devices and waits for the copy to finish.
absl::Status copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return absl::OkStatus();
  }
  std::shared_ptr<CudaRuntime> runtime = cuda_runtime();
  CudaStream stream{dst_device.is_cuda() ? dst_device.index() : src_device.index(), nullptr};
  FERRY_RETURN_IF_ERROR(runtime->copy_async(dst, dst_device, src, src_device, bytes, stream));
  return runtime->synchronize(stream);
}

template <typename T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return static_cast<double>(static_cast<float>(v));
  } else {
    return static_cast<double>(v);
  }
}

template <typename T>
T from_double(double v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>) {
    return T(static_cast<float>(v));
  } else if constexpr (std::is_same_v<T, bool>) {
    return v != 0;
  } else {
    return static_cast<T>(v);
  }
}

// Runs `op` on host copies of the tensors and writes the result to `device`.
absl::StatusOr<Tensor> on_host(const Tensor& t) { return t.to(Device::cpu()); }

absl::Status same_kind(const char* op, const Tensor& a, const Tensor& b) {
  if (!a.defined() || !b.defined()) return absl::InvalidArgumentError(absl::StrCat(op, ": undefined tensor"));
  if (a.dtype() != b.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": dtype mismatch: ", dtype_name(a.dtype()), " vs ",
                                                   dtype_name(b.dtype())));
  }
  if (a.device() != b.device()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": device mismatch: ", a.device().to_string(), " vs ",
                                                   b.device().to_string()));
  }
  return absl::OkStatus();
}

}  // namespace

namespace internal {

std::string shape_string(absl::Span<const int64_t> shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

void check_typed_access(const Tensor& t, DType requested) {
  FERRY_CHECK(t.defined()) << "typed access to an undefined tensor";
  FERRY_CHECK(t.dtype() == requested) << "typed access as " << dtype_name(requested) << " to a tensor of dtype "
                                      << dtype_name(t.dtype());
  FERRY_CHECK(t.device().is_cpu()) << "typed pointer access to a tensor on " << t.device().to_string();
}

}  // namespace internal

absl::StatusOr<Tensor> Tensor::empty(std::vector<int64_t> shape, DType dtype, Device device) {
  if (!is_valid_dtype(static_cast<int>(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat("invalid dtype value ", static_cast<int>(dtype)));
  }
  FERRY_ASSIGN_OR_RETURN(int64_t numel, count_bytes_checked(shape, dtype));
  Tensor t;
  t.shape_ = std::move(shape);
  t.numel_ = numel;
  t.dtype_ = dtype;
  t.device_ = device;
  FERRY_ASSIGN_OR_RETURN(t.data_, allocate(t.nbytes(), device));
  return t;
}

absl::StatusOr<Tensor> Tensor::zeros(std::vector<int64_t> shape, DType dtype, Device device) {
  FERRY_ASSIGN_OR_RETURN(Tensor t, empty(std::move(shape), dtype, device));
  FERRY_RETURN_IF_ERROR(t.fill(0));
  return t;
}

absl::StatusOr<Tensor> Tensor::from_blob(std::shared_ptr<void> data, std::vector<int64_t> shape, DType dtype,
                                         Device device) {
  if (data == nullptr) return absl::InvalidArgumentError("from_blob: null data");
  if (!is_valid_dtype(static_cast<int>(dtype))) {
    return absl::InvalidArgumentError(absl::StrCat("invalid dtype value ", static_cast<int>(dtype)));
  }
  FERRY_ASSIGN_OR_RETURN(int64_t numel, count_bytes_checked(shape, dtype));
  Tensor t;
  t.data_ = std::move(data);
  t.shape_ = std::move(shape);
  t.numel_ = numel;
  t.dtype_ = dtype;
  t.device_ = device;
  return t;
}

absl::Status Tensor::check_element(DType requested, absl::Span<const int64_t> index, int64_t* offset) const {
  if (!defined()) return absl::FailedPreconditionError("element access to an undefined tensor");
  if (requested != dtype_) {
    return absl::InvalidArgumentError(absl::StrCat("element access as ", dtype_name(requested),
                                                   " to a tensor of dtype ", dtype_name(dtype_)));
  }
  if (index.size() != shape_.size()) {
    return absl::InvalidArgumentError(absl::StrCat("index ", internal::shape_string(index), " has ", index.size(),
                                                   " dimension(s); tensor of shape ", internal::shape_string(shape_),
                                                   " has ", shape_.size()));
  }
  int64_t flat = 0;
  for (size_t i = 0; i < index.size(); ++i) {
    if (index[i] < 0 || index[i] >= shape_[i]) {
      return absl::OutOfRangeError(absl::StrCat("index ", internal::shape_string(index), " out of range for shape ",
                                                internal::shape_string(shape_), " (dimension ", i, ": ", index[i],
                                                " not in [0, ", shape_[i], "))"));
    }
    flat = flat * shape_[i] + index[i];
  }
  *offset = flat;
  return absl::OkStatus();
}

absl::Status Tensor::read_bytes(int64_t offset, void* out, size_t bytes) const {
  return copy_bytes(out, Device::cpu(), static_cast<const char*>(data_.get()) + offset, device_, bytes);
}

absl::Status Tensor::write_bytes(int64_t offset, const void* in, size_t bytes) {
  return copy_bytes(static_cast<char*>(data_.get()) + offset, device_, in, Device::cpu(), bytes);
}

absl::StatusOr<Tensor> Tensor::to(Device device) const {
  if (!defined()) return absl::FailedPreconditionError("to(): undefined tensor");
  if (device == device_) return *this;
  FERRY_ASSIGN_OR_RETURN(Tensor out, empty(shape_, dtype_, device));
  FERRY_RETURN_IF_ERROR(copy_bytes(out.data(), device, data(), device_, nbytes()));
  return out;
}

absl::StatusOr<Tensor> Tensor::clone() const {
  if (!defined()) return Tensor();
  FERRY_ASSIGN_OR_RETURN(Tensor out, empty(shape_, dtype_, device_));
  FERRY_RETURN_IF_ERROR(copy_bytes(out.data(), device_, data(), device_, nbytes()));
  return out;
}

absl::StatusOr<Tensor> Tensor::reshape(std::vector<int64_t> shape) const {
  if (!defined()) return absl::FailedPreconditionError("reshape(): undefined tensor");
  FERRY_ASSIGN_OR_RETURN(int64_t numel, count_elements(shape));
  if (numel != numel_) {
    return absl::InvalidArgumentError(absl::StrCat("cannot reshape ", internal::shape_string(shape_), " (", numel_,
                                                   " elements) to ", internal::shape_string(shape), " (", numel,
                                                   " elements)"));
  }
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

bool Tensor::equal(const Tensor& other) const {
  if (!defined() || !other.defined()) return defined() == other.defined();
  if (dtype_ != other.dtype_ || shape_ != other.shape_) return false;
  if (data_ == other.data_ && device_ == other.device_) return true;
  absl::StatusOr<Tensor> a = on_host(*this);
  absl::StatusOr<Tensor> b = on_host(other);
  if (!a.ok() || !b.ok()) return false;
  return std::memcmp(a->data(), b->data(), nbytes()) == 0;
}

absl::Status Tensor::fill(double value) {
  if (!defined()) return absl::FailedPreconditionError("fill(): undefined tensor");
  FERRY_ASSIGN_OR_RETURN(Tensor host, device_.is_cpu() ? *this : empty(shape_, dtype_, Device::cpu()));
  visit_dtype(dtype_, [&]<typename T>() {
    T v = from_double<T>(value);
    T* p = host.data_ptr<T>();
    for (int64_t i = 0; i < numel_; ++i) p[i] = v;
  });
  if (device_.is_cpu()) return absl::OkStatus();
  return copy_bytes(data(), device_, host.data(), Device::cpu(), nbytes());
}

absl::StatusOr<Tensor> Tensor::add(const Tensor& other) const {
  FERRY_RETURN_IF_ERROR(same_kind("add", *this, other));
  if (shape_ != other.shape_) {
    return absl::InvalidArgumentError(absl::StrCat("add: shape mismatch: ", internal::shape_string(shape_), " vs ",
                                                   internal::shape_string(other.shape_)));
  }
  FERRY_ASSIGN_OR_RETURN(Tensor a, on_host(*this));
  FERRY_ASSIGN_OR_RETURN(Tensor b, on_host(other));
  FERRY_ASSIGN_OR_RETURN(Tensor out, empty(shape_, dtype_, Device::cpu()));
  visit_dtype(dtype_, [&]<typename T>() {
    const T* x = a.data_ptr<T>();
    const T* y = b.data_ptr<T>();
    T* z = out.data_ptr<T>();
    for (int64_t i = 0; i < numel_; ++i) {
      if constexpr (std::is_same_v<T, bool>) {
        z[i] = x[i] || y[i];
      } else if constexpr (std::is_integral_v<T>) {
        // Wrap-around, not undefined behaviour, on overflow.
        using U = std::make_unsigned_t<T>;
        z[i] = static_cast<T>(static_cast<U>(x[i]) + static_cast<U>(y[i]));
      } else {
        z[i] = from_double<T>(to_double(x[i]) + to_double(y[i]));
      }
    }
  });
  return out.to(device_);
}

absl::StatusOr<Tensor> Tensor::mul(double scalar) const {
  if (!defined()) return absl::FailedPreconditionError("mul(): undefined tensor");
  FERRY_ASSIGN_OR_RETURN(Tensor a, on_host(*this));
  FERRY_ASSIGN_OR_RETURN(Tensor out, empty(shape_, dtype_, Device::cpu()));
  visit_dtype(dtype_, [&]<typename T>() {
    const T* x = a.data_ptr<T>();
    T* z = out.data_ptr<T>();
    for (int64_t i = 0; i < numel_; ++i) {
      if constexpr (std::is_same_v<T, bool>) {
        z[i] = x[i] && scalar != 0;
      } else {
        z[i] = from_double<T>(to_double(x[i]) * scalar);
      }
    }
  });
  return out.to(device_);
}

absl::StatusOr<Tensor> Tensor::matmul(const Tensor& other) const {
  FERRY_RETURN_IF_ERROR(same_kind("matmul", *this, other));
  if (!device_.is_cpu()) {
    return absl::UnimplementedError(absl::StrCat("matmul: only CPU tensors are supported, got ", device_.to_string()));
  }
  if (dim() != 2 || other.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("matmul: both tensors must be 2-D, got shapes ",
                                                   internal::shape_string(shape_), " and ",
                                                   internal::shape_string(other.shape_)));
  }
  if (shape_[1] != other.shape_[0]) {
    return absl::InvalidArgumentError(absl::StrCat("matmul: inner dimensions differ: ", internal::shape_string(shape_),
                                                   " x ", internal::shape_string(other.shape_)));
  }
  if (dtype_ == DType::kBool) return absl::InvalidArgumentError("matmul: bool tensors are not supported");
  const int64_t m = shape_[0], k = shape_[1], n = other.shape_[1];
  FERRY_ASSIGN_OR_RETURN(Tensor out, empty({m, n}, dtype_, Device::cpu()));
  visit_dtype(dtype_, [&]<typename T>() {
    if constexpr (!std::is_same_v<T, bool>) {
      const T* a = data_ptr<T>();
      const T* b = other.data_ptr<T>();
      T* c = out.data_ptr<T>();
      std::vector<double> row(static_cast<size_t>(n));
      for (int64_t i = 0; i < m; ++i) {
        std::fill(row.begin(), row.end(), 0.0);
        for (int64_t p = 0; p < k; ++p) {
          double av = to_double(a[i * k + p]);
          const T* brow = b + p * n;
          for (int64_t j = 0; j < n; ++j) row[static_cast<size_t>(j)] += av * to_double(brow[j]);
        }
        for (int64_t j = 0; j < n; ++j) c[i * n + j] = from_double<T>(row[static_cast<size_t>(j)]);
      }
    }
  });
  return out;
}

absl::StatusOr<Tensor> Tensor::transpose() const {
  if (!defined()) return absl::FailedPreconditionError("transpose(): undefined tensor");
  if (dim() != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("transpose: the tensor must be 2-D, got shape ", internal::shape_string(shape_)));
  }
  const int64_t rows = shape_[0], cols = shape_[1];
  FERRY_ASSIGN_OR_RETURN(Tensor a, on_host(*this));
  FERRY_ASSIGN_OR_RETURN(Tensor out, empty({cols, rows}, dtype_, Device::cpu()));
  const size_t elem = dtype_size(dtype_);
  const char* src = static_cast<const char*>(a.data());
  char* dst = static_cast<char*>(out.data());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) std::memcpy(dst + (j * rows + i) * elem, src + (i * cols + j) * elem, elem);
  }
  return out.to(device_);
}

std::string Tensor::to_string() const {
  if (!defined()) return "Tensor(undefined)";
  return absl::StrCat("Tensor(", dtype_name(dtype_), ", ", internal::shape_string(shape_), ", ",
                      device_.to_string(), ")");
}

std::ostream& operator<<(std::ostream& os, const Tensor& tensor) { return os << tensor.to_string(); }

}  // namespace ferry
