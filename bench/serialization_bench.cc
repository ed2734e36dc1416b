// Micro-benchmarks of a call's CPU cost outside the transport: encoding a request with
// 0, 1 and 16 tensors (inline and out of band), decoding it, and dispatching it through
// the function registry.
//
//   build/bench/serialization_bench --benchmark_min_time=0.2
#include "benchmark/benchmark.h"
#include "rpc/call.h"
#include "rpc/function_registry.h"
#include "serialization/error.h"

namespace ferry {
namespace {

std::vector<Tensor> make_tensors(int n, int64_t elements) {
  std::vector<Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(*Tensor::zeros({elements}, DType::kFloat32));
  return out;
}

void BM_EncodeCall(benchmark::State& state) {
  std::vector<Tensor> tensors = make_tensors(static_cast<int>(state.range(0)), state.range(1));
  for (auto _ : state) {
    Message m = internal::make_request<std::vector<Tensor>>("echo", kDefaultInlineTensorBytes, tensors);
    std::string wire = m.seal();
    benchmark::DoNotOptimize(wire.data());
  }
}
// (tensors, float32 elements each): 4 elements are inlined, 64 Ki go to the table.
BENCHMARK(BM_EncodeCall)->Args({0, 4})->Args({1, 4})->Args({16, 4})->Args({1, 65536})->Args({16, 65536});

void BM_DecodeCall(benchmark::State& state) {
  std::vector<Tensor> tensors = make_tensors(static_cast<int>(state.range(0)), state.range(1));
  Message m = internal::make_request<std::vector<Tensor>>("echo", kDefaultInlineTensorBytes, tensors);
  std::vector<Tensor> table = m.tensors();
  std::string wire = m.seal();
  for (auto _ : state) {
    Message in = *Message::parse(wire, table);
    auto values = read_payload<std::string, std::string, std::vector<Tensor>>(in);
    benchmark::DoNotOptimize(values.ok());
  }
}
BENCHMARK(BM_DecodeCall)->Args({0, 4})->Args({1, 4})->Args({16, 4})->Args({1, 65536})->Args({16, 65536});

void BM_DispatchNoop(benchmark::State& state) {
  FunctionRegistry registry;
  (void)registry.add("noop", make_registered_function([](int64_t v) { return v; }));
  for (int i = 0; i < 1000; ++i) {
    (void)registry.add("filler" + std::to_string(i), make_registered_function([](int64_t v) { return v; }));
  }
  Message request = internal::make_request<int64_t>("noop", kDefaultInlineTensorBytes, int64_t{1});
  for (auto _ : state) {
    Message reply = dispatch_request(registry, "w0", request);
    benchmark::DoNotOptimize(reply.buffer().data());
  }
}
BENCHMARK(BM_DispatchNoop);

void BM_DispatchTensor(benchmark::State& state) {
  FunctionRegistry registry;
  (void)registry.add("echo", make_registered_function([](Tensor t) { return t; }));
  Tensor t = *Tensor::zeros({state.range(0)}, DType::kFloat32);
  Message request = internal::make_request<Tensor>("echo", kDefaultInlineTensorBytes, t);
  std::vector<Tensor> table = request.tensors();
  for (auto _ : state) {
    Message reply = dispatch_request(registry, "w0", request);
    benchmark::DoNotOptimize(reply.buffer().data());
  }
}
BENCHMARK(BM_DispatchTensor)->Arg(4)->Arg(65536);

}  // namespace
}  // namespace ferry

BENCHMARK_MAIN();
