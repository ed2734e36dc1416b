#include "tests/testing/multi_process.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <memory>
#include <mutex>
#include <thread>

#include "gtest/gtest.h"

namespace ferry::testing {

std::string ProcessResult::describe() const {
  std::string s = "rank " + std::to_string(rank) + ": ";
  if (timed_out) return s + "did not finish before the deadline (killed)";
  if (exited) return s + "exited with code " + std::to_string(exit_code);
  return s + "killed by signal " + std::to_string(term_signal) + " (" + strsignal(term_signal) + ")";
}

namespace {

// Runs body(rank): 0, or 2 when it threw (said on stderr).
int run_rank(const std::function<void(int rank)>& body, int rank) {
  try {
    body(rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: uncaught exception: %s\n", rank, e.what());
  } catch (...) {
    std::fprintf(stderr, "rank %d: uncaught non-standard exception\n", rank);
  }
  return 2;
}

}  // namespace

std::vector<ProcessResult> run_processes(int n, const std::function<void(int rank)>& body,
                                         std::chrono::milliseconds timeout) {
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  for (int rank = 0; rank < n; ++rank) {
    pid_t pid = fork();
    if (pid < 0) {
      ADD_FAILURE() << "fork failed";
      break;
    }
    if (pid == 0) {
      int code = run_rank(body, rank);
      if (code == 0 && ::testing::Test::HasFailure()) code = 1;
      std::fflush(stdout);
      std::fflush(stderr);
      // _exit: the child must not run the parent's atexit handlers or gtest's teardown.
      _exit(code);
    }
    pids.push_back(pid);
  }

  std::vector<ProcessResult> results(pids.size());
  std::vector<bool> done(pids.size(), false);
  size_t remaining = pids.size();
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (remaining > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      pid_t r = waitpid(pids[i], &status, WNOHANG);
      if (r == pids[i]) {
        done[i] = true;
        --remaining;
        results[i].rank = static_cast<int>(i);
        if (WIFEXITED(status)) {
          results[i].exited = true;
          results[i].exit_code = WEXITSTATUS(status);
        } else if (WIFSIGNALED(status)) {
          results[i].term_signal = WTERMSIG(status);
        }
      }
    }
    if (remaining == 0) break;
    if (std::chrono::steady_clock::now() > deadline) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (done[i]) continue;
        kill(pids[i], SIGKILL);
        waitpid(pids[i], nullptr, 0);
        results[i].rank = static_cast<int>(i);
        results[i].timed_out = true;
        results[i].term_signal = SIGKILL;
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return results;
}

std::vector<ProcessResult> run_threads(int n, const std::function<void(int rank)>& body,
                                       std::chrono::milliseconds timeout) {
  struct Shared {
    std::mutex mu;
    std::condition_variable cv;
    int running = 0;
    std::vector<ProcessResult> results;
  };
  auto shared = std::make_shared<Shared>();
  shared->running = n;
  shared->results.resize(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < n; ++rank) {
    threads.emplace_back([shared, &body, rank] {
      int code = run_rank(body, rank);
      std::lock_guard<std::mutex> lock(shared->mu);
      ProcessResult& r = shared->results[static_cast<size_t>(rank)];
      r.rank = rank;
      r.exited = true;
      r.exit_code = code;
      --shared->running;
      shared->cv.notify_all();
    });
  }
  {
    std::unique_lock<std::mutex> lock(shared->mu);
    if (!shared->cv.wait_for(lock, timeout, [&] { return shared->running == 0; })) {
      for (size_t rank = 0; rank < shared->results.size(); ++rank) {
        if (shared->results[rank].exited) continue;
        std::fprintf(stderr, "run_threads: rank %zu still runs after %lld ms\n", rank,
                     static_cast<long long>(timeout.count()));
      }
      std::fflush(stderr);
      std::abort();
    }
  }
  for (std::thread& t : threads) t.join();
  return shared->results;
}

void expect_all_succeed(const std::vector<ProcessResult>& results) {
  for (const ProcessResult& r : results) {
    EXPECT_TRUE(r.exited && r.exit_code == 0) << r.describe();
  }
}

TempDir::TempDir() {
  std::string pattern = (std::filesystem::temp_directory_path() / "ferry-test-XXXXXX").string();
  if (mkdtemp(pattern.data()) == nullptr) {
    ADD_FAILURE() << "mkdtemp failed";
  }
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace ferry::testing
