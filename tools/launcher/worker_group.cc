#include "tools/launcher/worker_group.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace ferry::tools {

namespace {

constexpr size_t kMaxLine = 64 * 1024;

bool is_stop_signal(int sig) { return sig == SIGINT || sig == SIGTERM || sig == SIGHUP; }

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a closed stdout (EPIPE) loses the output, not the job
    done += static_cast<size_t>(n);
  }
}

// The launcher's environment with `extra` ("NAME=VALUE") added or replacing.
std::vector<std::string> merged_environment(const std::vector<std::string>& extra) {
  std::map<std::string, std::string> vars;
  for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
    std::string entry(*e);
    size_t eq = entry.find('=');
    if (eq == std::string::npos) continue;
    vars[entry.substr(0, eq)] = entry;
  }
  for (const std::string& entry : extra) vars[entry.substr(0, entry.find('='))] = entry;
  std::vector<std::string> out;
  out.reserve(vars.size());
  for (auto& [name, entry] : vars) out.push_back(std::move(entry));
  return out;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> out;
  out.reserve(strings.size() + 1);
  for (std::string& s : strings) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

}  // namespace

std::string WorkerExit::describe() const {
  if (signal != 0) return absl::StrCat("was killed by signal ", signal, " (", strsignal(signal), ")");
  return absl::StrCat("exited with code ", exit_code);
}

WorkerGroup::~WorkerGroup() {
  for (Worker& w : workers_) {
    if (!w.exited && w.pid > 0) {
      ::kill(-w.pid, SIGKILL);
      ::kill(w.pid, SIGKILL);
      ::waitpid(w.pid, nullptr, 0);
    }
    if (w.out >= 0) ::close(w.out);
    if (w.err >= 0) ::close(w.err);
  }
}

absl::Status WorkerGroup::start(const std::vector<std::string>& argv_in, const std::vector<WorkerSpec>& specs) {
  if (argv_in.empty()) return absl::InvalidArgumentError("no program to run");
  const pid_t launcher = ::getpid();
  for (const WorkerSpec& spec : specs) {
    // Everything the child needs is built before fork: between fork and exec it may
    // only make async-signal-safe calls.
    std::vector<std::string> args = argv_in;
    std::vector<char*> argv = pointers(args);
    std::vector<std::string> env = merged_environment(spec.env);
    std::vector<char*> envp = pointers(env);
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
    if (::pipe2(err, O_CLOEXEC) != 0) {
      ::close(out[0]);
      ::close(out[1]);
      return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
    }
    pid_t pid = ::fork();
    if (pid < 0) {
      int e = errno;
      for (int fd : {out[0], out[1], err[0], err[1]}) ::close(fd);
      return absl::InternalError(absl::StrCat("fork: ", strerror(e)));
    }
    if (pid == 0) {
      ::setpgid(0, 0);
      // The backstop: die with the launcher, even if it is SIGKILLed.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(1);
      for (int sig : {SIGPIPE, SIGINT, SIGTERM, SIGHUP, SIGCHLD, SIGQUIT}) ::signal(sig, SIG_DFL);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      int null_fd = ::open("/dev/null", O_RDONLY);
      if (null_fd >= 0) ::dup2(null_fd, 0);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      ::execvpe(argv[0], argv.data(), envp.data());
      const char* what = strerror(errno);
      const char prefix[] = "ferry run: cannot execute ";
      ssize_t ignored = ::write(2, prefix, sizeof(prefix) - 1);
      ignored = ::write(2, argv[0], strlen(argv[0]));
      ignored = ::write(2, ": ", 2);
      ignored = ::write(2, what, strlen(what));
      ignored = ::write(2, "\n", 1);
      (void)ignored;
      ::_exit(127);
    }
    ::setpgid(pid, pid);  // also here, so the group exists before we might signal it
    ::close(out[1]);
    ::close(err[1]);
    ::fcntl(out[0], F_SETFL, O_NONBLOCK);
    ::fcntl(err[0], F_SETFL, O_NONBLOCK);
    Worker w;
    w.spec = spec;
    w.pid = pid;
    w.out = out[0];
    w.err = err[0];
    workers_.push_back(std::move(w));
  }
  return absl::OkStatus();
}

std::vector<int> WorkerGroup::output_fds() const {
  std::vector<int> fds;
  for (const Worker& w : workers_) {
    if (w.out >= 0) fds.push_back(w.out);
    if (w.err >= 0) fds.push_back(w.err);
  }
  return fds;
}

