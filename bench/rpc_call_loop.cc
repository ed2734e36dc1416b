// A bare loop of rpc_sync no-op calls between two forked workers, for profilers:
//
//   perf record -e cycles:u -g -- build/bench/rpc_call_loop shm 100000
//   perf report --no-children --sort sym
//
// Prints the median and p99 round trip. With a third argument N > 1, keeps N rpc_async
// calls in flight instead and prints calls per second.
// A fourth argument sets the worker pool size (default 4); a fifth, "inline", serves the
// no-op on the transport thread (Serving::kInline) instead of the pool. A sixth, B > 0,
// echoes a tensor of B bytes instead of the no-op (rpc_sync; where large messages'
// time goes). A seventh, "callbacks", issues each next call (with N in flight) from the
// previous reply's then_inline continuation, on the transport thread, as the raw
// TensorPipe bench does, instead of from the caller's thread.
// LOOP_CUDA=1 echoes the tensor from cuda:0 to cuda:0 through device maps (with
// FERRY_EMULATE_CUDA=1 on the emulated runtime: where the staging path's time goes).
// Usage: rpc_call_loop [shm|uv] [calls] [outstanding] [pool threads] [pooled|inline] [echo bytes] [callbacks]
#include <sched.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "rpc/ferry.h"

int main(int argc, char** argv) {
  std::string transport = argc > 1 ? argv[1] : "shm";
  int calls = argc > 2 ? std::atoi(argv[2]) : 20000;
  int outstanding = argc > 3 ? std::max(1, std::atoi(argv[3])) : 1;
  int threads = argc > 4 ? std::max(1, std::atoi(argv[4])) : 4;
  const bool inline_serving = argc > 5 && std::string(argv[5]) == "inline";
  const long echo_bytes = argc > 6 ? std::atol(argv[6]) : 0;
  const bool from_callbacks = argc > 7 && std::string(argv[7]) == "callbacks";
  std::string store = (std::filesystem::temp_directory_path() / ("ferry-loop-" + std::to_string(getpid()))).string();
  std::vector<pid_t> children;
  for (int rank = 0; rank < 2; ++rank) {
    pid_t pid = fork();
    if (pid != 0) {
      children.push_back(pid);
      continue;
    }
    // LOOP_SPIN_US_0 / LOOP_SPIN_US_1: FERRY_SPIN_US for the caller (rank 0) or the
    // server (rank 1) alone, to see whose polling a figure depends on.
    if (const char* spin = std::getenv(rank == 0 ? "LOOP_SPIN_US_0" : "LOOP_SPIN_US_1"); spin != nullptr) {
      setenv("FERRY_SPIN_US", spin, 1);
    }
    if (std::getenv("LOOP_PIN") != nullptr) {
      cpu_set_t set;
      CPU_ZERO(&set);
      CPU_SET(rank % static_cast<int>(std::thread::hardware_concurrency()), &set);
      sched_setaffinity(0, sizeof(set), &set);
    }
    (void)ferry::register_function("noop", [](int64_t v) { return v; },
                                   inline_serving ? ferry::Serving::kInline : ferry::Serving::kPool);
    // LOOP_POOLED_FIRST=N: N calls to a pooled no-op before the measured loop, as
    // `ferry bench rpc` measures its inline figures right after its pooled ones.
    (void)ferry::register_function("noop_pooled", [](int64_t v) { return v; }, ferry::Serving::kPool);
    (void)ferry::register_function("echo", [](ferry::Tensor t) { return t; },
                                   inline_serving ? ferry::Serving::kInline : ferry::Serving::kPool);
    (void)ferry::register_function("debug", [] {
      std::string line;
      for (const auto& [k, v] : ferry::current_agent()->debug_info()) line += k + "=" + v + " ";
      return line;
    });
    ferry::TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + store;
    options.transports = std::vector<std::string>{transport};
    // As `ferry bench rpc` measures uv: tensors travel through the pipe itself.
    if (transport == "uv") options.channels = std::vector<std::string>{"basic"};
    options.num_worker_threads = threads;
    const bool on_cuda = std::getenv("LOOP_CUDA") != nullptr;
    if (on_cuda && rank == 0 && !options.set_device_map("w1", {{ferry::Device::cuda(0), ferry::Device::cuda(0)}}).ok()) {
      _exit(1);
    }
    absl::Status started = ferry::init_rpc("w" + std::to_string(rank), rank, 2, options);
    if (!started.ok()) {
      std::fprintf(stderr, "w%d: %s\n", rank, started.ToString().c_str());
      _exit(1);
    }
    if (const char* first = std::getenv("LOOP_POOLED_FIRST"); first != nullptr && rank == 0) {
      for (int i = 0, n = std::atoi(first); i < n; ++i) ferry::rpc_sync<int64_t>("w1", "noop_pooled", int64_t{i});
    }
    if (rank == 0 && echo_bytes > 0) {
      absl::StatusOr<ferry::Tensor> t = ferry::Tensor::empty({echo_bytes}, ferry::DType::kUInt8);
      if (!t.ok()) _exit(1);
      // Touched, as a user's tensor is: untouched pages would be read from the zero page.
      std::memset(t->data(), 0x5a, t->nbytes());
      if (on_cuda) t = t->to(ferry::Device::cuda(0));
      if (!t.ok()) _exit(1);
      std::vector<double> us;
      for (int i = 0; i < calls + 10; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        ferry::Tensor back = ferry::rpc_sync<ferry::Tensor>("w1", "echo", *t);
        if (back.nbytes() != t->nbytes()) _exit(1);
        if (i >= 10) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(us.begin(), us.end());
      std::printf("%s: %d echoes of %ld bytes, median %.1f us (%.2f GB/s both ways), p99 %.1f us\n", transport.c_str(),
                  calls, echo_bytes, us[us.size() / 2], 2e-3 * static_cast<double>(echo_bytes) / us[us.size() / 2],
                  us[us.size() * 99 / 100]);
      std::fflush(stdout);
    } else if (rank == 0 && outstanding > 1 && from_callbacks) {
      // Each reply's continuation issues the next call; the last one wakes this thread.
      // Shared: a continuation may still be running when this thread wakes.
      struct Chain : std::enable_shared_from_this<Chain> {
        std::atomic<int> issued{0};
        std::atomic<int> done{0};
        int calls = 0;
        ferry::Promise<int> finished;
        void issue() {
          int i = issued.fetch_add(1);
          if (i >= calls) return;
          (void)ferry::rpc_async<int64_t>("w1", "noop", int64_t{i})
              .then_inline([self = shared_from_this()](const absl::StatusOr<int64_t>& r) {
                if (!r.ok()) {
                  self->finished.set_error(r.status());
                  return 0;
                }
                bool last = self->done.fetch_add(1) + 1 == self->calls;
                self->issue();
                if (last) self->finished.set_value(0);
                return 0;
              });
        }
      };
      auto chain = std::make_shared<Chain>();
      chain->calls = calls;
      ferry::Future<int> all = chain->finished.get_future();
      auto t0 = std::chrono::steady_clock::now();
      for (int k = 0; k < outstanding; ++k) chain->issue();
      all.wait();
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%s: %d rpc_async no-op calls, %d outstanding, issued from continuations: %.0f calls/s\n",
                  transport.c_str(), calls, outstanding, calls / s);
      std::fflush(stdout);
    } else if (rank == 0 && outstanding > 1) {
      std::vector<ferry::Future<int64_t>> ring(static_cast<size_t>(outstanding));
      const bool timed = std::getenv("LOOP_TIMED") != nullptr;
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) {
        ferry::Future<int64_t>& slot = ring[static_cast<size_t>(i % outstanding)];
        if (slot.valid()) {
          // LOOP_TIMED: wait as `ferry bench rpc` does, with a time-out.
          if (timed) {
            (void)slot.wait_for(std::chrono::seconds(60));
          } else {
            slot.wait();
          }
        }
        slot = ferry::rpc_async<int64_t>("w1", "noop", int64_t{i});
      }
      for (ferry::Future<int64_t>& f : ring) {
        if (f.valid()) f.wait();
      }
      double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      std::printf("%s: %d rpc_async no-op calls, %d outstanding: %.0f calls/s\n", transport.c_str(), calls,
                  outstanding, calls / s);
      std::fflush(stdout);
    } else if (rank == 0) {
      std::vector<double> us;
      for (int i = 0; i < calls + 1000; ++i) {
        auto t0 = std::chrono::steady_clock::now();
        ferry::rpc_sync<int64_t>("w1", "noop", int64_t{i});
        if (i >= 1000) us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      std::sort(us.begin(), us.end());
      std::printf("%s: %d rpc_sync no-op calls, median %.1f us, p99 %.1f us\n", transport.c_str(), calls,
                  us[us.size() / 2], us[us.size() * 99 / 100]);
      std::fflush(stdout);
    }
    if (rank == 0 && std::getenv("LOOP_DEBUG") != nullptr) {
      // Both workers' counters (pool wake-ups, ring drives), for a profile's context.
      std::fprintf(stderr, "w1: %s\n", ferry::rpc_sync<std::string>("w1", "debug").c_str());
      std::string own;
      for (const auto& [k, v] : ferry::current_agent()->debug_info()) own += k + "=" + v + " ";
      std::fprintf(stderr, "w0: %s\n", own.c_str());
    }
    _exit(ferry::shutdown().ok() ? 0 : 1);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::filesystem::remove(store);
  return failed == 0 ? 0 : 1;
}
