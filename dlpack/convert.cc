#include "dlpack/convert.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace ferry {
namespace {

// What a DLManagedTensor made by to_dlpack points into: the shape and strides arrays
// and a Tensor copy holding the storage. One allocation, freed by the deleter.
struct ExportContext {
  Tensor tensor;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  DLManagedTensor managed{};
};

void delete_export_context(DLManagedTensor* self) { delete static_cast<ExportContext*>(self->manager_ctx); }

// The deleter of an imported tensor's storage. A named type so that an import that
// fails after the storage exists can disown `managed` (get_deleter), leaving it to the
// caller as from_dlpack promises.
struct ImportDeleter {
  DLManagedTensor* managed;
  void operator()(void*) const { DLManagedTensorDeleter()(managed); }
};

std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> strides(shape.size());
  int64_t stride = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= shape[i];
  }
  return strides;
}

std::string dlpack_dtype_string(DLDataType dtype) {
  const char* code = nullptr;
  switch (dtype.code) {
    case kDLInt: code = "kDLInt"; break;
    case kDLUInt: code = "kDLUInt"; break;
    case kDLFloat: code = "kDLFloat"; break;
    case kDLOpaqueHandle: code = "kDLOpaqueHandle"; break;
    case kDLBfloat: code = "kDLBfloat"; break;
    case kDLComplex: code = "kDLComplex"; break;
  }
  std::string name = code != nullptr ? code : absl::StrCat("type code ", static_cast<int>(dtype.code));
  return absl::StrCat(name, " bits ", static_cast<int>(dtype.bits), " lanes ", dtype.lanes);
}

std::string dlpack_device_name(DLDeviceType type) {
  switch (type) {
    case kDLCPU: return "kDLCPU";
    case kDLCUDA: return "kDLCUDA";
    case kDLCUDAHost: return "kDLCUDAHost (pinned host memory)";
    case kDLOpenCL: return "kDLOpenCL";
    case kDLVulkan: return "kDLVulkan";
    case kDLMetal: return "kDLMetal";
    case kDLVPI: return "kDLVPI";
    case kDLROCM: return "kDLROCM";
    case kDLROCMHost: return "kDLROCMHost";
    case kDLExtDev: return "kDLExtDev";
    case kDLCUDAManaged: return "kDLCUDAManaged (CUDA managed memory)";
  }
  return absl::StrCat("device type ", static_cast<int>(type));
}

}  // namespace

absl::StatusOr<DLDataType> to_dlpack_dtype(DType dtype) {
  auto make = [](DLDataTypeCode code, int bits) {
    return DLDataType{static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  };
  switch (dtype) {
    case DType::kFloat16: return make(kDLFloat, 16);
    case DType::kBFloat16: return make(kDLBfloat, 16);
    case DType::kFloat32: return make(kDLFloat, 32);
    case DType::kFloat64: return make(kDLFloat, 64);
    case DType::kInt8: return make(kDLInt, 8);
    case DType::kInt16: return make(kDLInt, 16);
    case DType::kInt32: return make(kDLInt, 32);
    case DType::kInt64: return make(kDLInt, 64);
    case DType::kUInt8: return make(kDLUInt, 8);
    case DType::kBool: break;
  }
  // Exporting bool as uint8 (PyTorch's choice) would import back as uint8: the map
  // would no longer be one to one.
  return absl::UnimplementedError(
      absl::StrCat("to_dlpack: dtype ", dtype_name(dtype), " has no type code in DLPack ", DLPACK_VERSION / 100, ".",
                   DLPACK_VERSION / 10 % 10, " (kDLBool came in DLPack 0.8); convert it to uint8 first"));
}

absl::StatusOr<DType> from_dlpack_dtype(DLDataType dtype) {
  std::string name = dlpack_dtype_string(dtype);
  if (dtype.lanes != 1) {
    return absl::UnimplementedError(
        absl::StrCat("from_dlpack: dtype ", name, ": vector types (lanes != 1) have no ferry dtype"));
  }
  switch (dtype.code) {
    case kDLFloat:
      if (dtype.bits == 16) return DType::kFloat16;
      if (dtype.bits == 32) return DType::kFloat32;
      if (dtype.bits == 64) return DType::kFloat64;
      break;
    case kDLBfloat:
      if (dtype.bits == 16) return DType::kBFloat16;
      break;
    case kDLInt:
      if (dtype.bits == 8) return DType::kInt8;
      if (dtype.bits == 16) return DType::kInt16;
      if (dtype.bits == 32) return DType::kInt32;
      if (dtype.bits == 64) return DType::kInt64;
      break;
    case kDLUInt:
      if (dtype.bits == 8) return DType::kUInt8;
      break;
    default:
      break;
  }
  return absl::UnimplementedError(absl::StrCat(
      "from_dlpack: dtype ", name,
      " has no ferry dtype (ferry has float16/32/64, bfloat16, int8/16/32/64, uint8 and bool)"));
}

DLDevice to_dlpack_device(Device device) {
  if (device.is_cuda()) return DLDevice{kDLCUDA, device.index()};
  return DLDevice{kDLCPU, 0};
}

absl::StatusOr<Device> from_dlpack_device(DLDevice device) {
  switch (device.device_type) {
    case kDLCPU:
      if (device.device_id != 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("from_dlpack: device kDLCPU with device_id ", device.device_id, " (DLPack's CPU is id 0)"));
      }
      return Device::cpu();
    case kDLCUDA:
      if (device.device_id < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat("from_dlpack: device kDLCUDA with negative device_id ", device.device_id));
      }
      return Device::cuda(device.device_id);
    default:
      break;
  }
  return absl::UnimplementedError(absl::StrCat("from_dlpack: device ", dlpack_device_name(device.device_type), " id ",
                                               device.device_id,
                                               " has no ferry device (ferry knows kDLCPU and kDLCUDA)"));
}

