#include "torch/convert.h"

#include <ATen/ops/from_blob.h>

#include <exception>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry {
namespace {

std::string dims_string(c10::IntArrayRef dims) {
  return internal::shape_string(absl::Span<const int64_t>(dims.data(), dims.size()));
}

absl::StatusOr<Device> from_torch_device(const c10::Device& device) {
  if (device.is_cpu()) return Device::cpu();
  if (device.is_cuda()) return Device::cuda(device.has_index() ? device.index() : 0);
  return absl::UnimplementedError(
      absl::StrCat("from_torch: device ", device.str(), " has no ferry device (ferry knows cpu and cuda:N)"));
}

}  // namespace

absl::StatusOr<DType> from_torch_dtype(c10::ScalarType type) {
  switch (type) {
    case c10::ScalarType::Half: return DType::kFloat16;
    case c10::ScalarType::BFloat16: return DType::kBFloat16;
    case c10::ScalarType::Float: return DType::kFloat32;
    case c10::ScalarType::Double: return DType::kFloat64;
    case c10::ScalarType::Char: return DType::kInt8;
    case c10::ScalarType::Short: return DType::kInt16;
    case c10::ScalarType::Int: return DType::kInt32;
    case c10::ScalarType::Long: return DType::kInt64;
    case c10::ScalarType::Byte: return DType::kUInt8;
    case c10::ScalarType::Bool: return DType::kBool;
    default: break;
  }
  return absl::UnimplementedError(absl::StrCat(
      "from_torch: dtype ", c10::toString(type),
      " has no ferry dtype (ferry has float16/32/64, bfloat16, int8/16/32/64, uint8 and bool)"));
}

c10::ScalarType to_torch_dtype(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return c10::ScalarType::Half;
    case DType::kBFloat16: return c10::ScalarType::BFloat16;
    case DType::kFloat32: return c10::ScalarType::Float;
    case DType::kFloat64: return c10::ScalarType::Double;
    case DType::kInt8: return c10::ScalarType::Char;
    case DType::kInt16: return c10::ScalarType::Short;
    case DType::kInt32: return c10::ScalarType::Int;
    case DType::kInt64: return c10::ScalarType::Long;
    case DType::kUInt8: return c10::ScalarType::Byte;
    case DType::kBool: break;
  }
  return c10::ScalarType::Bool;
}

absl::StatusOr<Tensor> from_torch(const at::Tensor& tensor) {
  if (!tensor.defined()) return Tensor();
  if (tensor.layout() != c10::kStrided) {
    std::ostringstream layout;
    layout << tensor.layout();
    return absl::UnimplementedError(
        absl::StrCat("from_torch: layout ", layout.str(), " (ferry tensors are dense and strided)"));
  }
  if (tensor.is_quantized()) {
    return absl::UnimplementedError(
        absl::StrCat("from_torch: quantized tensor of dtype ", c10::toString(tensor.scalar_type())));
  }
  FERRY_ASSIGN_OR_RETURN(DType dtype, from_torch_dtype(tensor.scalar_type()));
  FERRY_ASSIGN_OR_RETURN(Device device, from_torch_device(tensor.device()));
  if (!tensor.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "from_torch: non-contiguous tensor (sizes ", dims_string(tensor.sizes()), ", strides ",
        dims_string(tensor.strides()), "): ferry tensors are contiguous row-major and ferry does not copy; "
        "call .contiguous() first"));
  }
  if (tensor.is_neg()) {
    // The elements in memory are the negation of the values: sending them would be wrong.
    return absl::InvalidArgumentError(
        "from_torch: lazily negated view (is_neg()); call .resolve_neg() first, ferry does not copy");
  }
  std::vector<int64_t> shape(tensor.sizes().begin(), tensor.sizes().end());
  if (tensor.numel() == 0) return Tensor::empty(std::move(shape), dtype, device);
  // The storage's owner is a reference to the at::Tensor: libtorch frees its memory
  // only after the last ferry::Tensor sharing it goes.
  std::shared_ptr<void> storage(tensor.data_ptr(), [keep = tensor](void*) {});
  return Tensor::from_blob(std::move(storage), std::move(shape), dtype, device);
}

namespace {

void delete_storage_reference(void* context) { delete static_cast<std::shared_ptr<void>*>(context); }

// A CPU at::Tensor over ferry's storage, built the way at::empty builds one but around
// memory it does not own. at::from_blob does the same through a std::function deleter
// and device checks, which made an echo of a 4 KiB at::Tensor 9% slower than that of a
// ferry::Tensor; this is half the cost.
at::Tensor wrap_cpu(const Tensor& tensor) {
  // libtorch's DataPtr owns the context from here on and deletes it with the storage.
  c10::DataPtr data(tensor.data(), new std::shared_ptr<void>(tensor.storage()), &delete_storage_reference,
                    c10::Device(c10::DeviceType::CPU));
  c10::Storage storage(c10::Storage::use_byte_size_t(), tensor.nbytes(), std::move(data), /*allocator=*/nullptr,
                       /*resizable=*/false);
  at::Tensor out = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CPU),
      c10::scalarTypeToTypeMeta(to_torch_dtype(tensor.dtype())));
  out.unsafeGetTensorImpl()->set_sizes_contiguous(tensor.shape());
  return out;
}

}  // namespace

absl::StatusOr<at::Tensor> to_torch(const Tensor& tensor) {
  if (!tensor.defined()) return at::Tensor();
  if (tensor.device().is_cpu()) return wrap_cpu(tensor);
  // Other devices through from_blob, which checks that libtorch has the device.
  c10::Device device = tensor.device().is_cuda()
                           ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(tensor.device().index()))
                           : c10::Device(c10::DeviceType::CPU);
  std::vector<int64_t> sizes(tensor.shape().begin(), tensor.shape().end());
  try {
    return at::from_blob(
        tensor.data(), sizes, [keep = tensor.storage()](void*) {},
        at::TensorOptions().dtype(to_torch_dtype(tensor.dtype())).device(device));
  } catch (const c10::Error& e) {
    // A device libtorch was built without, mostly. Its backtrace is for logs, not users.
    return absl::FailedPreconditionError(
        absl::StrCat("to_torch: libtorch cannot wrap a ", tensor.to_string(), ": ", e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return absl::FailedPreconditionError(
        absl::StrCat("to_torch: libtorch cannot wrap a ", tensor.to_string(), ": ", e.what()));
  }
}

}  // namespace ferry
