// 01_tensor: the tensor core. Builds two matrices, multiplies them, adds and scales
// the result, and shows the clear errors ferry gives for bad input.
#include <iostream>

#include "base/status.h"
#include "tensor/cuda.h"
#include "tensor/tensor.h"

namespace {

absl::Status run() {
  FERRY_ASSIGN_OR_RETURN(ferry::Tensor a, ferry::Tensor::from_values<float>({1, 2, 3, 4, 5, 6}, {2, 3}));
  FERRY_ASSIGN_OR_RETURN(ferry::Tensor b, ferry::Tensor::from_values<float>({1, 0, 0, 1, 1, 1}, {3, 2}));
  FERRY_ASSIGN_OR_RETURN(ferry::Tensor c, a.matmul(b));
  FERRY_ASSIGN_OR_RETURN(ferry::Tensor d, c.add(c));
  FERRY_ASSIGN_OR_RETURN(ferry::Tensor e, d.mul(0.5));
  FERRY_ASSIGN_OR_RETURN(std::vector<float> values, e.to_vector<float>());
  std::cout << "a @ b = " << e << ": ";
  for (float v : values) std::cout << v << ' ';
  std::cout << '\n';

  std::cout << "a bad device string:   " << ferry::Device::parse("gpu:0").status() << '\n';
  std::cout << "a shape mismatch:      " << a.add(c).status() << '\n';
  std::cout << "an index out of range: " << a.at<float>({2, 0}).status() << '\n';
  std::shared_ptr<ferry::CudaRuntime> cuda = ferry::cuda_runtime();
  if (cuda->device_count() == 0) {
    std::cout << "a CUDA tensor here:    " << a.to(ferry::Device::cuda(0)).status() << '\n';
  } else {
    FERRY_ASSIGN_OR_RETURN(ferry::Tensor on_gpu, a.to(ferry::Device::cuda(0)));
    std::cout << "on the GPU:            " << on_gpu << '\n';
  }
  return absl::OkStatus();
}

}  // namespace

int main() {
  absl::Status s = run();
  if (!s.ok()) {
    std::cerr << "01_tensor failed: " << s << '\n';
    return 1;
  }
  return 0;
}
