// 02_model_parallel: a three-stage linear network split across workers 1..3, driven by
// worker 0. Each step, the driver sends a batch forward through the stages with
// rpc_sync, computes the mean squared error against a target, and sends the gradient
// back through the stages, each of which updates its own weights. After each step the
// driver asks every stage for its weight norm at once with rpc_async.
//
// Runs as 4 real processes on this host (forked here), meeting through file:// in a
// temporary directory. Usage: 02_model_parallel [steps] [--backend process_group]
// [--device cuda]. With --device cuda, activations and gradients live on cuda:0 of each
// worker and travel device to device: the driver's device maps send cuda:0 to each
// stage's cuda:0, and replies come back through the reverse maps. ferry has no CUDA
// kernels, so each stage computes on a host copy and returns its result on its device.
// Under a launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, each process
// is one worker meeting the others through env:// instead:
//   ferry run --standalone --nproc-per-node 4 build/examples/02_model_parallel 50
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/ferry.h"
#include "tensor/cuda.h"

namespace {

constexpr int kWorld = 4;
constexpr int64_t kBatch = 16;
constexpr int64_t kWidth = 8;
constexpr double kLearningRate = 0.05;

ferry::Tensor random_tensor(std::vector<int64_t> shape, uint32_t seed, double scale) {
  ferry::Tensor t = *ferry::Tensor::empty(std::move(shape), ferry::DType::kFloat32);
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, static_cast<float>(scale));
  for (float& v : t.span<float>()) v = dist(gen);
  return t;
}

// One stage: y = x W. Keeps x for the backward pass.
struct Stage {
  std::mutex mu;
  ferry::Tensor weight;
  ferry::Tensor input;
};

Stage& stage() {
  static Stage s;
  return s;
}

// `--device cuda`: tensors that cross workers live on this device (main() sets it).
ferry::Device wire_device = ferry::Device::cpu();

ferry::Tensor on_host(const ferry::Tensor& t) { return *t.to(ferry::Device::cpu()); }
ferry::Tensor on_wire(const ferry::Tensor& t) { return *t.to(wire_device); }

void register_stage_functions(int rank) {
  stage().weight = random_tensor({kWidth, kWidth}, 100 + static_cast<uint32_t>(rank), 0.5);
  (void)ferry::register_function("forward", [](ferry::Tensor x) -> absl::StatusOr<ferry::Tensor> {
    if (x.device() != wire_device) {
      return absl::FailedPreconditionError(absl::StrCat("the activation arrived on ", x.device().to_string()));
    }
    std::lock_guard<std::mutex> lock(stage().mu);
    stage().input = on_host(x);
    FERRY_ASSIGN_OR_RETURN(ferry::Tensor y, stage().input.matmul(stage().weight));
    return y.to(wire_device);
  });
  (void)ferry::register_function("backward", [](ferry::Tensor grad_y_in) -> absl::StatusOr<ferry::Tensor> {
    ferry::Tensor grad_y = on_host(grad_y_in);
    std::lock_guard<std::mutex> lock(stage().mu);
    FERRY_ASSIGN_OR_RETURN(ferry::Tensor w_t, stage().weight.transpose());
    FERRY_ASSIGN_OR_RETURN(ferry::Tensor grad_x, grad_y.matmul(w_t));
    FERRY_ASSIGN_OR_RETURN(ferry::Tensor x_t, stage().input.transpose());
    FERRY_ASSIGN_OR_RETURN(ferry::Tensor grad_w, x_t.matmul(grad_y));
    FERRY_ASSIGN_OR_RETURN(ferry::Tensor step, grad_w.mul(-kLearningRate));
    FERRY_ASSIGN_OR_RETURN(stage().weight, stage().weight.add(step));
    return grad_x.to(wire_device);
  });
  (void)ferry::register_function("weight_norm", [] {
    std::lock_guard<std::mutex> lock(stage().mu);
    double sum = 0;
    for (float v : stage().weight.span<float>()) sum += static_cast<double>(v) * v;
    return std::sqrt(sum);
  });
}

