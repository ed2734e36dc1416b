// 06_pipeline: micro-batches pipelined across model stages with rpc_async.
//
// A network of S stages, one per worker ("stage1".."stageS"), driven by worker
// "driver". A batch is split into M micro-batches. The sequential pass sends each
// micro-batch through every stage before the next one starts, so only one stage works
// at a time. The pipelined pass runs a wavefront: at clock tick t, stage s works on
// micro-batch t - s, all stages at once (one rpc_async each), so after S - 1 ticks of
// filling every stage is busy. Both passes must give the same output; the driver prints
// both times and the speedup (at best S*M / (M + S - 1), with a free core per stage).
//
// Runs self-forked (S + 1 processes on this host, meeting through file://), or as one
// rank under any env:// launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set;
// rank 0 is the driver, ranks 1.. the stages):
//   06_pipeline [stages=3] [micro_batches=8] [rounds=3]
//   ferry run --standalone --nproc-per-node 4 ./06_pipeline
//   torchrun --no-python --standalone --nproc-per-node 4 ./06_pipeline   (the same)
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "rpc/ferry.h"

namespace {

constexpr int64_t kWidth = 192;
constexpr int64_t kRows = 32;  // per micro-batch
constexpr int kLayers = 4;     // matmuls per stage, to give each stage real work

ferry::Tensor random_tensor(std::vector<int64_t> shape, uint32_t seed, double scale) {
  ferry::Tensor t = *ferry::Tensor::empty(std::move(shape), ferry::DType::kFloat32);
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, static_cast<float>(scale));
  for (float& v : t.span<float>()) v = dist(gen);
  return t;
}

// One stage: kLayers of y = tanh(x W_i). A stage works on one micro-batch at a time,
// as a device would.
struct Stage {
  std::mutex mu;
  std::vector<ferry::Tensor> weights;
};
Stage& stage() {
  static Stage s;
  return s;
}

absl::StatusOr<ferry::Tensor> forward(ferry::Tensor x) {
  std::lock_guard<std::mutex> lock(stage().mu);
  for (const ferry::Tensor& w : stage().weights) {
    FERRY_ASSIGN_OR_RETURN(x, x.matmul(w));
    for (float& v : x.span<float>()) v = std::tanh(v);
  }
  return x;
}

const ferry::RemoteFunction<ferry::Tensor(ferry::Tensor)> kForward("stage.forward");

std::string stage_name(int s) { return "stage" + std::to_string(s); }

using Clock = std::chrono::steady_clock;

std::vector<ferry::Tensor> sequential(const std::vector<ferry::Tensor>& batches, int stages) {
  std::vector<ferry::Tensor> out;
  for (const ferry::Tensor& mb : batches) {
    ferry::Tensor h = mb;
    for (int s = 1; s <= stages; ++s) h = ferry::rpc_sync(stage_name(s), kForward, h);
    out.push_back(h);
  }
  return out;
}

std::vector<ferry::Tensor> pipelined(const std::vector<ferry::Tensor>& batches, int stages) {
  const int m = static_cast<int>(batches.size());
  std::vector<ferry::Tensor> act = batches;  // act[i]: micro-batch i after the stages it has passed
  for (int tick = 0; tick < m + stages - 1; ++tick) {
    std::vector<std::pair<int, ferry::Future<ferry::Tensor>>> running;
    for (int s = 1; s <= stages; ++s) {
      int i = tick - (s - 1);
      if (i < 0 || i >= m) continue;
      running.emplace_back(i, ferry::rpc_async(stage_name(s), kForward, act[static_cast<size_t>(i)]));
    }
    for (auto& [i, f] : running) act[static_cast<size_t>(i)] = f.wait();
  }
  return act;
}

