// A C++ worker in a job with Python workers (tests/python/test_mixed.py and
// bench/python_rpc.py). It registers C++ functions for Python callers, calls a function a
// Python worker registered for C++ callers, and shuts down gracefully.
//
//   python_cpp_peer NAME RANK WORLD_SIZE|dynamic INIT_METHOD [--call-python WORKER]
//
// --call-python WORKER: after init, calls WORKER's "py_triple" (int64) -> int64 and
// "py_scale" (Tensor, float64) -> Tensor, and fails (exit 1) unless they answer right.
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>

#include "rpc/ferry.h"

namespace {

int call_python(const std::string& worker) {
  int64_t tripled = ferry::rpc_sync<int64_t>(worker, "py_triple", int64_t{14});
  if (tripled != 42) {
    std::fprintf(stderr, "cpp_peer: py_triple(14) on %s gave %lld, expected 42\n", worker.c_str(),
                 static_cast<long long>(tripled));
    return 1;
  }
  ferry::Tensor t = ferry::Tensor::from_vector<float>({1, 2, 3});
  ferry::Tensor scaled = ferry::rpc_sync<ferry::Tensor>(worker, "py_scale", t, 2.5);
  absl::StatusOr<std::vector<float>> v = scaled.to_vector<float>();
  if (!v.ok() || *v != std::vector<float>{2.5f, 5.0f, 7.5f}) {
    std::fprintf(stderr, "cpp_peer: py_scale([1, 2, 3], 2.5) on %s gave %s, expected [2.5, 5, 7.5]\n",
                 worker.c_str(), scaled.to_string().c_str());
    return 1;
  }
  std::printf("cpp_peer: python answered py_triple=%lld py_scale=%s\n", static_cast<long long>(tripled),
              scaled.to_string().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s NAME RANK WORLD_SIZE|dynamic INIT_METHOD [--call-python WORKER]\n", argv[0]);
    return 2;
  }
  std::string name = argv[1];
  int rank = std::atoi(argv[2]);
  std::optional<int> world_size;
  if (std::string(argv[3]) != "dynamic") world_size = std::atoi(argv[3]);
  std::string init_method = argv[4];
  std::optional<std::string> python_worker;
  if (argc >= 7 && std::string(argv[5]) == "--call-python") python_worker = argv[6];

  auto must = [](absl::Status s) {
    if (!s.ok()) {
      std::fprintf(stderr, "cpp_peer: %s\n", s.ToString().c_str());
      std::exit(1);
    }
  };
  must(ferry::register_function("add", [](int64_t a, int64_t b) { return a + b; }));
  must(ferry::register_function("noop", [] {}));
  must(ferry::register_function("echo", [](ferry::Tensor t) { return t; }));
  must(ferry::register_function("scale", [](ferry::Tensor t, double s) { return t.mul(s); }));
  must(ferry::register_function(
      "summary", [](std::vector<double> xs, std::optional<std::string> label, std::map<std::string, int64_t> extra) {
        double sum = 0;
        for (double x : xs) sum += x;
        int64_t n = static_cast<int64_t>(xs.size());
        for (const auto& [k, v] : extra) n += v;
        return std::tuple<std::string, double, int64_t>(label.value_or("none"), sum, n);
      }));
  must(ferry::register_function("fail", [](std::string why) -> int64_t { throw std::invalid_argument(why); }));
  // Makes a Python worker's function be called from C++ inside a call from Python.
  must(ferry::register_function("relay_triple", [](std::string worker, int64_t x) {
    return ferry::rpc_sync<int64_t>(worker, "py_triple", x);
  }));

  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = init_method;
  must(ferry::init_rpc(name, ferry::BackendType::TENSORPIPE, rank, world_size, options));
  int rc = 0;
  if (python_worker.has_value()) {
    try {
      rc = call_python(*python_worker);
    } catch (const ferry::RpcError& e) {
      std::fprintf(stderr, "cpp_peer: calling %s failed: %s\n", python_worker->c_str(), e.what());
      rc = 1;
    }
  }
  absl::Status s = ferry::shutdown();
  if (!s.ok()) {
    std::fprintf(stderr, "cpp_peer: shutdown: %s\n", s.ToString().c_str());
    return 1;
  }
  return rc;
}
