#include <iostream>

#include "tensor/tensor.h"

int main() {
  auto a = ferry::Tensor::from_values<float>({1, 2, 3, 4}, {2, 2});
  auto b = a->add(*a);
  double sum = 0;
  std::vector<float> values = *b->to_vector<float>();
  for (float v : values) sum += v;
  std::cout << "consumer: " << *b << " sum " << sum << "\n";
  return 0;
}