absl::StatusOr<DLManagedTensorPtr> to_dlpack(const Tensor& tensor) {
  if (!tensor.defined()) return absl::InvalidArgumentError("to_dlpack: undefined tensor");
  FERRY_ASSIGN_OR_RETURN(DLDataType dtype, to_dlpack_dtype(tensor.dtype()));
  auto context = std::make_unique<ExportContext>();
  context->tensor = tensor;
  context->shape = tensor.shape();
  context->strides = row_major_strides(context->shape);
  DLTensor& dl = context->managed.dl_tensor;
  dl.data = tensor.data();
  dl.device = to_dlpack_device(tensor.device());
  dl.ndim = static_cast<int>(context->shape.size());
  dl.dtype = dtype;
  dl.shape = context->shape.data();
  dl.strides = context->strides.data();
  dl.byte_offset = 0;
  context->managed.manager_ctx = context.get();
  context->managed.deleter = &delete_export_context;
  DLManagedTensor* managed = &context.release()->managed;
  return DLManagedTensorPtr(managed);
}

absl::StatusOr<Tensor> from_dlpack(DLManagedTensor* managed) {
  if (managed == nullptr) return absl::InvalidArgumentError("from_dlpack: null DLManagedTensor");
  const DLTensor& dl = managed->dl_tensor;
  FERRY_ASSIGN_OR_RETURN(Device device, from_dlpack_device(dl.device));
  FERRY_ASSIGN_OR_RETURN(DType dtype, from_dlpack_dtype(dl.dtype));
  if (dl.ndim < 0) return absl::InvalidArgumentError(absl::StrCat("from_dlpack: negative ndim ", dl.ndim));
  if (dl.ndim > 0 && dl.shape == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("from_dlpack: null shape with ndim ", dl.ndim));
  }
  std::vector<int64_t> shape(dl.shape, dl.shape + dl.ndim);
  int64_t numel = 1;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("from_dlpack: negative dimension in shape ", internal::shape_string(shape)));
    }
    if (__builtin_mul_overflow(numel, d, &numel)) {
      return absl::InvalidArgumentError(
          absl::StrCat("from_dlpack: shape ", internal::shape_string(shape), " is too large"));
    }
  }
  const bool has_elements = numel != 0;
  if (dl.strides != nullptr && has_elements) {
    // Size-1 dimensions may carry any stride (PyTorch, NumPy and CuPy agree), so only
    // the others are compared with row-major order.
    std::vector<int64_t> expected = row_major_strides(shape);
    for (int i = 0; i < dl.ndim; ++i) {
      if (shape[i] != 1 && dl.strides[i] != expected[i]) {
        std::vector<int64_t> strides(dl.strides, dl.strides + dl.ndim);
        return absl::InvalidArgumentError(absl::StrCat(
            "from_dlpack: non-contiguous tensor (shape ", internal::shape_string(shape), ", strides ",
            internal::shape_string(strides), "; ferry tensors are contiguous row-major, strides ",
            internal::shape_string(expected), "): make it contiguous on the producer's side, ferry does not copy"));
      }
    }
  }
  if (dl.data == nullptr) {
    if (has_elements) {
      return absl::InvalidArgumentError(
          absl::StrCat("from_dlpack: null data for shape ", internal::shape_string(shape)));
    }
    FERRY_ASSIGN_OR_RETURN(Tensor empty, Tensor::empty(std::move(shape), dtype, device));
    DLManagedTensorDeleter()(managed);
    return empty;
  }
  void* data = static_cast<char*>(dl.data) + dl.byte_offset;
  // The owner of the storage is the DLManagedTensor: its deleter runs when the last
  // Tensor sharing this storage goes.
  std::shared_ptr<void> storage(data, ImportDeleter{managed});
  absl::StatusOr<Tensor> tensor = Tensor::from_blob(storage, std::move(shape), dtype, device);
  if (!tensor.ok()) {
    // A shape too large to count (from_blob's check): the caller keeps `managed`.
    std::get_deleter<ImportDeleter>(storage)->managed = nullptr;
    return tensor.status();
  }
  return tensor;
}

}  // namespace ferry
