// 04_elastic: a parameter server whose trainers join and leave while it runs — a
// dynamic group (init_rpc without a world size).
//
// The server (rank 0) holds a weight vector and hosts the store, so it joins first
// and leaves last. Trainers join one after another, each pulls the weights, pushes
// gradients for a number of steps, and leaves; later trainers join while earlier ones
// are still training. The server hears of every join and leave through a membership
// listener, and checks at the end that no update was lost: every step of every
// trainer is in the weights.
//
//   build/examples/04_elastic [trainers] [steps]      # default 4 trainers, 30 steps
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "rpc/ferry.h"

namespace {

constexpr int kDim = 8;
constexpr float kLearningRate = 0.05f;

// The server's state: the weights and how many updates made them.
struct Server {
  std::mutex mu;
  std::vector<float> weights = std::vector<float>(kDim, 0.0f);
  int64_t updates = 0;
  std::condition_variable changed;
  int joined = 0;
  int left = 0;
};
Server& server() {
  static Server* s = new Server();
  return *s;
}

// A trainer's data pulls the weights towards its own target; the average of all
// targets is where the weights settle.
std::vector<float> target_of(int rank) {
  std::vector<float> t(kDim);
  for (int i = 0; i < kDim; ++i) t[i] = static_cast<float>((rank * 7 + i) % 5);
  return t;
}

uint16_t free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

int run_server(const ferry::TensorPipeRpcBackendOptions& options, int trainers, int steps) {
  (void)ferry::register_function("pull", [] {
    std::lock_guard<std::mutex> lock(server().mu);
    return server().weights;
  });
  (void)ferry::register_function("push", [](std::vector<float> grad) {
    std::lock_guard<std::mutex> lock(server().mu);
    for (int i = 0; i < kDim; ++i) server().weights[i] -= kLearningRate * grad[i];
    return ++server().updates;
  });
  absl::Status s = ferry::init_rpc("ps", ferry::BackendType::TENSORPIPE, 0, std::nullopt, options);
  if (!s.ok()) {
    std::fprintf(stderr, "ps: init_rpc failed: %s\n", s.ToString().c_str());
    return 1;
  }
  ferry::add_membership_listener([](const ferry::WorkerInfo& w, ferry::MembershipChange change) {
    std::lock_guard<std::mutex> lock(server().mu);
    const char* what = change == ferry::MembershipChange::kJoined ? "joined"
                       : change == ferry::MembershipChange::kLeft ? "left"
                                                                  : "was lost";
    if (change == ferry::MembershipChange::kJoined) ++server().joined;
    if (change != ferry::MembershipChange::kJoined) ++server().left;
    std::printf("ps: %s %s (updates so far: %lld, members now: %zu)\n", w.name.c_str(), what,
                static_cast<long long>(server().updates), ferry::get_worker_infos().size());
    std::fflush(stdout);
    server().changed.notify_all();
  });
  {
    std::unique_lock<std::mutex> lock(server().mu);
    if (!server().changed.wait_for(lock, std::chrono::seconds(120), [&] { return server().left == trainers; })) {
      std::fprintf(stderr, "ps: only %d of %d trainers left within 120 s\n", server().left, trainers);
      return 1;
    }
  }
  int64_t expected = static_cast<int64_t>(trainers) * steps;
  std::vector<float> mean(kDim, 0.0f);
  for (int r = 1; r <= trainers; ++r) {
    std::vector<float> t = target_of(r);
    for (int i = 0; i < kDim; ++i) mean[i] += t[i] / static_cast<float>(trainers);
  }
  float distance = 0;
  {
    std::lock_guard<std::mutex> lock(server().mu);
    for (int i = 0; i < kDim; ++i) distance += std::fabs(server().weights[i] - mean[i]);
    std::printf("ps: %d trainers joined and left; %lld updates applied (expected %lld); distance to the mean "
                "target %.3f\n",
                server().joined, static_cast<long long>(server().updates), static_cast<long long>(expected),
                distance);
  }
  s = ferry::shutdown();  // the last member, and the store's host
  if (!s.ok()) {
    std::fprintf(stderr, "ps: shutdown failed: %s\n", s.ToString().c_str());
    return 1;
  }
  return server().updates == expected && server().joined == trainers ? 0 : 1;
}

int run_trainer(const ferry::TensorPipeRpcBackendOptions& options, int rank, int steps) {
  std::string name = "trainer" + std::to_string(rank);
  absl::Status s = ferry::init_rpc(name, ferry::BackendType::TENSORPIPE, rank, std::nullopt, options);
  if (!s.ok()) {
    std::fprintf(stderr, "%s: init_rpc failed: %s\n", name.c_str(), s.ToString().c_str());
    return 1;
  }
  std::vector<float> target = target_of(rank);
  try {
    for (int step = 0; step < steps; ++step) {
      std::vector<float> w = ferry::rpc_sync<std::vector<float>>("ps", "pull");
      std::vector<float> grad(kDim);
      for (int i = 0; i < kDim; ++i) grad[i] = w[i] - target[i];  // d/dw of |w - target|^2 / 2
      (void)ferry::rpc_sync<int64_t>("ps", "push", grad);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  } catch (const ferry::RpcError& e) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), e.what());
    return 1;
  }
  s = ferry::shutdown();  // leaves the group; the server keeps running
  if (!s.ok()) {
    std::fprintf(stderr, "%s: shutdown failed: %s\n", name.c_str(), s.ToString().c_str());
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  int trainers = argc > 1 ? std::atoi(argv[1]) : 4;
  int steps = argc > 2 ? std::atoi(argv[2]) : 30;
  if (trainers < 1 || trainers > 64 || steps < 1) {
    std::fprintf(stderr, "usage: %s [trainers 1..64] [steps >= 1]\n", argv[0]);
    return 2;
  }
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = "tcp://127.0.0.1:" + std::to_string(free_port());
  options.num_worker_threads = 4;
  options.rpc_timeout = std::chrono::seconds(60);
  std::vector<pid_t> children;
  for (int rank = 0; rank <= trainers; ++rank) {
    pid_t pid = fork();
    if (pid < 0) {
      std::perror("fork");
      return 1;
    }
    if (pid == 0) {
      // Trainers arrive one after another, overlapping those still training.
      std::this_thread::sleep_for(std::chrono::milliseconds(rank * 120));
      int rc = rank == 0 ? run_server(options, trainers, steps) : run_trainer(options, rank, steps);
      std::fflush(stdout);
      _exit(rc);
    }
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  std::printf(failed == 0 ? "elastic training: OK\n" : "elastic training: %d process(es) FAILED\n", failed);
  return failed == 0 ? 0 : 1;
}
