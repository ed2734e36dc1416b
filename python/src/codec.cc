#include "python/src/codec.h"

#include <cctype>
#include <climits>
#include <limits>

#include "absl/strings/str_cat.h"
#include "rpc/function_registry.h"
#include "tensor/tensor.h"

namespace ferry::python {

namespace {

class Parser {
 public:
  explicit Parser(std::string_view text) : text_(text) {}

  absl::StatusOr<TypeNode> type() {
    skip_space();
    size_t start = pos_;
    while (pos_ < text_.size() && (std::isalnum(static_cast<unsigned char>(text_[pos_])) || text_[pos_] == '_' ||
                                   text_[pos_] == ':')) {
      ++pos_;
    }
    std::string name(text_.substr(start, pos_ - start));
    if (name.empty()) return error("a type name");
    std::vector<TypeNode> children;
    size_t length = 0;
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == '<') {
      ++pos_;
      for (;;) {
        skip_space();
        if (name == "array" && children.size() == 1) {
          size_t digits = pos_;
          while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
          if (digits == pos_) return error("an array length");
          length = std::stoull(std::string(text_.substr(digits, pos_ - digits)));
        } else {
          absl::StatusOr<TypeNode> child = type();
          if (!child.ok()) return child;
          children.push_back(*std::move(child));
        }
        skip_space();
        if (pos_ < text_.size() && text_[pos_] == ',') {
          ++pos_;
          continue;
        }
        if (pos_ < text_.size() && text_[pos_] == '>') {
          ++pos_;
          break;
        }
        return error("',' or '>'");
      }
    }
    TypeNode node;
    node.text = std::string(text_.substr(start, pos_ - start));
    using K = TypeNode::Kind;
    auto leaf = [&](K kind, int bytes = 0) -> absl::StatusOr<TypeNode> {
      if (!children.empty()) return unsupported(node.text);
      node.kind = kind;
      node.bytes = bytes;
      return node;
    };
    auto with = [&](K kind, size_t count) -> absl::StatusOr<TypeNode> {
      if (children.size() != count) return unsupported(node.text);
      node.kind = kind;
      node.children = std::move(children);
      return node;
    };
    if (name == "bool") return leaf(K::kBool, 1);
    if (name == "char") return leaf(K::kChar, 1);
    if (name == "int8") return leaf(K::kInt, 1);
    if (name == "int16") return leaf(K::kInt, 2);
    if (name == "int32") return leaf(K::kInt, 4);
    if (name == "int64") return leaf(K::kInt, 8);
    if (name == "uint8") return leaf(K::kUInt, 1);
    if (name == "uint16") return leaf(K::kUInt, 2);
    if (name == "uint32") return leaf(K::kUInt, 4);
    if (name == "uint64") return leaf(K::kUInt, 8);
    if (name == "float32") return leaf(K::kFloat32, 4);
    if (name == "float64") return leaf(K::kFloat64, 8);
    if (name == "string") return leaf(K::kString);
    if (name == "Tensor") return leaf(K::kTensor);
    if (name == "void") return leaf(K::kVoid);
    if (name == "vector") return with(K::kVector, 1);
    if (name == "optional") return with(K::kOptional, 1);
    if (name == "map" || name == "unordered_map") return with(K::kMap, 2);
    if (name == "pair") return with(K::kPair, 2);
    if (name == "tuple") {
      node.kind = K::kTuple;
      node.children = std::move(children);
      return node;
    }
    if (name == "array") {
      absl::StatusOr<TypeNode> out = with(K::kArray, 1);
      if (out.ok()) out->length = length;
      return out;
    }
    return unsupported(node.text);
  }

