// 07_torch_model_parallel: a libtorch model split into stages on 3 workers, trained.
//
// The model is a torch::nn MLP cut in three: each stage ("stage1".."stage3") holds its
// torch::nn::Sequential and its own torch::optim::Adam. Worker "driver" holds the data
// (a synthetic regression task) and the loss. Every step is GPipe's schedule:
//   forward:  the batch is split into micro-batches that flow through the stages as a
//             wavefront (at tick t, stage s works on micro-batch t - s; one rpc_async
//             per stage per tick, as in 06_pipeline); each stage keeps its input and
//             output graph per micro-batch;
//   loss:     the driver computes the MSE of each micro-batch's output, and its
//             gradient with respect to that output;
//   backward: the gradients flow back as a reverse wavefront; each stage runs autograd
//             from its saved output and returns the gradient of its input;
//   step:     every stage's optimizer steps on the gradients accumulated over the
//             micro-batches (rpc_async to each, then wait for all).
// On the first step the driver also checks that the pipeline's gradients are those of
// the whole model run in one process.
// at::Tensors are arguments and results of the calls (torch/wire.h): nothing converts
// them by hand, and none is copied on the sending side. The driver prints the loss
// curve and exits 1 unless the loss fell to a quarter of where it started.
//
// Runs self-forked (S + 1 processes on this host, meeting through file://), or as one
// rank under any env:// launcher (rank 0 is the driver, ranks 1.. the stages):
//   07_torch_model_parallel [stages=3] [steps=300] [micro_batches=4]
//   ferry run --standalone --nproc-per-node 4 ./07_torch_model_parallel
#include <sys/wait.h>
#include <unistd.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "rpc/ferry.h"
#include "torch/wire.h"

namespace {

constexpr int64_t kInputs = 8;
constexpr int64_t kHidden = 64;
constexpr int64_t kBatch = 64;

// Stage s of S: Linear + Tanh, except the last, which maps to one output.
torch::nn::Sequential make_stage(int s, int stages) {
  int64_t in = s == 1 ? kInputs : kHidden;
  if (s == stages) return torch::nn::Sequential(torch::nn::Linear(in, 1));
  return torch::nn::Sequential(torch::nn::Linear(in, kHidden), torch::nn::Tanh());
}

// What one stage worker holds. The driver's wavefront sends a stage at most one call
// at a time, but the pool may run calls on either thread: the mutex orders them.
struct Stage {
  std::mutex mu;
  torch::nn::Sequential module{nullptr};
  std::unique_ptr<torch::optim::Adam> optimizer;
  // Per micro-batch of the current step: the input (a leaf that requires grad) and the
  // output, whose graph backward() walks.
  std::map<int64_t, std::pair<at::Tensor, at::Tensor>> saved;
};
Stage& stage() {
  static Stage s;
  return s;
}

// The received activation wraps ferry's receive buffer (no copy); making it a leaf
// that requires grad lets autograd give back the gradient of this stage's input.
at::Tensor stage_forward(int64_t micro_batch, at::Tensor x) {
  std::lock_guard<std::mutex> lock(stage().mu);
  at::Tensor input = x.requires_grad_(true);
  at::Tensor output = stage().module->forward(input);
  stage().saved[micro_batch] = {input, output};
  return output.detach();
}

at::Tensor stage_backward(int64_t micro_batch, at::Tensor grad_output) {
  std::lock_guard<std::mutex> lock(stage().mu);
  auto it = stage().saved.find(micro_batch);
  if (it == stage().saved.end()) throw std::runtime_error("backward of a micro-batch this stage never saw");
  auto [input, output] = it->second;
  stage().saved.erase(it);
  output.backward(grad_output);
  return input.grad();
}

// The stage's parameters and their accumulated gradients, interleaved, for the
// driver's check against a one-process run.
std::vector<at::Tensor> stage_state() {
  std::lock_guard<std::mutex> lock(stage().mu);
  std::vector<at::Tensor> out;
  for (const at::Tensor& p : stage().module->parameters()) {
    out.push_back(p.detach());
    out.push_back(p.grad());
  }
  return out;
}

void stage_step() {
  std::lock_guard<std::mutex> lock(stage().mu);
  stage().optimizer->step();
  stage().optimizer->zero_grad();
}

const ferry::RemoteFunction<at::Tensor(int64_t, at::Tensor)> kForward("stage.forward");
const ferry::RemoteFunction<at::Tensor(int64_t, at::Tensor)> kBackward("stage.backward");
const ferry::RemoteFunction<void()> kStep("stage.step");
const ferry::RemoteFunction<std::vector<at::Tensor>()> kState("stage.state");

std::string stage_name(int s) { return "stage" + std::to_string(s); }

// The task: y = sin(2 x0) cos(x1) + x2 x3 / 2 + noise, for x uniform in [-1, 1]^8.
std::pair<at::Tensor, at::Tensor> make_batch(torch::Generator& gen) {
  at::Tensor x = torch::rand({kBatch, kInputs}, gen) * 2 - 1;
  at::Tensor y = torch::sin(2 * x.select(1, 0)) * torch::cos(x.select(1, 1)) + x.select(1, 2) * x.select(1, 3) / 2;
  y = y + 0.01 * torch::randn({kBatch}, gen);
  return {x, y.unsqueeze(1)};
}

// Whether the gradients the stages accumulated from the pipeline are the gradients of
// the same model run whole in this process: rebuilds it from the stages' parameters,
// runs the batch through it, and compares every parameter's gradient.
bool gradients_match(const at::Tensor& x, const at::Tensor& y, int stages) {
  std::vector<torch::nn::Sequential> parts;
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> remote_grads;
  for (int s = 1; s <= stages; ++s) {
    parts.push_back(make_stage(s, stages));
    std::vector<at::Tensor> state = ferry::rpc_sync(stage_name(s), kState);
    std::vector<at::Tensor> own = parts.back()->parameters();
    if (state.size() != 2 * own.size()) return false;
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < own.size(); ++i) {
      own[i].copy_(state[2 * i]);
      params.push_back(own[i]);
      remote_grads.push_back(state[2 * i + 1]);
    }
  }
  at::Tensor h = x;
  for (torch::nn::Sequential& part : parts) h = part->forward(h);
  torch::mse_loss(h, y).backward();
  double worst = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    if (!remote_grads[i].defined()) return false;
    worst = std::max(worst, (params[i].grad() - remote_grads[i]).abs().max().item<double>());
  }
  std::printf("driver: step 0 gradients of all %zu parameter tensors match a one-process run (max diff %.2g)\n",
              params.size(), worst);
  return worst < 1e-5;
}

