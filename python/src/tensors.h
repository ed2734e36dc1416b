// File: python/src/tensors.h (not installed)
//
// numpy arrays and DLPack capsules to and from ferry tensors, sharing memory both ways
// (no copy). Every function here needs the GIL.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <optional>

#include "tensor/tensor.h"

namespace ferry::python {

namespace py = pybind11;

// A C-contiguous numpy array as a ferry tensor sharing its memory; nullopt (None in
// Python) when it cannot be one (its dtype, its layout), so the caller pickles it.
std::optional<Tensor> tensor_from_numpy(const py::array& array);
// A CPU tensor as a numpy array over its memory, which the array keeps alive; throws
// TypeError for a device tensor or a dtype numpy lacks.
py::array tensor_to_numpy(const Tensor& t);
// Takes a "dltensor" capsule (renamed "used_dltensor", as DLPack's protocol asks);
// throws ValueError for another capsule, TypeError for a layout ferry cannot hold.
Tensor tensor_from_dlpack(py::capsule capsule);
// A "dltensor" capsule over the tensor's memory, deleted with the capsule unless a
// consumer took it.
py::capsule tensor_to_dlpack(const Tensor& t);

}  // namespace ferry::python
