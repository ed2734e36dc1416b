// File: tensor/dtype.h
//
// DType: the element type of a tensor, and the C++ types that hold each one.
// float16 and bfloat16 are stored as their IEEE / brain-float bit patterns in
// Half and BFloat16, which convert to and from float.
//
//   dtype_size(DType::kFloat16);        // 2
//   dtype_name(DType::kBFloat16);       // "bfloat16"
//   static_assert(dtype_of<int32_t> == DType::kInt32);
#pragma once

#include <cstddef>
#include <cstdint>
#include <ostream>
#include <string_view>

#include "absl/status/statusor.h"

namespace ferry {

enum class DType : uint8_t {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat64 = 3,
  kInt8 = 4,
  kInt16 = 5,
  kInt32 = 6,
  kInt64 = 7,
  kUInt8 = 8,
  kBool = 9,
};
inline constexpr int kNumDTypes = 10;

// IEEE 754 half precision, held as bits. Conversions round to nearest even.
struct Half {
  uint16_t bits = 0;
  Half() = default;
  explicit Half(float value);
  explicit operator float() const;
  friend bool operator==(Half a, Half b) { return a.bits == b.bits; }
};

// bfloat16 (the top half of a float32), held as bits; rounds to nearest even.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  explicit BFloat16(float value);
  explicit operator float() const;
  friend bool operator==(BFloat16 a, BFloat16 b) { return a.bits == b.bits; }
};

// Bytes per element.
size_t dtype_size(DType dtype);
// "float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
// "uint8", "bool".
const char* dtype_name(DType dtype);
// The inverse of dtype_name; an unknown name is an InvalidArgument error listing the names.
absl::StatusOr<DType> parse_dtype(std::string_view name);
// Whether the value is a valid enumerator (for data read off the wire).
bool is_valid_dtype(int value);
bool is_floating(DType dtype);

std::ostream& operator<<(std::ostream& os, DType dtype);

namespace internal {
template <typename T> struct DTypeOf;
template <> struct DTypeOf<Half> { static constexpr DType value = DType::kFloat16; };
template <> struct DTypeOf<BFloat16> { static constexpr DType value = DType::kBFloat16; };
template <> struct DTypeOf<float> { static constexpr DType value = DType::kFloat32; };
template <> struct DTypeOf<double> { static constexpr DType value = DType::kFloat64; };
template <> struct DTypeOf<int8_t> { static constexpr DType value = DType::kInt8; };
template <> struct DTypeOf<int16_t> { static constexpr DType value = DType::kInt16; };
template <> struct DTypeOf<int32_t> { static constexpr DType value = DType::kInt32; };
template <> struct DTypeOf<int64_t> { static constexpr DType value = DType::kInt64; };
template <> struct DTypeOf<uint8_t> { static constexpr DType value = DType::kUInt8; };
template <> struct DTypeOf<bool> { static constexpr DType value = DType::kBool; };
}  // namespace internal

// The DType whose elements are held in a T, e.g. dtype_of<float> == DType::kFloat32.
template <typename T>
inline constexpr DType dtype_of = internal::DTypeOf<T>::value;

// Calls fn.template operator()<T>() with the C++ type T holding `dtype`'s elements.
template <typename Fn>
decltype(auto) visit_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat16: return fn.template operator()<Half>();
    case DType::kBFloat16: return fn.template operator()<BFloat16>();
    case DType::kFloat32: return fn.template operator()<float>();
    case DType::kFloat64: return fn.template operator()<double>();
    case DType::kInt8: return fn.template operator()<int8_t>();
    case DType::kInt16: return fn.template operator()<int16_t>();
    case DType::kInt32: return fn.template operator()<int32_t>();
    case DType::kInt64: return fn.template operator()<int64_t>();
    case DType::kUInt8: return fn.template operator()<uint8_t>();
    case DType::kBool: break;
  }
  return fn.template operator()<bool>();
}

}  // namespace ferry
