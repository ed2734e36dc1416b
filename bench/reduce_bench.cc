// Micro-benchmarks of the element-wise reduction kernels that all_reduce and reduce hand
// to Gloo: out = a op b, in place (out aliases a), as Gloo calls them.
#include <cstdint>
#include <vector>

#include "benchmark/benchmark.h"
#include "process_group/internal/reduce.h"

namespace {

template <typename T>
void run(benchmark::State& state, ferry::DType dtype, ferry::ReduceOp op) {
  const size_t n = static_cast<size_t>(state.range(0)) / sizeof(T);
  std::vector<T> a(n, T(1)), b(n, T(2));
  ferry::internal::ReduceFn fn = *ferry::internal::reduce_function(dtype, op, "bench");
  for (auto _ : state) {
    fn(a.data(), a.data(), b.data(), n);
    benchmark::DoNotOptimize(a.data());
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}

void BM_SumFloat(benchmark::State& state) { run<float>(state, ferry::DType::kFloat32, ferry::ReduceOp::kSum); }
BENCHMARK(BM_SumFloat)->Range(4 << 10, 16 << 20);

void BM_MaxFloat(benchmark::State& state) { run<float>(state, ferry::DType::kFloat32, ferry::ReduceOp::kMax); }
BENCHMARK(BM_MaxFloat)->Range(4 << 10, 16 << 20);

void BM_SumInt64(benchmark::State& state) { run<int64_t>(state, ferry::DType::kInt64, ferry::ReduceOp::kSum); }
BENCHMARK(BM_SumInt64)->Range(4 << 10, 16 << 20);

void BM_SumDouble(benchmark::State& state) { run<double>(state, ferry::DType::kFloat64, ferry::ReduceOp::kSum); }
BENCHMARK(BM_SumDouble)->Range(4 << 10, 16 << 20);

}  // namespace
