// File: process_group/internal/host_staging.h
//
// CUDA staging. The Gloo ferry builds moves host memory only, so a CUDA tensor is
// copied to the host before an operation and the results copied back into its own
// storage after:
//
//   FERRY_ASSIGN_OR_RETURN(Tensor host, host_output(tensor));
//   ... Gloo writes host.data() ...
//   return write_back(tensor, host);
//
// A CPU tensor is used in place, with no copy. Internal, never installed.
#pragma once

#include <cstddef>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "tensor/tensor.h"

namespace ferry::internal::pg {

// The tensor's contents on the host: itself on the CPU, else a host copy.
absl::StatusOr<Tensor> host_input(const Tensor& t);

// Host memory for results bound for `t`: itself on the CPU, else fresh host memory.
absl::StatusOr<Tensor> host_output(const Tensor& t);

// Copies `bytes` of host memory at `src` into `dst`'s storage (any device).
absl::Status copy_from_host(const Tensor& dst, const void* src, size_t bytes);

// Writes a host result back to `t` when `t` lives elsewhere.
absl::Status write_back(const Tensor& t, const Tensor& host);

}  // namespace ferry::internal::pg