// One training step over `micro_batches` micro-batches; returns the batch's loss.
// With `check`, the stages' gradients are compared with a one-process run first.
double train_step(const at::Tensor& x, const at::Tensor& y, int stages, int micro_batches, bool check) {
  std::vector<at::Tensor> inputs = x.chunk(micro_batches);
  std::vector<at::Tensor> targets = y.chunk(micro_batches);
  const int m = static_cast<int>(inputs.size());

  // Forward wavefront. chunk() gives contiguous row blocks, which travel as they are.
  std::vector<at::Tensor> act = inputs;
  for (int tick = 0; tick < m + stages - 1; ++tick) {
    std::vector<std::pair<int, ferry::Future<at::Tensor>>> running;
    for (int s = 1; s <= stages; ++s) {
      int i = tick - (s - 1);
      if (i < 0 || i >= m) continue;
      running.emplace_back(i, ferry::rpc_async(stage_name(s), kForward, int64_t{i}, act[i]));
    }
    for (auto& [i, f] : running) act[i] = f.wait();
  }

  // The loss of each micro-batch, scaled so the stages accumulate the batch's mean.
  std::vector<at::Tensor> grads(static_cast<size_t>(m));
  double loss_sum = 0;
  for (int i = 0; i < m; ++i) {
    at::Tensor out = act[i].requires_grad_(true);
    at::Tensor loss = torch::mse_loss(out, targets[i]) * (static_cast<double>(out.size(0)) / x.size(0));
    loss.backward();
    grads[i] = out.grad();
    loss_sum += loss.item<double>();
  }

  // Backward wavefront, last stage first.
  for (int tick = 0; tick < m + stages - 1; ++tick) {
    std::vector<std::pair<int, ferry::Future<at::Tensor>>> running;
    for (int s = stages; s >= 1; --s) {
      int i = tick - (stages - s);
      if (i < 0 || i >= m) continue;
      running.emplace_back(i, ferry::rpc_async(stage_name(s), kBackward, int64_t{i}, grads[i]));
    }
    for (auto& [i, f] : running) grads[i] = f.wait();
  }
  if (check && !gradients_match(x, y, stages)) {
    throw std::runtime_error("the pipeline's gradients differ from a one-process run of the same model");
  }

  std::vector<ferry::Future<ferry::Void>> steps;
  for (int s = 1; s <= stages; ++s) steps.push_back(ferry::rpc_async(stage_name(s), kStep));
  for (auto& f : steps) f.wait();
  return loss_sum;
}

