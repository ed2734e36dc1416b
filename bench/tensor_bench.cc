// Micro-benchmarks of the tensor core: allocation, clone and the CPU ops.
#include "benchmark/benchmark.h"
#include "tensor/tensor.h"

namespace {

void BM_Empty(benchmark::State& state) {
  for (auto _ : state) {
    auto t = ferry::Tensor::empty({state.range(0)}, ferry::DType::kUInt8);
    benchmark::DoNotOptimize(t->data());
  }
}
BENCHMARK(BM_Empty)->Range(64, 64 << 20);

void BM_Clone(benchmark::State& state) {
  auto t = *ferry::Tensor::zeros({state.range(0)}, ferry::DType::kUInt8);
  for (auto _ : state) {
    auto c = t.clone();
    benchmark::DoNotOptimize(c->data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}
BENCHMARK(BM_Clone)->Range(4 << 10, 64 << 20);

void BM_Matmul(benchmark::State& state) {
  int64_t n = state.range(0);
  auto a = *ferry::Tensor::zeros({n, n}, ferry::DType::kFloat32);
  for (auto _ : state) {
    auto c = a.matmul(a);
    benchmark::DoNotOptimize(c->data());
  }
}
BENCHMARK(BM_Matmul)->RangeMultiplier(4)->Range(16, 256);

}  // namespace
