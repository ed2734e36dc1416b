// File: serialization/types.h
//
// Everything a call's arguments and results may be made of, in one include: the
// payload archives plus cereal's support for the standard containers. Also the type
// names that make up a call's signature, e.g. "(int64, vector<Tensor>)", so a call
// with the wrong argument types fails with both signatures named.
//
//   signature<int64_t, std::vector<Tensor>>();  // "(int64, vector<Tensor>)"
//
// A user struct is named by its C++ type (demangled); specialize ferry::TypeName to
// choose another name.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cereal/types/array.hpp"
#include "cereal/types/map.hpp"
#include "cereal/types/optional.hpp"
#include "cereal/types/string.hpp"
#include "cereal/types/tuple.hpp"
#include "cereal/types/unordered_map.hpp"
#include "cereal/types/utility.hpp"
#include "cereal/types/vector.hpp"
#include "serialization/archive.h"

namespace ferry {

namespace internal {
std::string demangle(const char* mangled);
}  // namespace internal

// The name of T in signatures. Specialize for your own types if you like.
template <typename T, typename = void>
struct TypeName {
  static std::string get() { return internal::demangle(typeid(T).name()); }
};

#define FERRY_INTERNAL_TYPE_NAME(type, name) \
  template <>                                \
  struct TypeName<type> {                    \
    static std::string get() { return name; } \
  }
FERRY_INTERNAL_TYPE_NAME(bool, "bool");
FERRY_INTERNAL_TYPE_NAME(char, "char");
FERRY_INTERNAL_TYPE_NAME(int8_t, "int8");
FERRY_INTERNAL_TYPE_NAME(int16_t, "int16");
FERRY_INTERNAL_TYPE_NAME(int32_t, "int32");
FERRY_INTERNAL_TYPE_NAME(long, "int64");
FERRY_INTERNAL_TYPE_NAME(long long, "int64");
FERRY_INTERNAL_TYPE_NAME(uint8_t, "uint8");
FERRY_INTERNAL_TYPE_NAME(uint16_t, "uint16");
FERRY_INTERNAL_TYPE_NAME(uint32_t, "uint32");
FERRY_INTERNAL_TYPE_NAME(unsigned long, "uint64");
FERRY_INTERNAL_TYPE_NAME(unsigned long long, "uint64");
FERRY_INTERNAL_TYPE_NAME(float, "float32");
FERRY_INTERNAL_TYPE_NAME(double, "float64");
FERRY_INTERNAL_TYPE_NAME(std::string, "string");
FERRY_INTERNAL_TYPE_NAME(Tensor, "Tensor");
FERRY_INTERNAL_TYPE_NAME(Device, "Device");
#undef FERRY_INTERNAL_TYPE_NAME

template <typename T>
struct TypeName<std::vector<T>> {
  static std::string get() { return "vector<" + TypeName<T>::get() + ">"; }
};
template <typename T>
struct TypeName<std::optional<T>> {
  static std::string get() { return "optional<" + TypeName<T>::get() + ">"; }
};
template <typename K, typename V>
struct TypeName<std::map<K, V>> {
  static std::string get() { return "map<" + TypeName<K>::get() + ", " + TypeName<V>::get() + ">"; }
};
template <typename K, typename V>
struct TypeName<std::unordered_map<K, V>> {
  static std::string get() { return "unordered_map<" + TypeName<K>::get() + ", " + TypeName<V>::get() + ">"; }
};
template <typename A, typename B>
struct TypeName<std::pair<A, B>> {
  static std::string get() { return "pair<" + TypeName<A>::get() + ", " + TypeName<B>::get() + ">"; }
};
template <typename T, size_t N>
struct TypeName<std::array<T, N>> {
  static std::string get() { return "array<" + TypeName<T>::get() + ", " + std::to_string(N) + ">"; }
};
template <typename... Ts>
struct TypeName<std::tuple<Ts...>> {
  static std::string get() {
    std::string out = "tuple<";
    bool first = true;
    ((out += (first ? "" : ", ") + TypeName<Ts>::get(), first = false), ...);
    return out + ">";
  }
};

// "(T1, T2, ...)" for the decayed argument types. Computed once per type list.
template <typename... Args>
const std::string& signature() {
  static const std::string text = [] {
    std::string out = "(";
    bool first = true;
    ((out += (first ? "" : ", ") + TypeName<std::decay_t<Args>>::get(), first = false), ...);
    return out + ")";
  }();
  return text;
}

}  // namespace ferry