  absl::StatusOr<Signature> signature() {
    Signature sig;
    sig.text = std::string(text_);
    skip_space();
    if (!eat('(')) return error("'('");
    skip_space();
    if (!eat(')')) {
      for (;;) {
        absl::StatusOr<TypeNode> arg = type();
        if (!arg.ok()) return arg.status();
        sig.args.push_back(*std::move(arg));
        skip_space();
        if (eat(',')) continue;
        if (eat(')')) break;
        return error("',' or ')'");
      }
    }
    skip_space();
    if (!eat('-') || !eat('>')) return error("'->'");
    absl::StatusOr<TypeNode> result = type();
    if (!result.ok()) return result.status();
    sig.result = *std::move(result);
    skip_space();
    if (pos_ != text_.size()) return error("the end");
    return sig;
  }

  bool at_end() {
    skip_space();
    return pos_ == text_.size();
  }

 private:
  void skip_space() {
    while (pos_ < text_.size() && text_[pos_] == ' ') ++pos_;
  }
  bool eat(char c) {
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  absl::Status error(std::string_view expected) const {
    return absl::InvalidArgumentError(absl::StrCat("cannot parse the signature \"", std::string(text_), "\": expected ", std::string(expected),
                                                   " at position ", pos_));
  }
  absl::Status unsupported(std::string_view type) const {
    return absl::InvalidArgumentError(absl::StrCat(
        "type ", std::string(type), " in \"", std::string(text_),
        "\" has no Python form (scalars, string, Tensor, vector, optional, map, pair, tuple and array do)"));
  }

  std::string_view text_;
  size_t pos_ = 0;
};

[[noreturn]] void type_error(const std::string& where, const TypeNode& type, py::handle value) {
  throw py::type_error(absl::StrCat(where, ": expected ", type.text, ", got ",
                                    std::string(py::str(py::type::of(value).attr("__name__")))));
}

template <typename T>
void put(PayloadWriter& w, T v) {
  w.save_binary(&v, sizeof(v));
}

void encode_int(PayloadWriter& w, const TypeNode& type, py::handle value, const std::string& where) {
  if (!PyLong_Check(value.ptr()) && !PyIndex_Check(value.ptr())) type_error(where, type, value);
  py::object index = py::reinterpret_steal<py::object>(PyNumber_Index(value.ptr()));
  if (!index) throw py::error_already_set();
  if (type.kind == TypeNode::Kind::kInt) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
    long long lo = type.bytes == 8 ? LLONG_MIN : -(1LL << (type.bytes * 8 - 1));
    long long hi = type.bytes == 8 ? LLONG_MAX : (1LL << (type.bytes * 8 - 1)) - 1;
    if (overflow != 0 || v < lo || v > hi) {
      throw py::value_error(absl::StrCat(where, ": ", std::string(py::str(value)), " does not fit in ", type.text));
    }
    switch (type.bytes) {
      case 1: put(w, static_cast<int8_t>(v)); break;
      case 2: put(w, static_cast<int16_t>(v)); break;
      case 4: put(w, static_cast<int32_t>(v)); break;
      default: put(w, static_cast<int64_t>(v)); break;
    }
    return;
  }
  unsigned long long v = PyLong_AsUnsignedLongLong(index.ptr());
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::value_error(absl::StrCat(where, ": ", std::string(py::str(value)), " does not fit in ", type.text));
  }
  if (type.bytes < 8 && v >= (1ULL << (type.bytes * 8))) {
    throw py::value_error(absl::StrCat(where, ": ", std::string(py::str(value)), " does not fit in ", type.text));
  }
  switch (type.bytes) {
    case 1: put(w, static_cast<uint8_t>(v)); break;
    case 2: put(w, static_cast<uint16_t>(v)); break;
    case 4: put(w, static_cast<uint32_t>(v)); break;
    default: put(w, static_cast<uint64_t>(v)); break;
  }
}

std::vector<py::handle> as_sequence(const TypeNode& type, py::handle value, const std::string& where) {
  if (PyUnicode_Check(value.ptr()) || PyBytes_Check(value.ptr()) || !PySequence_Check(value.ptr())) {
    type_error(where, type, value);
  }
  py::sequence seq = py::reinterpret_borrow<py::sequence>(value);
  std::vector<py::handle> out;
  out.reserve(seq.size());
  for (py::handle item : seq) out.push_back(item);
  return out;
}

}  // namespace

