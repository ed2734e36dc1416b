// Child processes for the benches (see children.h).
#include "tools/bench/children.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <thread>

#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"

namespace ferry::tools::bench {

[[noreturn]] void run_child(const std::function<absl::Status()>& body, const std::string& error_path) {
  dup2(STDERR_FILENO, STDOUT_FILENO);
  absl::Status status;
  try {
    status = body();
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("exception: ", e.what()));
  } catch (...) {
    status = absl::InternalError("a non-standard exception");
  }
  if (!status.ok()) std::ofstream(error_path) << status.ToString();
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(status.ok() ? 0 : 1);
}

std::string exit_reason(int status, const std::string& error_path) {
  std::string why;
  if (WIFEXITED(status)) {
    why = read_text(error_path);
    if (why.empty()) why = absl::StrCat("exited with code ", WEXITSTATUS(status));
  } else if (WIFSIGNALED(status)) {
    why = absl::StrCat("killed by signal ", WTERMSIG(status), " (", strsignal(WTERMSIG(status)), ")");
  }
  return why;
}

void wait_for_any_exit(const std::vector<pid_t>& pids, std::chrono::steady_clock::time_point until) {
  std::vector<pollfd> fds;
  for (pid_t pid : pids) {
    int fd = static_cast<int>(syscall(SYS_pidfd_open, pid, 0));
    if (fd < 0) break;
    fds.push_back(pollfd{fd, POLLIN, 0});
  }
  auto left = std::chrono::ceil<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
  int ms = static_cast<int>(std::clamp<int64_t>(left.count(), 0, 60000));
  if (fds.size() == pids.size()) {
    (void)poll(fds.data(), fds.size(), ms);
  } else {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min(ms, 10)));
  }
  for (const pollfd& p : fds) close(p.fd);
}

void kill_and_reap(pid_t pid) {
  kill(pid, SIGKILL);
  waitpid(pid, nullptr, 0);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace ferry::tools::bench
