// ferry_soak: init_rpc/shutdown cycles of 2 processes on one rendezvous, the way a job
// that restarts its workers (or a test suite) reuses one file:// path or one tcp://
// address. Each process runs its cycles back to back, so the next cycle's rendezvous
// overlaps the last one's teardown on the other rank: stale files, stale keys, ports
// still bound and closes counted twice show up as a failure or a hang.
//
//   ferry_soak --cycles 1000 --init both      # file:// then tcp://
//
// Each cycle makes one call each way (a registered add), then shuts down. Exits 0
// when every cycle of every mode succeeded; prints the failing rank, cycle and error
// otherwise, and kills both processes of a mode that passes its deadline (a hang).
// Not part of the default test run (CI runs 20 cycles through ctest).
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "base/net.h"
#include "rpc/ferry.h"

namespace {

using Clock = std::chrono::steady_clock;
constexpr int kWorld = 2;

struct Shared {
  std::atomic<int> done[kWorld];  // cycles each rank completed
};

int run_rank(int rank, const std::string& url, int cycles, Shared* shared) {
  (void)ferry::register_function("soak_add", [](int64_t a, int64_t b) { return a + b; });
  const std::string me = "worker" + std::to_string(rank);
  const std::string peer = "worker" + std::to_string(1 - rank);
  for (int c = 0; c < cycles; ++c) {
    ferry::TensorPipeRpcBackendOptions options;
    options.init_method = url;
    options.num_worker_threads = 2;
    options.rpc_timeout = std::chrono::seconds(30);
    absl::Status s = ferry::init_rpc(me, rank, kWorld, options);
    if (!s.ok()) {
      std::fprintf(stderr, "soak %s: rank %d cycle %d: init_rpc: %s\n", url.c_str(), rank, c, s.ToString().c_str());
      return 1;
    }
    try {
      int64_t got = ferry::rpc_sync<int64_t>(peer, "soak_add", int64_t{c}, int64_t{rank});
      if (got != c + rank) {
        std::fprintf(stderr, "soak %s: rank %d cycle %d: soak_add answered %lld, expected %d\n", url.c_str(), rank,
                     c, static_cast<long long>(got), c + rank);
        (void)ferry::shutdown();
        return 1;
      }
    } catch (const ferry::RpcError& e) {
      std::fprintf(stderr, "soak %s: rank %d cycle %d: rpc_sync: %s\n", url.c_str(), rank, c, e.what());
      (void)ferry::shutdown();
      return 1;
    }
    s = ferry::shutdown(true, std::chrono::seconds(60));
    if (!s.ok()) {
      std::fprintf(stderr, "soak %s: rank %d cycle %d: shutdown: %s\n", url.c_str(), rank, c, s.ToString().c_str());
      return 1;
    }
    shared->done[rank].fetch_add(1);
  }
  return 0;
}

// Runs one mode; returns whether every cycle of both ranks succeeded.
bool soak(const std::string& url, int cycles, std::chrono::seconds deadline) {
  auto* shared = static_cast<Shared*>(
      ::mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (shared == MAP_FAILED) {
    std::perror("mmap");
    return false;
  }
  new (shared) Shared{};
  auto start = Clock::now();
  std::fflush(nullptr);
  std::vector<pid_t> children;
  for (int rank = 0; rank < kWorld; ++rank) {
    pid_t pid = ::fork();
    if (pid == 0) ::_exit(run_rank(rank, url, cycles, shared));
    children.push_back(pid);
  }
  bool ok = true;
  std::vector<bool> reaped(kWorld, false);
  int left = kWorld;
  while (left > 0) {
    for (int r = 0; r < kWorld; ++r) {
      if (reaped[r]) continue;
      int status = 0;
      pid_t got = ::waitpid(children[r], &status, WNOHANG);
      if (got == children[r]) {
        reaped[r] = true;
        --left;
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ok = false;
      }
    }
    if (left > 0 && Clock::now() - start > deadline) {
      std::fprintf(stderr, "soak %s: HANG: deadline of %lld s passed with rank 0 at cycle %d, rank 1 at cycle %d\n",
                   url.c_str(), static_cast<long long>(deadline.count()), shared->done[0].load(),
                   shared->done[1].load());
      for (int r = 0; r < kWorld; ++r) {
        if (!reaped[r]) {
          ::kill(children[r], SIGKILL);
          ::waitpid(children[r], nullptr, 0);
        }
      }
      ok = false;
      break;
    }
    if (left > 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("soak %s: %d/%d and %d/%d cycles of 2 processes in %.1f s (%.0f ms per cycle): %s\n", url.c_str(),
              shared->done[0].load(), cycles, shared->done[1].load(), cycles, seconds,
              1000.0 * seconds / std::max(1, std::min(shared->done[0].load(), shared->done[1].load())),
              ok ? "no failure" : "FAILED");
  ::munmap(shared, sizeof(Shared));
  return ok;
}

int usage(const char* argv0) {
  std::fprintf(stderr, "usage: %s [--cycles N] [--init file|tcp|both] [--deadline-s S]\n", argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  int cycles = 1000;
  std::string mode = "both";
  long deadline_s = -1;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    if (arg == "--cycles") {
      cycles = std::atoi(argv[++i]);
    } else if (arg == "--init") {
      mode = argv[++i];
    } else if (arg == "--deadline-s") {
      deadline_s = std::atol(argv[++i]);
    } else {
      return usage(argv[0]);
    }
  }
  if (cycles < 1 || (mode != "file" && mode != "tcp" && mode != "both")) return usage(argv[0]);
  // A cycle takes well under a second; a hang is whatever takes much longer.
  std::chrono::seconds deadline(deadline_s > 0 ? deadline_s : 60 + 2L * cycles);
  bool ok = true;
  if (mode == "file" || mode == "both") {
    std::string dir = std::filesystem::temp_directory_path() / ("ferry-soak-" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    ok = soak("file://" + dir + "/store", cycles, deadline) && ok;
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);
  }
  if (mode == "tcp" || mode == "both") {
    ok = soak("tcp://127.0.0.1:" + std::to_string(ferry::internal::free_port().value_or(0)), cycles, deadline) && ok;
  }
  return ok ? 0 : 1;
}