absl::StatusOr<TypeNode> parse_type(std::string_view text) {
  Parser p(text);
  absl::StatusOr<TypeNode> t = p.type();
  if (t.ok() && !p.at_end()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot parse the type \"", std::string(text), "\": text after the type"));
  }
  return t;
}

absl::StatusOr<Signature> parse_signature(std::string_view text) { return Parser(text).signature(); }

TensorHooks& tensor_hooks() {
  static TensorHooks* hooks = new TensorHooks();  // never destroyed: Python objects outlive no interpreter
  return *hooks;
}

void encode_value(PayloadWriter& w, const TypeNode& type, py::handle value, const std::string& where) {
  using K = TypeNode::Kind;
  switch (type.kind) {
    case K::kBool: {
      if (!PyBool_Check(value.ptr())) type_error(where, type, value);
      put(w, static_cast<bool>(value.ptr() == Py_True));
      return;
    }
    case K::kChar: {
      if (PyUnicode_Check(value.ptr()) || PyBytes_Check(value.ptr())) {
        std::string s = PyUnicode_Check(value.ptr()) ? py::cast<std::string>(value)
                                                     : std::string(py::cast<py::bytes>(value));
        if (s.size() != 1) throw py::value_error(absl::StrCat(where, ": expected one character for char, got \"", s, "\""));
        put(w, s[0]);
        return;
      }
      TypeNode as_int = type;
      as_int.kind = K::kInt;
      encode_int(w, as_int, value, where);
      return;
    }
    case K::kInt:
    case K::kUInt:
      if (PyBool_Check(value.ptr()) || PyFloat_Check(value.ptr())) type_error(where, type, value);
      encode_int(w, type, value, where);
      return;
    case K::kFloat32:
    case K::kFloat64: {
      if (!PyFloat_Check(value.ptr()) && !PyLong_Check(value.ptr()) && !PyNumber_Check(value.ptr())) {
        type_error(where, type, value);
      }
      if (PyBool_Check(value.ptr())) type_error(where, type, value);
      double d = PyFloat_AsDouble(value.ptr());
      if (d == -1.0 && PyErr_Occurred()) throw py::error_already_set();
      if (type.kind == K::kFloat32) {
        put(w, static_cast<float>(d));
      } else {
        put(w, d);
      }
      return;
    }
    case K::kString: {
      std::string s;
      if (PyUnicode_Check(value.ptr())) {
        s = py::cast<std::string>(value);
      } else if (PyBytes_Check(value.ptr())) {
        s = std::string(py::reinterpret_borrow<py::bytes>(value));
      } else {
        type_error(where, type, value);
      }
      w(s);
      return;
    }
    case K::kTensor: {
      py::object t = tensor_hooks().to_ferry(value, where);
      w(py::cast<const Tensor&>(t));
      return;
    }
    case K::kVoid:
      if (!value.is_none()) type_error(where, type, value);
      w(Void{});
      return;
    case K::kVector: {
      std::vector<py::handle> items = as_sequence(type, value, where);
      w(cereal::make_size_tag(static_cast<cereal::size_type>(items.size())));
      for (size_t i = 0; i < items.size(); ++i) {
        encode_value(w, type.children[0], items[i], absl::StrCat(where, "[", i, "]"));
      }
      return;
    }
    case K::kArray: {
      std::vector<py::handle> items = as_sequence(type, value, where);
      if (items.size() != type.length) {
        throw py::value_error(absl::StrCat(where, ": expected ", type.length, " elements for ", type.text, ", got ",
                                           items.size()));
      }
      for (size_t i = 0; i < items.size(); ++i) {
        encode_value(w, type.children[0], items[i], absl::StrCat(where, "[", i, "]"));
      }
      return;
    }
    case K::kOptional:
      put(w, static_cast<bool>(value.is_none()));  // cereal writes "nullopt" first
      if (!value.is_none()) encode_value(w, type.children[0], value, where);
      return;
    case K::kMap: {
      if (!PyDict_Check(value.ptr())) type_error(where, type, value);
      py::dict d = py::reinterpret_borrow<py::dict>(value);
      w(cereal::make_size_tag(static_cast<cereal::size_type>(d.size())));
      for (auto [k, v] : d) {
        encode_value(w, type.children[0], k, absl::StrCat(where, " key"));
        encode_value(w, type.children[1], v, absl::StrCat(where, "[", std::string(py::repr(k)), "]"));
      }
      return;
    }
    case K::kPair:
    case K::kTuple: {
      if (!PyTuple_Check(value.ptr()) && !PyList_Check(value.ptr())) type_error(where, type, value);
      std::vector<py::handle> items = as_sequence(type, value, where);
      if (items.size() != type.children.size()) {
        throw py::value_error(absl::StrCat(where, ": expected ", type.children.size(), " elements for ", type.text,
                                           ", got ", items.size()));
      }
      for (size_t i = 0; i < items.size(); ++i) {
        encode_value(w, type.children[i], items[i], absl::StrCat(where, "[", i, "]"));
      }
      return;
    }
  }
}

