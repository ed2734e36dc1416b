// File: tensor/host_backed_cuda.h
//
// HostBackedCudaRuntime: the name programs and tests have used for a CUDA runtime whose
// "devices" are host memory. It is the asynchronous emulator (tensor/emulated_cuda.h):
// streams run on their own threads, events complete when their stream passes them,
// device memory comes from stream-ordered pools, and misuse aborts with its reason.
//
//   auto previous = set_cuda_runtime(std::make_shared<HostBackedCudaRuntime>(2));
//   Tensor t = *Tensor::zeros({4}, DType::kFloat32, Device::cuda(1));
#pragma once

#include "tensor/emulated_cuda.h"

namespace ferry {

using HostBackedCudaRuntime = EmulatedCudaRuntime;

}  // namespace ferry
