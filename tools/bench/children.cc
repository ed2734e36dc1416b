// Child processes for the benches (see children.h).
#include "tools/bench/children.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

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