namespace {
template <typename T>
T get(PayloadReader& r) {
  T v;
  r(v);
  return v;
}
}  // namespace

py::object decode_value(PayloadReader& r, const TypeNode& type) {
  using K = TypeNode::Kind;
  switch (type.kind) {
    case K::kBool:
      return py::bool_(get<bool>(r));
    case K::kChar: {
      char c = get<char>(r);
      return py::str(std::string(1, c));
    }
    case K::kInt:
      switch (type.bytes) {
        case 1: return py::int_(get<int8_t>(r));
        case 2: return py::int_(get<int16_t>(r));
        case 4: return py::int_(get<int32_t>(r));
        default: return py::int_(get<int64_t>(r));
      }
    case K::kUInt:
      switch (type.bytes) {
        case 1: return py::int_(get<uint8_t>(r));
        case 2: return py::int_(get<uint16_t>(r));
        case 4: return py::int_(get<uint32_t>(r));
        default: return py::int_(get<uint64_t>(r));
      }
    case K::kFloat32:
      return py::float_(get<float>(r));
    case K::kFloat64:
      return py::float_(get<double>(r));
    case K::kString: {
      std::string s = get<std::string>(r);
      PyObject* u = PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), nullptr);
      if (u == nullptr) {  // not text: hand over the bytes
        PyErr_Clear();
        return py::bytes(s);
      }
      return py::reinterpret_steal<py::object>(u);
    }
    case K::kTensor: {
      Tensor t;
      r(t);
      return tensor_hooks().from_ferry(py::cast(std::move(t)));
    }
    case K::kVoid:
      return py::none();
    case K::kVector: {
      uint64_t n = 0;
      r(cereal::make_size_tag(n));
      py::list out;
      for (uint64_t i = 0; i < n; ++i) out.append(decode_value(r, type.children[0]));
      return out;
    }
    case K::kArray: {
      py::list out;
      for (size_t i = 0; i < type.length; ++i) out.append(decode_value(r, type.children[0]));
      return out;
    }
    case K::kOptional: {
      bool nullopt = get<bool>(r);
      if (nullopt) return py::none();
      return decode_value(r, type.children[0]);
    }
    case K::kMap: {
      uint64_t n = 0;
      r(cereal::make_size_tag(n));
      py::dict out;
      for (uint64_t i = 0; i < n; ++i) {
        py::object k = decode_value(r, type.children[0]);
        out[k] = decode_value(r, type.children[1]);
      }
      return out;
    }
    case K::kPair:
    case K::kTuple: {
      py::tuple out(type.children.size());
      for (size_t i = 0; i < type.children.size(); ++i) out[i] = decode_value(r, type.children[i]);
      return out;
    }
  }
  return py::none();
}

}  // namespace ferry::python
