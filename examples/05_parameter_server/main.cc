// 05_parameter_server: asynchronous SGD with a parameter server behind an RRef.
//
// worker "driver" creates the server's state on worker "ps" with remote(): the weights
// live there, and the driver holds only an RRef<ParameterServer>. It passes that RRef
// to N trainers (each gets its own fork of the reference). Every trainer fits a linear
// model to its own shard of data: it reads the current weights through the RRef,
// computes a gradient locally and sends it back with rpc_async, without waiting for
// the other trainers (updates are applied in whatever order they arrive). At the end
// the driver reads the weights once more and reports the loss before and after.
//
// Runs self-forked (N + 2 processes on this host, meeting through file://), or as one
// rank under any env:// launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set;
// rank 0 is the driver, rank 1 the server, the others trainers):
//   05_parameter_server [trainers=2] [steps=40]
//   ferry run --standalone --nproc-per-node 4 ./05_parameter_server
//   torchrun --no-python --standalone --nproc-per-node 4 ./05_parameter_server   (the same)
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "rpc/ferry.h"

namespace {

constexpr int64_t kFeatures = 16;
constexpr int64_t kSamples = 64;  // per trainer
constexpr double kLearningRate = 0.05;

ferry::Tensor random_tensor(std::vector<int64_t> shape, uint32_t seed, double scale) {
  ferry::Tensor t = *ferry::Tensor::empty(std::move(shape), ferry::DType::kFloat32);
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, static_cast<float>(scale));
  for (float& v : t.span<float>()) v = dist(gen);
  return t;
}

// The data every trainer (and the driver, to evaluate) draws from: y = x w_true.
struct Shard {
  ferry::Tensor x, y;
};
Shard shard(uint32_t seed) {
  static const ferry::Tensor w_true = random_tensor({kFeatures, 1}, 7, 1.0);
  Shard s;
  s.x = random_tensor({kSamples, kFeatures}, seed, 1.0);
  s.y = *s.x.matmul(w_true);
  return s;
}

double mse(const ferry::Tensor& w, const Shard& data) {
  ferry::Tensor diff = *data.x.matmul(w)->add(*data.y.mul(-1));
  double sum = 0;
  for (float v : diff.span<float>()) sum += static_cast<double>(v) * v;
  return sum / static_cast<double>(diff.numel());
}

// The server's state. It lives on worker "ps"; everyone else holds an RRef to it. The
// mutex is shared so the state can be moved into place once.
struct ParameterServer {
  ferry::Tensor weights;
  int64_t updates = 0;
  std::shared_ptr<std::mutex> mu = std::make_shared<std::mutex>();

  template <class Archive>
  void serialize(Archive& ar) {
    ar(weights, updates);
  }
};

using PsRef = ferry::RRef<ParameterServer>;

// Typed handles; every process registers the same functions.
struct Functions {
  ferry::RemoteFunction<ParameterServer()> make_server{"ps.make"};
  ferry::RemoteFunction<ferry::Tensor(PsRef)> get_weights{"ps.get_weights"};
  ferry::RemoteFunction<int64_t(PsRef, ferry::Tensor)> apply_gradient{"ps.apply_gradient"};
  ferry::RemoteFunction<double(PsRef, int64_t, int64_t)> train{"trainer.train"};
};
const Functions fns;

// Runs on a trainer: `steps` rounds of read weights, compute gradient, send update.
double train(PsRef ps, int64_t trainer, int64_t steps) {
  Shard data = shard(100 + static_cast<uint32_t>(trainer));
  ferry::Future<int64_t> in_flight;
  ferry::Tensor w;
  for (int64_t step = 0; step < steps; ++step) {
    w = ps.rpc_sync(fns.get_weights);
    // grad = 2/n x^T (x w - y)
    ferry::Tensor diff = *data.x.matmul(w)->add(*data.y.mul(-1));
    ferry::Tensor grad = *data.x.transpose()->matmul(diff)->mul(2.0 / static_cast<double>(kSamples));
    // Asynchronous update: at most one of ours in flight, never waiting for the others.
    if (in_flight.valid()) in_flight.wait();
    in_flight = ps.rpc_async(fns.apply_gradient, grad);
  }
  if (in_flight.valid()) in_flight.wait();
  double loss = mse(ps.rpc_sync(fns.get_weights), data);
  std::printf("  trainer%lld: %lld steps done, loss on its shard %.6f\n", static_cast<long long>(trainer),
              static_cast<long long>(steps), loss);
  std::fflush(stdout);
  return loss;
}

