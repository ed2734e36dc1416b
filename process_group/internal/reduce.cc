#include "process_group/internal/reduce.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

template <typename T>
constexpr bool kViaFloat = std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

template <typename T, ReduceOp Op>
void kernel(void* out_, const void* a_, const void* b_, size_t n) {
  T* out = static_cast<T*>(out_);
  const T* a = static_cast<const T*>(a_);
  const T* b = static_cast<const T*>(b_);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (kViaFloat<T>) {
      const float x = static_cast<float>(a[i]);
      const float y = static_cast<float>(b[i]);
      float r;
      if constexpr (Op == ReduceOp::kSum) r = x + y;
      else if constexpr (Op == ReduceOp::kProduct) r = x * y;
      else if constexpr (Op == ReduceOp::kMin) r = std::min(x, y);
      else r = std::max(x, y);
      out[i] = T(r);
    } else if constexpr (std::is_same_v<T, bool>) {
      // Only min/max are instantiated for bool (see reduce_function).
      if constexpr (Op == ReduceOp::kMin) out[i] = a[i] && b[i];
      else out[i] = a[i] || b[i];
    } else if constexpr (std::is_floating_point_v<T>) {
      if constexpr (Op == ReduceOp::kSum) out[i] = a[i] + b[i];
      else if constexpr (Op == ReduceOp::kProduct) out[i] = a[i] * b[i];
      else if constexpr (Op == ReduceOp::kMin) out[i] = std::min(a[i], b[i]);
      else out[i] = std::max(a[i], b[i]);
    } else {
      // Integers wrap on overflow, as torch's do: compute in uint64_t, where overflow is
      // defined (signed overflow, or a promoted uint16 product, would be UB), and
      // narrow back modulo 2^bits.
      if constexpr (Op == ReduceOp::kSum) {
        out[i] = static_cast<T>(static_cast<uint64_t>(a[i]) + static_cast<uint64_t>(b[i]));
      } else if constexpr (Op == ReduceOp::kProduct) {
        out[i] = static_cast<T>(static_cast<uint64_t>(a[i]) * static_cast<uint64_t>(b[i]));
      } else if constexpr (Op == ReduceOp::kMin) out[i] = std::min(a[i], b[i]);
      else out[i] = std::max(a[i], b[i]);
    }
  }
}

}  // namespace

absl::StatusOr<ReduceFn> reduce_function(DType dtype, ReduceOp op, std::string_view op_name) {
  return visit_dtype(dtype, [&]<typename T>() -> absl::StatusOr<ReduceFn> {
    if constexpr (std::is_same_v<T, bool>) {
      if (op == ReduceOp::kMin) return &kernel<bool, ReduceOp::kMin>;
      if (op == ReduceOp::kMax) return &kernel<bool, ReduceOp::kMax>;
      return absl::InvalidArgumentError(absl::StrCat(ferry::internal::av(op_name), ": reduce op ", reduce_op_name(op),
                                                     " is not supported for dtype bool (use min for logical and, "
                                                     "max for logical or)"));
    } else {
      switch (op) {
        case ReduceOp::kSum: return &kernel<T, ReduceOp::kSum>;
        case ReduceOp::kProduct: return &kernel<T, ReduceOp::kProduct>;
        case ReduceOp::kMin: return &kernel<T, ReduceOp::kMin>;
        case ReduceOp::kMax: return &kernel<T, ReduceOp::kMax>;
      }
      return absl::InvalidArgumentError(
          absl::StrCat(ferry::internal::av(op_name), ": unknown reduce op ", static_cast<int>(op)));
    }
  });
}

}  // namespace ferry::internal
