// File: python/src/codec.h
//
// Python values to and from the payload of a call to a C++-registered function, driven
// by the function's signature text (serialization/types.h spells it, e.g.
// "(int64, vector<Tensor>) -> float64"). A Python caller does not know the C++ types,
// so it asks the callee for the signature (kSignatureOfFunction) and encodes what it
// was given as those types; a C++ caller of a function registered from Python is
// decoded the same way.
//
//   absl::StatusOr<Signature> sig = parse_signature("(int64, string) -> vector<float64>");
//   encode_value(writer, sig->args[0], py::int_(3), "argument 1");  // throws py::error_already_set
//   py::object out = decode_value(reader, sig->result);              // throws cereal::Exception
//
// Types: bool, char, int8..int64, uint8..uint64, float32, float64, string, Tensor,
// void, vector<T>, optional<T>, map<K, V>, unordered_map<K, V>, pair<A, B>,
// tuple<...>, array<T, N>. Any other type (a user struct) has no Python form: parsing
// fails naming it. Every function here needs the GIL.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "serialization/types.h"

namespace ferry::python {

namespace py = pybind11;

struct TypeNode {
  enum class Kind { kBool, kChar, kInt, kUInt, kFloat32, kFloat64, kString, kTensor, kVoid,
                    kVector, kOptional, kMap, kPair, kTuple, kArray };
  Kind kind = Kind::kVoid;
  int bytes = 0;                  // kInt, kUInt: the width
  size_t length = 0;              // kArray: N
  std::vector<TypeNode> children;  // element, key/value, members
  std::string text;                // as spelled in the signature
};

struct Signature {
  std::vector<TypeNode> args;
  TypeNode result;
  std::string text;
};

// Errors (kInvalidArgument) name the type that has no Python form, or where the text
// does not parse.
absl::StatusOr<TypeNode> parse_type(std::string_view text);
absl::StatusOr<Signature> parse_signature(std::string_view text);

// Converts Python objects to ferry tensors and back; set by the package at import
// (ferry/_tensors.py decides numpy or torch).
struct TensorHooks {
  py::object to_ferry;    // obj -> ferry Tensor (a _ferry.Tensor), raising TypeError if it is none
  py::object from_ferry;  // _ferry.Tensor -> the Python tensor type results come back as
};
TensorHooks& tensor_hooks();

// Writes `value` as a `type`. Throws py::error_already_set (TypeError, OverflowError)
// naming `where` ("argument 2 of \"add\"") and the expected type.
void encode_value(PayloadWriter& writer, const TypeNode& type, py::handle value, const std::string& where);
// Reads a `type`. Throws cereal::Exception on a malformed payload.
py::object decode_value(PayloadReader& reader, const TypeNode& type);

}  // namespace ferry::python