int drive(int stages, int steps, int micro_batches) {
  torch::Generator gen = at::detail::createCPUGenerator(7);
  std::vector<double> losses;
  auto t0 = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = make_batch(gen);
    losses.push_back(train_step(x, y, stages, micro_batches, step == 0));
    if (step % 25 == 0 || step == steps - 1) std::printf("driver: step %4d  loss %.5f\n", step, losses.back());
  }
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto mean = [&](size_t from, size_t to) {
    double sum = 0;
    for (size_t i = from; i < to; ++i) sum += losses[i];
    return sum / static_cast<double>(to - from);
  };
  size_t window = std::min<size_t>(10, losses.size());
  double first = mean(0, window);
  double last = mean(losses.size() - window, losses.size());
  std::printf("driver: %d stages, %d micro-batches of %lld rows, %d steps in %.2f s\n", stages, micro_batches,
              static_cast<long long>(kBatch / micro_batches), steps, seconds);
  std::printf("driver: mean loss of the first %zu steps %.5f, of the last %zu %.5f (%.1fx lower)\n", window, first,
              window, last, first / last);
  if (!(last < first / 4)) {
    std::printf("driver: FAILED: the loss did not fall to a quarter of where it started\n");
    return 1;
  }
  return 0;
}

int run(int rank, int world, const std::string& init_method, int steps, int micro_batches) {
  // One intra-op thread per process: the stages are the parallelism, and this host's
  // cores are shared by all of them.
  torch::set_num_threads(1);
  const int stages = world - 1;
  if (rank > 0) {
    torch::manual_seed(100 + rank);
    stage().module = make_stage(rank, stages);
    stage().optimizer =
        std::make_unique<torch::optim::Adam>(stage().module->parameters(), torch::optim::AdamOptions(3e-3));
  }
  (void)ferry::register_function("stage.forward", &stage_forward);
  (void)ferry::register_function("stage.backward", &stage_backward);
  (void)ferry::register_function("stage.step", &stage_step);
  (void)ferry::register_function("stage.state", &stage_state);
  std::string name = rank == 0 ? "driver" : stage_name(rank);
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = init_method;
  options.num_worker_threads = 2;
  options.rpc_timeout = std::chrono::seconds(60);
  absl::Status started = ferry::init_rpc(name, rank, world, options);
  if (!started.ok()) {
    std::cerr << name << ": init_rpc failed: " << started << "\n";
    return 1;
  }
  int code = 0;
  if (rank == 0) {
    try {
      code = drive(stages, steps, micro_batches);
    } catch (const std::exception& e) {  // ferry::RpcError, or the gradient check
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

constexpr char kUsage[] = "usage: 07_torch_model_parallel [stages >= 1] [steps >= 10] [micro_batches 1..64]\n";

}  // namespace

int main(int argc, char** argv) {
  int stages = argc > 1 ? std::atoi(argv[1]) : 3;
  int steps = argc > 2 ? std::atoi(argv[2]) : 300;
  int micro_batches = argc > 3 ? std::atoi(argv[3]) : 4;
  if (steps < 10 || micro_batches < 1 || micro_batches > kBatch) {
    std::cerr << kUsage;
    return 2;
  }
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank != nullptr && world != nullptr && std::getenv("MASTER_ADDR") != nullptr &&
      std::getenv("MASTER_PORT") != nullptr) {
    if (std::atoi(world) < 2) {
      std::cerr << "07_torch_model_parallel needs WORLD_SIZE >= 2 (a driver and at least one stage)\n";
      return 2;
    }
    return run(std::atoi(rank), std::atoi(world), "env://", steps, micro_batches);
  }
  if (stages < 1) {
    std::cerr << kUsage;
    return 2;
  }
  // Fork before anything touches libtorch: its thread pools do not survive a fork.
  int size = stages + 1;
  std::string dir =
      std::filesystem::temp_directory_path() / ("ferry-torch-model-parallel-" + std::to_string(getpid()));
  std::filesystem::create_directories(dir);
  std::fflush(stdout);
  std::vector<pid_t> children;
  for (int r = 0; r < size; ++r) {
    pid_t pid = fork();
    if (pid == 0) {
      int code = run(r, size, "file://" + dir + "/store", steps, micro_batches);
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
  std::printf("%s\n", failures == 0 ? "training finished: every worker exited cleanly" : "training FAILED");
  return failures == 0 ? 0 : 1;
}