int drive(int stages, int micro_batches, int rounds) {
  std::vector<ferry::Tensor> batches;
  for (int i = 0; i < micro_batches; ++i) batches.push_back(random_tensor({kRows, kWidth}, 1000 + i, 1.0));
  // Warm up: connections and buffers on every stage.
  (void)sequential({batches[0]}, stages);
  double best_seq = 1e30, best_pipe = 1e30;
  bool same = true;
  for (int r = 0; r < rounds; ++r) {
    auto t0 = Clock::now();
    std::vector<ferry::Tensor> a = sequential(batches, stages);
    auto t1 = Clock::now();
    std::vector<ferry::Tensor> b = pipelined(batches, stages);
    auto t2 = Clock::now();
    best_seq = std::min(best_seq, std::chrono::duration<double, std::milli>(t1 - t0).count());
    best_pipe = std::min(best_pipe, std::chrono::duration<double, std::milli>(t2 - t1).count());
    for (size_t i = 0; i < a.size(); ++i) same = same && a[i].equal(b[i]);
  }
  double ideal = static_cast<double>(stages) * micro_batches / (micro_batches + stages - 1);
  std::printf("driver: %d stages x %d micro-batches of %lldx%lld, best of %d rounds\n", stages, micro_batches,
              static_cast<long long>(kRows), static_cast<long long>(kWidth), rounds);
  std::printf("  sequential pass: %8.2f ms\n", best_seq);
  std::printf("  pipelined pass:  %8.2f ms\n", best_pipe);
  std::printf("  speedup %.2fx (ideal %.2fx with a free core per stage; this host has %ld)\n", best_seq / best_pipe,
              ideal, sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("  outputs of both passes %s\n", same ? "identical" : "DIFFER");
  return same ? 0 : 1;
}

int run(int rank, int world, const std::string& init_method, int micro_batches, int rounds) {
  if (rank > 0) {
    for (int l = 0; l < kLayers; ++l) {
      stage().weights.push_back(
          random_tensor({kWidth, kWidth}, static_cast<uint32_t>(rank * 100 + l), 1.0 / std::sqrt(kWidth)));
    }
  }
  (void)ferry::register_function("stage.forward", &forward);
  std::string name = rank == 0 ? "driver" : stage_name(rank);
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = init_method;
  options.num_worker_threads = 2;
  absl::Status started = ferry::init_rpc(name, rank, world, options);
  if (!started.ok()) {
    std::cerr << name << ": init_rpc failed: " << started << "\n";
    return 1;
  }
  int code = 0;
  if (rank == 0) {
    try {
      code = drive(world - 1, micro_batches, rounds);
    } catch (const ferry::RpcError& e) {
      std::cerr << "driver: " << e.what() << "\n";
      code = 1;
    }
  }
  absl::Status stopped = ferry::shutdown();
  if (!stopped.ok()) {
    std::cerr << name << ": shutdown: " << stopped << "\n";
    code = 1;
  }
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  int stages = argc > 1 ? std::atoi(argv[1]) : 3;
  int micro_batches = argc > 2 ? std::atoi(argv[2]) : 8;
  int rounds = argc > 3 ? std::atoi(argv[3]) : 3;
  if (micro_batches < 1 || rounds < 1) {
    std::cerr << "usage: 06_pipeline [stages >= 1] [micro_batches >= 1] [rounds >= 1]\n";
    return 2;
  }
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank != nullptr && world != nullptr && std::getenv("MASTER_ADDR") != nullptr &&
      std::getenv("MASTER_PORT") != nullptr) {
    if (std::atoi(world) < 2) {
      std::cerr << "06_pipeline needs WORLD_SIZE >= 2 (a driver and at least one stage)\n";
      return 2;
    }
    return run(std::atoi(rank), std::atoi(world), "env://", micro_batches, rounds);
  }
  if (stages < 1) {
    std::cerr << "usage: 06_pipeline [stages >= 1] [micro_batches >= 1] [rounds >= 1]\n";
    return 2;
  }
  int size = stages + 1;
  std::string dir = std::filesystem::temp_directory_path() / ("ferry-pipeline-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::fflush(stdout);
  std::vector<pid_t> children;
  for (int r = 0; r < size; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = run(r, size, "file://" + dir + "/store", micro_batches, rounds);
      std::fflush(stdout);
      _exit(code);
    }
    children.push_back(pid);
  }
  int failures = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failures;
  }
  std::filesystem::remove_all(dir);
  std::printf("%s\n", failures == 0 ? "pipeline finished: every worker exited cleanly" : "pipeline FAILED");
  return failures == 0 ? 0 : 1;
}
