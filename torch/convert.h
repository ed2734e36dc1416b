// File: torch/convert.h
//
// libtorch's at::Tensor to and from ferry::Tensor without copying a byte: each side
// wraps the other's memory and keeps the other's owner alive for as long as it holds
// it. This is what makes at::Tensor a wire type (torch/wire.h); use it directly to hand
// tensors between libtorch code and ferry code (or, through dlpack/convert.h, to any
// DLPack consumer).
//
//   at::Tensor x = torch::randn({64, 128});
//   absl::StatusOr<ferry::Tensor> f = ferry::from_torch(x);  // f->data() == x.data_ptr()
//   absl::StatusOr<at::Tensor> y = ferry::to_torch(*f);      // y->data_ptr() == x.data_ptr()
//
// What maps, one to one: float16/bfloat16/float32/float64, int8/16/32/64, uint8 and
// bool (at::kHalf, kBFloat16, kFloat, kDouble, kChar, kShort, kInt, kLong, kByte,
// kBool); cpu and cuda:i. Refused, never copied (so the caller decides whether a copy
// is worth it): a non-contiguous view (call .contiguous()), a lazily negated view
// (.resolve_neg()), a sparse, quantized or otherwise non-strided tensor, another dtype
// (complex, quantized) or device (MPS, XLA, ...).
//
// Autograd: only the values cross. The ferry side sees the data of a tensor that
// requires grad; a tensor made by to_torch is a leaf that does not require grad.
// Neither direction synchronizes CUDA streams (docs/torch.md says who must).
//
// Only this component's headers include libtorch; the rest of ferry never does.
#pragma once

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "tensor/tensor.h"

namespace ferry {

// A ferry::Tensor over `tensor`'s elements (data() == tensor.data_ptr(), which may sit
// at an offset into its storage). The ferry tensor's storage holds a reference to
// `tensor`, so the memory stays alive until both sides are gone, in whichever order.
// Writing through either side is visible on the other: the caller must not modify the
// tensor while ferry sends it (until the call's future completes).
// An undefined at::Tensor gives an undefined ferry::Tensor; one with no elements (whose
// data_ptr() may be null) gives a fresh empty ferry::Tensor of the same shape.
// Errors: InvalidArgument for a non-contiguous or negated view, naming its sizes and
// strides; Unimplemented for a dtype, layout or device ferry lacks, naming it.
[[nodiscard]] absl::StatusOr<Tensor> from_torch(const at::Tensor& tensor);

// An at::Tensor over `tensor`'s elements (data_ptr() == tensor.data()), through
// at::from_blob with a deleter that holds a reference to the ferry storage; the deleter
// runs on whichever thread drops the last at::Tensor sharing it. An undefined
// ferry::Tensor gives an undefined at::Tensor.
// Errors: FailedPrecondition when libtorch cannot make a tensor on that device (a CUDA
// tensor in a CPU-only libtorch), with libtorch's message.
[[nodiscard]] absl::StatusOr<at::Tensor> to_torch(const Tensor& tensor);

// The dtype tables the conversions use. Errors as above.
[[nodiscard]] absl::StatusOr<DType> from_torch_dtype(c10::ScalarType type);
c10::ScalarType to_torch_dtype(DType dtype);

}  // namespace ferry
