// 08_torch_parameter_server: trainers pull parameters and push gradients through an
// RRef to a libtorch model that lives on a parameter server.
//
// Worker "driver" creates the server's state on worker "ps" with remote(): a
// torch::nn MLP and its torch::optim::Adam live there, and the driver
// holds only an RRef<ParameterServer>. It hands the RRef to N trainers. Each trainer
// keeps a replica of the model; every step it pulls the current parameters through the
// RRef, computes the loss and gradients of a mini-batch of its own data with autograd,
// and pushes the gradients back with rpc_async, without waiting for the other
// trainers: the server's optimizer steps on each push as it arrives (asynchronous
// training; Adam rather than SGD with momentum, since asynchrony already acts as
// momentum and the two together diverged here with 3 trainers). at::Tensors (and
// vectors of them) are the calls' arguments and results (torch/wire.h). The trainers print their loss curves; the driver evaluates the
// model on held-out data before and after, and exits 1 unless the loss fell to a
// quarter or less, or an update went missing.
//
// Runs self-forked (N + 2 processes on this host, meeting through file://), or as one
// rank under any env:// launcher (rank 0 the driver, rank 1 the server, the rest
// trainers):
//   08_torch_parameter_server [trainers=2] [steps=200]
//   ferry run --standalone --nproc-per-node 4 ./08_torch_parameter_server
#include <sys/wait.h>
#include <unistd.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rpc/ferry.h"
#include "torch/wire.h"

namespace {

constexpr int64_t kInputs = 4;
constexpr int64_t kHidden = 32;
constexpr int64_t kBatch = 32;

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(kInputs, kHidden), torch::nn::Tanh(),
                               torch::nn::Linear(kHidden, 1));
}

// The task: y = sin(3 x0) / 2 + x1 x2 - x3 / 4, x uniform in [-1, 1]^4.
std::pair<at::Tensor, at::Tensor> make_batch(torch::Generator& gen, int64_t rows) {
  at::Tensor x = torch::rand({rows, kInputs}, gen) * 2 - 1;
  at::Tensor y = torch::sin(3 * x.select(1, 0)) / 2 + x.select(1, 1) * x.select(1, 2) - x.select(1, 3) / 4;
  return {x, y.unsqueeze(1)};
}

// The server's state. The live part (model, optimizer, lock) exists only on "ps";
// what travels (to_here) is a snapshot of the parameters and the update count.
struct ParameterServer {
  struct Live {
    std::mutex mu;
    torch::nn::Sequential model = make_model();
    torch::optim::Adam optimizer{model->parameters(), torch::optim::AdamOptions(5e-3)};
    int64_t updates = 0;
  };
  std::shared_ptr<Live> live;
  std::vector<at::Tensor> parameters;  // a snapshot, in a copy that travelled
  int64_t updates = 0;

  // Parameters are cloned under the lock: the optimizer updates them in place, and a
  // tensor must not change while ferry sends it.
  std::vector<at::Tensor> snapshot(int64_t* count) const {
    if (!live) {
      *count = updates;
      return parameters;
    }
    std::lock_guard<std::mutex> lock(live->mu);
    std::vector<at::Tensor> out;
    for (const at::Tensor& p : live->model->parameters()) out.push_back(p.detach().clone());
    *count = live->updates;
    return out;
  }
  template <class Archive>
  void save(Archive& ar) const {
    int64_t count = 0;
    std::vector<at::Tensor> params = snapshot(&count);
    ar(params, count);
  }
  template <class Archive>
  void load(Archive& ar) {
    ar(parameters, updates);
  }
};

using PsRef = ferry::RRef<ParameterServer>;

struct Functions {
  ferry::RemoteFunction<ParameterServer()> make_server{"ps.make"};
  ferry::RemoteFunction<std::vector<at::Tensor>(PsRef)> pull{"ps.pull"};
  ferry::RemoteFunction<int64_t(PsRef, std::vector<at::Tensor>)> push{"ps.push"};
  ferry::RemoteFunction<double(PsRef, int64_t, int64_t)> train{"trainer.train"};
};
const Functions fns;

// Copies parameters into a model's own (which autograd then uses).
void load_parameters(torch::nn::Sequential& model, const std::vector<at::Tensor>& values) {
  torch::NoGradGuard no_grad;
  std::vector<at::Tensor> params = model->parameters();
  if (params.size() != values.size()) throw std::runtime_error("parameter count mismatch");
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(values[i]);
}

double evaluate(const std::vector<at::Tensor>& parameters) {
  torch::nn::Sequential model = make_model();
  load_parameters(model, parameters);
  torch::Generator gen = at::detail::createCPUGenerator(12345);
  auto [x, y] = make_batch(gen, 1024);
  torch::NoGradGuard no_grad;
  return torch::mse_loss(model->forward(x), y).item<double>();
}