int drive(int steps) {
  ferry::Tensor x = random_tensor({kBatch, kWidth}, 1, 1.0);
  ferry::Tensor target_map = random_tensor({kWidth, kWidth}, 2, 0.3);
  ferry::Tensor target = *x.matmul(target_map);
  double first_loss = 0, loss = 0;
  for (int step = 0; step < steps; ++step) {
    ferry::Tensor h = on_wire(x);
    for (int s = 1; s < kWorld; ++s) {
      h = ferry::rpc_sync<ferry::Tensor>("worker" + std::to_string(s), "forward", h);
      if (step == 0) {
        std::printf("  forward:  rpc_sync worker%d.forward -> %s on %s\n", s, on_host(h).to_string().c_str(),
                    h.device().to_string().c_str());
      }
    }
    ferry::Tensor diff = *on_host(h).add(*target.mul(-1));
    loss = 0;
    for (float v : diff.span<float>()) loss += static_cast<double>(v) * v;
    loss /= static_cast<double>(diff.numel());
    if (step == 0) first_loss = loss;
    ferry::Tensor grad = on_wire(*diff.mul(2.0 / static_cast<double>(diff.numel())));
    for (int s = kWorld - 1; s >= 1; --s) {
      grad = ferry::rpc_sync<ferry::Tensor>("worker" + std::to_string(s), "backward", grad);
      if (step == 0) {
        std::printf("  backward: rpc_sync worker%d.backward (updates its weights) -> %s\n", s,
                    on_host(grad).to_string().c_str());
      }
    }
    if (step == 0) std::printf("  then: rpc_async weight_norm on workers 1-3 at once\n");
    std::vector<ferry::Future<double>> norms;
    for (int s = 1; s < kWorld; ++s) norms.push_back(ferry::rpc_async<double>("worker" + std::to_string(s), "weight_norm"));
    if (step % 10 == 0 || step == steps - 1) {
      std::printf("step %3d  loss %.6f  weight norms", step, loss);
      for (auto& n : norms) std::printf(" %.4f", n.wait());
      std::printf("\n");
    } else {
      for (auto& n : norms) n.wait();
    }
  }
  std::printf("loss went from %.6f to %.6f over %d steps across %d workers\n", first_loss, loss, steps, kWorld);
  return loss < first_loss ? 0 : 1;
}

// `--backend process_group` after the step count runs the workers on the PROCESS_GROUP
// backend (Gloo over TCP) instead of TENSORPIPE; main() sets this before forking.
bool use_process_group = false;

// With --device cuda, the driver maps its cuda:0 to each stage's cuda:0; the stages'
// replies come back through the reverse maps the init computes.
template <typename Options>
absl::Status set_maps(int rank, Options& options) {
  if (!wire_device.is_cuda() || rank != 0) return absl::OkStatus();
  for (int s = 1; s < kWorld; ++s) {
    FERRY_RETURN_IF_ERROR(options.set_device_map("worker" + std::to_string(s), {{wire_device, wire_device}}));
  }
  return absl::OkStatus();
}

absl::Status start_worker(const std::string& name, int rank, const std::string& init_method) {
  if (use_process_group) {
    ferry::ProcessGroupRpcBackendOptions options;
    options.init_method = init_method;
    options.num_worker_threads = 2;
    FERRY_RETURN_IF_ERROR(set_maps(rank, options));
    return ferry::init_rpc(name, ferry::BackendType::PROCESS_GROUP, rank, kWorld, options);
  }
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = init_method;
  options.num_worker_threads = 2;
  FERRY_RETURN_IF_ERROR(set_maps(rank, options));
  return ferry::init_rpc(name, rank, kWorld, options);
}

int run(int rank, const std::string& init_method, int steps) {
  if (rank > 0) register_stage_functions(rank);
  std::string name = "worker" + std::to_string(rank);
  absl::Status started = start_worker(name, rank, init_method);
  if (!started.ok()) {
    std::cerr << name << ": init_rpc failed: " << started << "\n";
    return 1;
  }
  int code = 0;
  if (rank == 0) {
    std::printf("worker0: driving a %d-stage model across workers:", kWorld - 1);
    for (const ferry::WorkerInfo& w : ferry::get_worker_infos()) std::printf(" %s(id %d)", w.name.c_str(), w.id);
    std::printf("\n");
    try {
      code = drive(steps);
    } catch (const ferry::RpcError& e) {
      std::cerr << "worker0: " << e.what() << "\n";
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
  int steps = argc > 1 ? std::atoi(argv[1]) : 50;
  if (std::getenv("RANK") != nullptr && std::getenv("MASTER_ADDR") != nullptr) {  // started by a launcher
    const char* world = std::getenv("WORLD_SIZE");
    if (world == nullptr || std::atoi(world) != kWorld) {
      std::fprintf(stderr, "02_model_parallel needs WORLD_SIZE=%d (e.g. --nproc-per-node %d), got %s\n", kWorld, kWorld,
                   world == nullptr ? "none" : world);
      return 2;
    }
    return run(std::atoi(std::getenv("RANK")), "env://", steps);
  }
  std::string dir = std::filesystem::temp_directory_path() / ("ferry-demo-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::string init_method = "file://" + dir + "/store";
  for (int i = 2; i + 1 < argc; ++i) {
    std::string flag = argv[i], value = argv[i + 1];
    if (flag == "--backend") use_process_group = value == "process_group";
    if (flag == "--device") {
      if (value != "cuda" && value != "cpu") {
        std::fprintf(stderr, "02_model_parallel: --device %s: expected cpu or cuda\n", value.c_str());
        return 2;
      }
      if (value == "cuda") {
        if (std::string why = ferry::cuda_missing_in_child(); !why.empty()) {
          std::fprintf(stderr, "02_model_parallel: --device cuda needs a CUDA device: %s\n", why.c_str());
          std::filesystem::remove_all(dir);
          return 2;
        }
        wire_device = ferry::Device::cuda(0);
      }
    }
  }
  std::fflush(stdout);
  std::vector<pid_t> children;
  for (int rank = 0; rank < kWorld; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = run(rank, init_method, steps);
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
  std::printf("%s\n", failures == 0 ? "demo finished: all 4 workers exited cleanly" : "demo FAILED");
  return failures == 0 ? 0 : 1;
}