void WorkerGroup::flush(Worker& w, bool is_err, bool at_eof) {
  std::string& buffer = is_err ? w.err_buffer : w.out_buffer;
  std::string prefix = absl::StrCat("[rank", w.spec.rank, "]: ");
  std::string text;
  size_t start = 0;
  for (;;) {
    size_t nl = buffer.find('\n', start);
    if (nl == std::string::npos) {
      if (buffer.size() - start >= kMaxLine || (at_eof && start < buffer.size())) {
        text += prefix + buffer.substr(start) + "\n";
        start = buffer.size();
      }
      break;
    }
    text += prefix;
    text.append(buffer, start, nl + 1 - start);
    start = nl + 1;
  }
  buffer.erase(0, start);
  if (!text.empty()) write_all(is_err ? 2 : 1, text);
}

void WorkerGroup::forward(int fd) {
  for (Worker& w : workers_) {
    bool is_err = fd == w.err;
    if (fd != w.out && !is_err) continue;
    char chunk[65536];
    ssize_t n = ::read(fd, chunk, sizeof(chunk));
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
    if (n > 0) {
      (is_err ? w.err_buffer : w.out_buffer).append(chunk, static_cast<size_t>(n));
      flush(w, is_err, false);
      return;
    }
    flush(w, is_err, true);
    ::close(fd);
    (is_err ? w.err : w.out) = -1;
    return;
  }
}

std::vector<WorkerExit> WorkerGroup::reap() {
  std::vector<WorkerExit> exits;
  for (Worker& w : workers_) {
    if (w.exited) continue;
    int status = 0;
    pid_t r = ::waitpid(w.pid, &status, WNOHANG);
    if (r != w.pid) continue;
    w.exited = true;
    // Whatever the worker started and left behind goes with it.
    ::kill(-w.pid, SIGKILL);
    WorkerExit e;
    e.rank = w.spec.rank;
    e.local_rank = w.spec.local_rank;
    e.pid = w.pid;
    if (WIFSIGNALED(status)) {
      e.signal = WTERMSIG(status);
      e.exit_code = 128 + e.signal;
    } else {
      e.exit_code = WEXITSTATUS(status);
    }
    exits.push_back(e);
  }
  return exits;
}

bool WorkerGroup::all_exited() const {
  for (const Worker& w : workers_) {
    if (!w.exited) return false;
  }
  return true;
}

void WorkerGroup::drain_signals() {
  signalfd_siginfo info;
  while (::read(signal_fd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
    int sig = static_cast<int>(info.ssi_signo);
    if (is_stop_signal(sig)) pending_signal_ = sig;
  }
}

std::optional<int> WorkerGroup::take_signal() {
  std::optional<int> sig = pending_signal_;
  pending_signal_.reset();
  return sig;
}

void WorkerGroup::drain_output(std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    std::vector<int> fds = output_fds();
    if (fds.empty()) return;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return;
    std::vector<pollfd> polls;
    for (int fd : fds) polls.push_back({fd, POLLIN, 0});
    int n = ::poll(polls.data(), polls.size(), static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    for (const pollfd& p : polls) {
      if (p.revents != 0) forward(p.fd);
    }
  }
}

std::vector<WorkerExit> WorkerGroup::stop(int signal, std::chrono::milliseconds grace) {
  std::vector<WorkerExit> exits = reap();
  for (Worker& w : workers_) {
    if (w.exited) continue;
    ::kill(-w.pid, signal);
    ::kill(w.pid, signal);
  }
  const auto deadline = std::chrono::steady_clock::now() + grace;
  bool escalate = false;
  while (!all_exited() && !escalate) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    std::vector<pollfd> polls{{signal_fd_, POLLIN, 0}};
    for (int fd : output_fds()) polls.push_back({fd, POLLIN, 0});
    int n = ::poll(polls.data(), polls.size(), static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    for (const pollfd& p : polls) {
      if (p.revents == 0) continue;
      if (p.fd == signal_fd_) {
        std::optional<int> before = pending_signal_;
        drain_signals();
        if (pending_signal_ && pending_signal_ != before) escalate = true;  // asked again: do not wait
      } else {
        forward(p.fd);
      }
    }
    for (WorkerExit& e : reap()) exits.push_back(e);
  }
  for (Worker& w : workers_) {
    if (w.exited) continue;
    ::kill(-w.pid, SIGKILL);
    ::kill(w.pid, SIGKILL);
    int status = 0;
    while (::waitpid(w.pid, &status, 0) < 0 && errno == EINTR) {
    }
    w.exited = true;
    WorkerExit e;
    e.rank = w.spec.rank;
    e.local_rank = w.spec.local_rank;
    e.pid = w.pid;
    e.signal = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    e.exit_code = e.signal != 0 ? 128 + e.signal : WEXITSTATUS(status);
    exits.push_back(e);
  }
  // Everything in the groups is dead now, so the pipes reach EOF promptly.
  drain_output(std::chrono::steady_clock::now() + std::chrono::seconds(2));
  return exits;
}

}  // namespace ferry::tools
