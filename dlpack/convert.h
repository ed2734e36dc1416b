// File: dlpack/convert.h
//
// ferry::Tensor to and from DLPack's DLManagedTensor, the exchange format of PyTorch,
// CuPy, JAX, TVM and others, without copying a byte either way. The pointer a consumer
// sees is the producer's pointer; each side keeps the other's owner alive for exactly as
// long as it holds the memory.
//
//   absl::StatusOr<DLManagedTensorPtr> dl = to_dlpack(tensor);
//   at::Tensor t = at::fromDLPack(dl->release());           // the consumer now owns it
//
//   absl::StatusOr<Tensor> back = from_dlpack(at::toDLPack(t));
//   // on success `back` owns the DLManagedTensor and calls its deleter when the last
//   // Tensor sharing its storage goes; on error the caller still owns it.
//
// What maps (one to one, both ways):
//   devices: cpu <-> (kDLCPU, 0); cuda:i <-> (kDLCUDA, i)
//   dtypes:  float16/32/64 <-> kDLFloat 16/32/64; bfloat16 <-> kDLBfloat 16;
//            int8/16/32/64 <-> kDLInt 8/16/32/64; uint8 <-> kDLUInt 8 (lanes 1)
//   strides: ferry tensors are contiguous row-major; exported strides say so, and an
//            imported tensor must be contiguous (strides of size-1 dimensions are free,
//            as in every framework's contiguity check).
// What is refused, never copied: a non-contiguous view, a dtype ferry lacks (unsigned
// wider than 8 bits, complex, opaque handles, vector types with lanes != 1) and a device
// ferry does not know (pinned or managed CUDA host memory, ROCm, OpenCL, Vulkan, Metal,
// ...). DLPack 0.6 (Debian's) has no bool type code, so a ferry bool tensor cannot be
// exported; PyTorch exports its bool tensors as uint8, and they import as uint8.
//
// CUDA memory: neither direction synchronizes anything. DLPack 0.6 carries no stream,
// so the two sides must agree on ordering: the producer's writes must be complete (or
// ordered on the stream the consumer uses) before the consumer reads. docs/torch.md.
#pragma once

#include <dlpack/dlpack.h>

#include <memory>

#include "absl/status/statusor.h"
#include "tensor/tensor.h"

namespace ferry {

// Calls a DLManagedTensor's own deleter (DLPack's contract: exactly once, by whoever
// holds it last); a null deleter means the producer keeps nothing alive.
struct DLManagedTensorDeleter {
  void operator()(DLManagedTensor* managed) const {
    if (managed != nullptr && managed->deleter != nullptr) managed->deleter(managed);
  }
};
// Owns one DLManagedTensor. release() hands it to a consumer that takes DLPack's raw
// pointer (at::fromDLPack, a Python capsule).
using DLManagedTensorPtr = std::unique_ptr<DLManagedTensor, DLManagedTensorDeleter>;

// Exports `tensor` without a copy: dl_tensor.data is tensor.data(), with explicit
// row-major strides and byte_offset 0. The DLManagedTensor holds a reference to the
// tensor's storage; its deleter drops that reference (and frees the shape, the strides
// and itself), so the memory lives until both the ferry side and the DLPack side are
// gone, in whichever order. The deleter may run on any thread.
// Errors: InvalidArgument for an undefined tensor; Unimplemented for a bool tensor.
[[nodiscard]] absl::StatusOr<DLManagedTensorPtr> to_dlpack(const Tensor& tensor);

// Imports `managed` without a copy: the Tensor's data() is dl_tensor.data plus
// byte_offset. On success the Tensor (and every copy sharing its storage) owns
// `managed`, and the last of them calls managed->deleter on whichever thread drops it.
// On error nothing was taken: the caller still owns `managed`. A tensor of zero
// elements may come with a null data pointer; it imports as a fresh empty tensor on
// the same device and `managed` is deleted at once (there is nothing to share).
// Errors: InvalidArgument for a null argument, a malformed DLTensor (negative ndim or
// dimension, null shape, null data with elements) or a non-contiguous view, naming
// its shape and strides; Unimplemented for a dtype or device ferry does not have,
// naming it.
[[nodiscard]] absl::StatusOr<Tensor> from_dlpack(DLManagedTensor* managed);

// The DLPack forms of ferry's types, and back (the same tables the conversions use).
// Errors as above.
[[nodiscard]] absl::StatusOr<DLDataType> to_dlpack_dtype(DType dtype);
[[nodiscard]] absl::StatusOr<DType> from_dlpack_dtype(DLDataType dtype);
DLDevice to_dlpack_device(Device device);
[[nodiscard]] absl::StatusOr<Device> from_dlpack_device(DLDevice device);

}  // namespace ferry
