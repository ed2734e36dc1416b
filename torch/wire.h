// File: torch/wire.h
//
// Makes libtorch's at::Tensor a wire type: include this header and functions
// registered with at::Tensor arguments and results (alone or inside vectors, tuples,
// optionals, maps, structs) are called with them directly.
//
//   #include "rpc/rpc.h"
//   #include "torch/wire.h"
//   ferry::register_function("linear", [](at::Tensor x, at::Tensor w) { return at::matmul(x, w); });
//   at::Tensor y = ferry::rpc_sync<at::Tensor>("worker1", "linear", x, w);
//
// On the wire an at::Tensor is exactly a ferry::Tensor (torch/convert.h converts each
// way without a copy), named "Tensor" in signatures: a libtorch program can call a
// ferry-only worker's functions that take ferry::Tensor, and be called by one.
// Sending: a tensor above the inline threshold (serialization/archive.h) goes out of
// band straight from the at::Tensor's memory, which the message keeps alive until the
// transport is done with it; the caller must not modify it until the call's future
// completes. Smaller ones are copied into the payload, as ferry::Tensors are.
// Receiving: the at::Tensor wraps the buffer the transport received into (no second
// copy) and owns it. CUDA tensors follow the device maps like ferry's.
// A tensor from_torch refuses (non-contiguous, complex, sparse...) fails the call
// before anything is sent: kInvalidArgument naming the function and the reason.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "serialization/archive.h"
#include "serialization/types.h"
#include "torch/convert.h"

namespace ferry {

// cereal's hooks, found by argument-dependent lookup through the archive type.
inline void CEREAL_SAVE_FUNCTION_NAME(PayloadWriter& ar, const at::Tensor& tensor) {
  absl::StatusOr<Tensor> wire = from_torch(tensor);
  // The writer's callers turn cereal's exception into a status naming the call.
  if (!wire.ok()) throw cereal::Exception(std::string(wire.status().message()));
  ar(*wire);
}

inline void CEREAL_LOAD_FUNCTION_NAME(PayloadReader& ar, at::Tensor& tensor) {
  Tensor wire;
  ar(wire);
  absl::StatusOr<at::Tensor> torch = to_torch(wire);
  if (!torch.ok()) throw cereal::Exception(std::string(torch.status().message()));
  tensor = *std::move(torch);
}

template <>
struct TypeName<at::Tensor> {
  static std::string get() { return TypeName<Tensor>::get(); }
};

namespace internal {
// An at::Tensor takes a form byte at least, like a ferry::Tensor.
template <>
struct MinEncodedBytes<at::Tensor> : MinEncodedBytes<Tensor> {};
}  // namespace internal

}  // namespace ferry