// Runs on a trainer: `steps` rounds of pull, compute gradients, push.
double train(PsRef ps, int64_t trainer, int64_t steps) {
  torch::nn::Sequential replica = make_model();
  torch::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000 + trainer));
  ferry::Future<int64_t> in_flight;
  double loss_value = 0;
  for (int64_t step = 0; step < steps; ++step) {
    load_parameters(replica, ps.rpc_sync(fns.pull));
    replica->zero_grad();
    auto [x, y] = make_batch(gen, kBatch);
    at::Tensor loss = torch::mse_loss(replica->forward(x), y);
    loss.backward();
    loss_value = loss.item<double>();
    std::vector<at::Tensor> grads;
    // The replica's gradients are fresh tensors each step (zero_grad resets them to
    // undefined), so they stay unchanged while the push is in flight.
    for (const at::Tensor& p : replica->parameters()) grads.push_back(p.grad());
    // At most one of ours in flight, never waiting for the other trainers.
    if (in_flight.valid()) in_flight.wait();
    in_flight = ps.rpc_async(fns.push, grads);
    if (step % 30 == 0 || step == steps - 1) {
      std::printf("  trainer%lld: step %4lld  loss %.5f\n", static_cast<long long>(trainer),
                  static_cast<long long>(step), loss_value);
      std::fflush(stdout);
    }
  }
  if (in_flight.valid()) in_flight.wait();
  return loss_value;
}

void register_functions() {
  (void)ferry::register_function("ps.make", [] {
    ParameterServer ps;
    ps.live = std::make_shared<ParameterServer::Live>();
    return ps;
  });
  (void)ferry::register_function("ps.pull", [](PsRef ps) {
    int64_t count = 0;
    return ps.local_value().snapshot(&count);
  });
  (void)ferry::register_function("ps.push", [](PsRef ps, std::vector<at::Tensor> grads) {
    ParameterServer::Live& live = *ps.local_value().live;
    std::lock_guard<std::mutex> lock(live.mu);
    std::vector<at::Tensor> params = live.model->parameters();
    if (grads.size() != params.size()) throw std::runtime_error("gradient count mismatch");
    // The received gradients wrap ferry's receive buffers; the optimizer reads them.
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = grads[i];
    live.optimizer.step();
    return ++live.updates;
  });
  (void)ferry::register_function("trainer.train", &train);
}

int drive(int trainers, int64_t steps) {
  PsRef ps = ferry::remote("ps", fns.make_server);
  std::printf("driver: the model lives on \"%s\" (%s)\n", ps.owner().name.c_str(), ps.to_string().c_str());
  std::fflush(stdout);
  double before = evaluate(ps.rpc_sync(fns.pull));
  std::vector<ferry::Future<double>> done;
  for (int t = 1; t <= trainers; ++t) {
    done.push_back(ferry::rpc_async("trainer" + std::to_string(t), fns.train, ps, t, steps));
  }
  for (auto& d : done) d.wait();
  ParameterServer final_state = ps.to_here();
  double after = evaluate(final_state.parameters);
  std::printf("driver: the server applied %lld updates from %d trainers; held-out loss %.5f -> %.5f (%.1fx lower)\n",
              static_cast<long long>(final_state.updates), trainers, before, after, before / after);
  if (final_state.updates != trainers * steps) {
    std::printf("driver: FAILED: %lld updates expected\n", static_cast<long long>(trainers * steps));
    return 1;
  }
  if (!(after < before / 4)) {
    std::printf("driver: FAILED: the loss did not fall to a quarter of where it started\n");
    return 1;
  }
  return 0;
}

int run(int rank, int world, const std::string& init_method, int64_t steps) {
  torch::set_num_threads(1);  // the processes are the parallelism; cores are shared
  torch::manual_seed(42);     // the server's initial model, the same on every run
  register_functions();
  std::string name = rank == 0 ? "driver" : rank == 1 ? "ps" : "trainer" + std::to_string(rank - 1);
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = init_method;
  options.num_worker_threads = 4;
  options.rpc_timeout = std::chrono::seconds(60);
  absl::Status started = ferry::init_rpc(name, rank, world, options);
  if (!started.ok()) {
    std::cerr << name << ": init_rpc failed: " << started << "\n";
    return 1;
  }
  int code = 0;
  if (rank == 0) {
    try {
      code = drive(world - 2, steps);
    } catch (const std::exception& e) {
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
  int64_t steps = argc > 2 ? std::atoll(argv[2]) : 200;
  if (steps < 1) {
    std::cerr << "usage: 08_torch_parameter_server [trainers >= 1] [steps >= 1]\n";
    return 2;
  }
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank != nullptr && world != nullptr && std::getenv("MASTER_ADDR") != nullptr &&
      std::getenv("MASTER_PORT") != nullptr) {
    if (std::atoi(world) < 3) {
      std::cerr << "08_torch_parameter_server needs WORLD_SIZE >= 3 (a driver, the server, trainers)\n";
      return 2;
    }
    return run(std::atoi(rank), std::atoi(world), "env://", steps);
  }
  if (trainers < 1) {
    std::cerr << "usage: 08_torch_parameter_server [trainers >= 1] [steps >= 1]\n";
    return 2;
  }
  // Fork before anything touches libtorch: its thread pools do not survive a fork.
  int size = trainers + 2;
  std::string dir = std::filesystem::temp_directory_path() / ("ferry-torch-ps-" + std::to_string(getpid()));
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
