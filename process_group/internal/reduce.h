// File: process_group/internal/reduce.h
//
// Element-wise reduction kernels handed to Gloo, one per (dtype, op). Gloo calls them
// as fn(out, a, b, n): out[i] = a[i] op b[i], where out may alias a or b.
//
//   FERRY_ASSIGN_OR_RETURN(ReduceFn fn, reduce_function(DType::kFloat16, ReduceOp::kMax, "all_reduce"));
#pragma once

#include <cstddef>
#include <string_view>

#include "absl/status/statusor.h"
#include "process_group/process_group.h"
#include "tensor/dtype.h"

namespace ferry::internal {

using ReduceFn = void (*)(void* out, const void* a, const void* b, size_t n);

// The kernel for `op` on `dtype`. float16 and bfloat16 reduce through float (each
// pairwise result rounded back, as Gloo's own float16 does). bool supports min
// (logical and) and max (logical or) only; sum and product on bool are
// kInvalidArgument, naming `op_name`.
absl::StatusOr<ReduceFn> reduce_function(DType dtype, ReduceOp op, std::string_view op_name);

}  // namespace ferry::internal
