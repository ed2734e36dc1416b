// membership_bench: how long a worker takes to join a dynamic group (init_rpc without
// a world size) and to leave it (shutdown), for groups of N members on this host.
//
//   membership_bench [--sizes 2,8,32] [--rounds 10]
//
// For each N it hosts a TCPStore server itself (outside the group, as `ferry store
// serve` would), forks N-1 members that join one after another and then wait, and
// forks one more process that joins and leaves `rounds` times, timing each. So every
// join and leave measured is that of the N-th member of a group of N. Prints, per N,
// the median and max of join and of leave in milliseconds.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "base/net.h"
#include "rpc/ferry.h"
#include "store/tcp_store.h"

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

ferry::TensorPipeRpcBackendOptions options_for(uint16_t port) {
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
  options.num_worker_threads = 2;
  options.transports = std::vector<std::string>{"uv"};  // N processes on 2 cores: no polling reactors
  options.rpc_timeout = std::chrono::seconds(60);
  return options;
}

// Ranks start at 1: rank 0 of tcp:// would host the store, which the bench does.
int member(uint16_t port, int rank) {
  std::unique_ptr<ferry::TCPStore> coord = *ferry::TCPStore::create("127.0.0.1", port, false, std::nullopt);
  if (rank > 1 && !coord->wait({"bench/joined/" + std::to_string(rank - 1)}, std::chrono::seconds(120)).ok()) return 1;
  absl::Status s = ferry::init_rpc("m" + std::to_string(rank), ferry::BackendType::TENSORPIPE, rank, std::nullopt,
                                   options_for(port));
  if (!s.ok()) {
    std::fprintf(stderr, "member %d: %s\n", rank, s.ToString().c_str());
    return 1;
  }
  if (!coord->set("bench/joined/" + std::to_string(rank), ferry::to_bytes("1")).ok()) return 1;
  if (!coord->wait({"bench/done"}, std::chrono::seconds(300)).ok()) return 1;
  return ferry::shutdown().ok() ? 0 : 1;
}

int measurer(uint16_t port, int rank, int rounds) {
  std::unique_ptr<ferry::TCPStore> coord = *ferry::TCPStore::create("127.0.0.1", port, false, std::nullopt);
  if (rank > 1 && !coord->wait({"bench/joined/" + std::to_string(rank - 1)}, std::chrono::seconds(120)).ok()) return 1;
  std::vector<double> joins, leaves;
  for (int i = 0; i < rounds; ++i) {
    Clock::time_point start = Clock::now();
    absl::Status s = ferry::init_rpc("measurer", ferry::BackendType::TENSORPIPE, rank, std::nullopt,
                                     options_for(port));
    if (!s.ok()) {
      std::fprintf(stderr, "measurer: %s\n", s.ToString().c_str());
      return 1;
    }
    joins.push_back(ms_since(start));
    if (ferry::get_worker_infos().size() != static_cast<size_t>(rank)) {
      std::fprintf(stderr, "measurer: saw %zu members, expected %d\n", ferry::get_worker_infos().size(), rank);
      return 1;
    }
    start = Clock::now();
    if (!ferry::shutdown().ok()) return 1;
    leaves.push_back(ms_since(start));
  }
  (void)coord->set("bench/done", ferry::to_bytes("1"));
  std::sort(joins.begin(), joins.end());
  std::sort(leaves.begin(), leaves.end());
  std::printf("| %d | %.1f | %.1f | %.1f | %.1f |\n", rank, joins[joins.size() / 2], joins.back(),
              leaves[leaves.size() / 2], leaves.back());
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes = {2, 8, 32};
  int rounds = 10;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--sizes" && i + 1 < argc) {
      sizes.clear();
      for (absl::string_view part : absl::StrSplit(argv[++i], ',')) {
        int n = 0;
        if (!absl::SimpleAtoi(part, &n) || n < 2 || n > 256) {
          std::fprintf(stderr, "--sizes: \"%s\" is not a group size in [2, 256]\n", std::string(part).c_str());
          return 2;
        }
        sizes.push_back(n);
      }
    } else if (arg == "--rounds" && i + 1 < argc && absl::SimpleAtoi(argv[i + 1], &rounds) && rounds >= 1) {
      ++i;
    } else {
      std::fprintf(stderr, "usage: %s [--sizes 2,8,32] [--rounds N>=1]\n", argv[0]);
      return 2;
    }
  }
  std::printf("| group size N | join median (ms) | join max | leave median (ms) | leave max |\n|---|---|---|---|---|\n");
  std::fflush(stdout);
  int failed = 0;
  for (int n : sizes) {
    // The store lives in a process of its own (forking after starting its loop thread
    // here would hand the members a half-copied server).
    uint16_t port = ferry::internal::free_port().value_or(0);
    pid_t store_pid = fork();
    if (store_pid == 0) {
      ferry::TCPStoreServerOptions server_options;
      server_options.host = "127.0.0.1";
      server_options.port = port;
      auto server = ferry::TCPStoreServer::create(server_options);
      if (!server.ok()) {
        std::fprintf(stderr, "store server: %s\n", server.status().ToString().c_str());
        _exit(1);
      }
      pause();  // until killed
      _exit(0);
    }
    std::vector<pid_t> children;
    for (int rank = 1; rank <= n; ++rank) {
      pid_t pid = fork();
      if (pid == 0) _exit(rank < n ? member(port, rank) : measurer(port, rank, rounds));
      children.push_back(pid);
    }
    for (pid_t pid : children) {
      int status = 0;
      waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
    }
    kill(store_pid, SIGTERM);
    waitpid(store_pid, nullptr, 0);
  }
  return failed == 0 ? 0 : 1;
}