void register_functions() {
  (void)ferry::register_function("ps.make", [] {
    ParameterServer ps;
    ps.weights = *ferry::Tensor::zeros({kFeatures, 1}, ferry::DType::kFloat32);
    return ps;
  });
  (void)ferry::register_function("ps.get_weights", [](PsRef ps) {
    ParameterServer& s = ps.local_value();
    std::lock_guard<std::mutex> lock(*s.mu);
    return s.weights;  // updates replace the tensor, so this one never changes
  });
  (void)ferry::register_function("ps.apply_gradient", [](PsRef ps, ferry::Tensor grad) -> absl::StatusOr<int64_t> {
    ParameterServer& s = ps.local_value();
    std::lock_guard<std::mutex> lock(*s.mu);
    FERRY_ASSIGN_OR_RETURN(ferry::Tensor step, grad.mul(-kLearningRate));
    FERRY_ASSIGN_OR_RETURN(s.weights, s.weights.add(step));
    return ++s.updates;
  });
  (void)ferry::register_function("trainer.train", &train);
}

int drive(int trainers, int64_t steps) {
  Shard eval = shard(1);
  PsRef ps = ferry::remote("ps", fns.make_server);
  std::printf("driver: the weights live on \"%s\" (%s)\n", ps.owner().name.c_str(), ps.to_string().c_str());
  std::fflush(stdout);
  double before = mse(ps.rpc_sync(fns.get_weights), eval);
  std::vector<ferry::Future<double>> done;
  for (int t = 1; t <= trainers; ++t) {
    done.push_back(ferry::rpc_async("trainer" + std::to_string(t), fns.train, ps, t, steps));
  }
  for (auto& d : done) d.wait();
  ParameterServer final_state = ps.to_here();
  double after = mse(final_state.weights, eval);
  std::printf("driver: the server applied %lld updates from %d trainers; loss %.6f -> %.6f\n",
              static_cast<long long>(final_state.updates), trainers, before, after);
  bool ok = final_state.updates == trainers * steps && after < before * 0.1;
  return ok ? 0 : 1;
}

int run(int rank, int world, const std::string& init_method, int64_t steps) {
  register_functions();
  std::string name = rank == 0 ? "driver" : rank == 1 ? "ps" : "trainer" + std::to_string(rank - 1);
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = init_method;
  options.num_worker_threads = 4;
  absl::Status started = ferry::init_rpc(name, rank, world, options);
  if (!started.ok()) {
    std::cerr << name << ": init_rpc failed: " << started << "\n";
    return 1;
  }
  int code = 0;
  if (rank == 0) {
    try {
      code = drive(world - 2, steps);
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
  int trainers = argc > 1 ? std::atoi(argv[1]) : 2;
  int64_t steps = argc > 2 ? std::atoll(argv[2]) : 40;
  // Under a launcher: this process is one rank.
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank != nullptr && world != nullptr && std::getenv("MASTER_ADDR") != nullptr &&
      std::getenv("MASTER_PORT") != nullptr) {
    if (std::atoi(world) < 3) {
      std::cerr << "05_parameter_server needs WORLD_SIZE >= 3 (a driver, the server, trainers)\n";
      return 2;
    }
    return run(std::atoi(rank), std::atoi(world), "env://", steps);
  }
  if (trainers < 1) {
    std::cerr << "usage: 05_parameter_server [trainers >= 1] [steps]\n";
    return 2;
  }
  int size = trainers + 2;
  std::string dir = std::filesystem::temp_directory_path() / ("ferry-ps-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::fflush(stdout);
  std::vector<pid_t> children;
  for (int r = 0; r < size; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = run(r, size, "file://" + dir + "/store", steps);
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
  std::printf("%s\n",
              failures == 0 ? "parameter server finished: every worker exited cleanly" : "parameter server FAILED");
  return failures == 0 ? 0 : 1;
}
