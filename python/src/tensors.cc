#include "python/src/tensors.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "dlpack/convert.h"
#include "python/src/gil.h"

namespace ferry::python {
namespace {

absl::StatusOr<DType> numpy_dtype(const py::dtype& dt) {
  char kind = dt.kind();
  ssize_t size = dt.itemsize();
  if (kind == 'f' && size == 2) return DType::kFloat16;
  if (kind == 'f' && size == 4) return DType::kFloat32;
  if (kind == 'f' && size == 8) return DType::kFloat64;
  if (kind == 'i' && size == 1) return DType::kInt8;
  if (kind == 'i' && size == 2) return DType::kInt16;
  if (kind == 'i' && size == 4) return DType::kInt32;
  if (kind == 'i' && size == 8) return DType::kInt64;
  if (kind == 'u' && size == 1) return DType::kUInt8;
  if (kind == 'b' && size == 1) return DType::kBool;
  return absl::UnimplementedError(absl::StrCat("numpy dtype ", std::string(py::str(static_cast<py::handle>(dt))), " has no ferry dtype"));
}

const char* numpy_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
    case DType::kBool: return "bool";
    case DType::kBFloat16: return nullptr;
  }
  return nullptr;
}

}  // namespace

std::optional<Tensor> tensor_from_numpy(const py::array& array) {
  if (!(array.flags() & py::array::c_style)) return std::nullopt;
  absl::StatusOr<DType> dtype = numpy_dtype(array.dtype());
  if (!dtype.ok()) return std::nullopt;
  std::vector<int64_t> shape(array.shape(), array.shape() + array.ndim());
  void* data = const_cast<void*>(array.data());
  auto owner = std::make_shared<PyRef>(py::reinterpret_borrow<py::object>(array));
  std::shared_ptr<void> storage(data, [owner](void*) mutable { owner.reset(); });
  absl::StatusOr<Tensor> t = Tensor::from_blob(std::move(storage), std::move(shape), *dtype);
  if (!t.ok()) return std::nullopt;
  return *std::move(t);
}

py::array tensor_to_numpy(const Tensor& t) {
  if (!t.defined()) throw py::value_error("tensor_to_numpy: the tensor is undefined");
  if (!t.device().is_cpu()) {
    throw py::type_error(absl::StrCat("a ", t.device().to_string(), " tensor cannot become a numpy array; use torch"));
  }
  const char* name = numpy_name(t.dtype());
  if (name == nullptr) throw py::type_error(absl::StrCat("numpy has no dtype for ferry's ", dtype_name(t.dtype())));
  py::dtype dt(name);
  std::vector<ssize_t> shape(t.shape().begin(), t.shape().end());
  std::vector<ssize_t> strides(shape.size());
  ssize_t stride = dt.itemsize();
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = stride;
    stride *= std::max<ssize_t>(shape[i], 1);
  }
  auto* keep = new Tensor(t);
  py::capsule base(keep, [](void* p) { delete static_cast<Tensor*>(p); });
  return py::array(dt, shape, strides, t.data(), base);
}

Tensor tensor_from_dlpack(py::capsule capsule) {
  if (std::string(capsule.name() ? capsule.name() : "") != "dltensor") {
    throw py::value_error("from_dlpack: expected a capsule named \"dltensor\" (one not consumed yet)");
  }
  auto* managed = static_cast<DLManagedTensor*>(capsule.get_pointer());
  absl::StatusOr<Tensor> t = from_dlpack(managed);
  if (!t.ok()) throw py::type_error(std::string(t.status().message()));
  // Consumed: the capsule's destructor must no longer delete it (DLPack's protocol).
  if (PyCapsule_SetName(capsule.ptr(), "used_dltensor") != 0) throw py::error_already_set();
  return *std::move(t);
}

py::capsule tensor_to_dlpack(const Tensor& t) {
  absl::StatusOr<DLManagedTensorPtr> dl = to_dlpack(t);
  if (!dl.ok()) throw py::type_error(std::string(dl.status().message()));
  PyObject* cap = PyCapsule_New(dl->get(), "dltensor", [](PyObject* self) {
    // Deleted here only if no consumer took it (it renames the capsule when it does).
    if (PyCapsule_IsValid(self, "dltensor")) {
      auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(self, "dltensor"));
      if (m != nullptr && m->deleter != nullptr) m->deleter(m);
    }
  });
  if (cap == nullptr) throw py::error_already_set();
  dl->release();
  return py::reinterpret_steal<py::capsule>(cap);
}

}  // namespace ferry::python
