#include "tools/launcher/launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "base/net.h"
#include "base/status.h"
#include "rendezvous/store_handler.h"
#include "tools/launcher/worker_group.h"

namespace ferry::tools {

using internal::av;

namespace {

using Clock = std::chrono::steady_clock;

constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;

void say(const std::string& text) {
  std::string line = absl::StrCat("ferry run: ", text, "\n");
  ssize_t ignored = ::write(2, line.data(), line.size());
  (void)ignored;
}

const char* signal_name(int sig) {
  switch (sig) {
    case SIGINT:
      return "SIGINT";
    case SIGTERM:
      return "SIGTERM";
    case SIGHUP:
      return "SIGHUP";
    default:
      return "a signal";
  }
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.starts_with("127.") || host == "::1" || host == "[::1]";
}

std::string endpoint_host(const std::string& endpoint) {
  if (endpoint.starts_with("[")) return endpoint.substr(1, endpoint.find(']') - 1);
  return endpoint.substr(0, endpoint.find(':'));
}

// What one completed round means for this node.
struct Round {
  int group_rank = 0;
  int group_world_size = 0;
  int rank_offset = 0;  // the global rank of this node's local rank 0
  int world_size = 0;   // workers in the job
  std::string master_addr;
  int master_port = 0;
};

// Why a round of workers ended.
struct Outcome {
  enum Kind { kSucceeded, kFailed, kNodesWaiting, kClosed, kSignal } kind = kSucceeded;
  WorkerExit failure;  // kFailed
  int waiting = 0;     // kNodesWaiting
  int signal = 0;      // kSignal
};

class Agent {
 public:
  Agent(const LaunchOptions& options, std::unique_ptr<RendezvousHandler> handler, int signal_fd,
        std::chrono::milliseconds join_timeout, std::string master_addr)
      : options_(options),
        handler_(std::move(handler)),
        signal_fd_(signal_fd),
        join_timeout_(join_timeout),
        master_addr_(std::move(master_addr)) {}

  int run() {
    // The endpoint as bound (a standalone store's free port), so that the job can be
    // found from another shell.
    std::string endpoint = options_.rdzv_endpoint;
    bool hosts = false;
    if (auto* store = dynamic_cast<const StoreRendezvousHandler*>(handler_.get())) {
      endpoint = store->endpoint();
      hosts = store->hosts_store();
    }
    say(absl::StrCat("joining the rendezvous of run '", handler_->get_run_id(), "' at ", endpoint,
                     hosts ? " (its store is served by this launcher)" : "", ", ", options_.min_nodes, " to ",
                     options_.max_nodes, " node(s)"));
    if (handler_->get_backend() == StoreRendezvousHandler::kBackend) {
      say(absl::StrCat("watch it with: ferry top --rdzv-endpoint ", endpoint, " --rdzv-id ", handler_->get_run_id()));
    }
    int restart_count = 0;
    for (;;) {
      int stop_signal = 0;
      absl::StatusOr<Round> round = rendezvous(&stop_signal);
      if (stop_signal != 0) {
        say(absl::StrCat("stopped by ", signal_name(stop_signal), " during the rendezvous"));
        (void)handler_->set_closed();
        handler_->shutdown();
        return 128 + stop_signal;
      }
      if (!round.ok()) {
        report_rendezvous_error(round.status());
        handler_->shutdown();
        return kExitFailed;
      }
      say(absl::StrCat("round with ", round->group_world_size, " node(s), ", round->world_size,
                       " worker(s): this node is group rank ", round->group_rank, ", ranks ", round->rank_offset, "..",
                       round->rank_offset + options_.nproc_per_node - 1, ", restart count ", restart_count));

      WorkerGroup group(signal_fd_);
      absl::Status started = group.start(options_.program, specs(*round, restart_count));
      if (!started.ok()) {
        say(absl::StrCat("cannot start the workers: ", started.message()));
        (void)handler_->set_closed();
        handler_->shutdown();
        return kExitFailed;
      }
      Outcome outcome = monitor(group);
      switch (outcome.kind) {
        case Outcome::kSucceeded:
          group.stop(SIGTERM, std::chrono::milliseconds(0));  // forwards the last output
          say(absl::StrCat("all ", options_.nproc_per_node, " worker(s) of this node finished"));
          handler_->shutdown();
          return 0;
        case Outcome::kSignal:
          say(absl::StrCat("stopped by ", signal_name(outcome.signal), "; stopping the workers"));
          group.stop(outcome.signal, options_.stop_timeout);
          (void)handler_->set_closed();
          handler_->shutdown();
          return 128 + outcome.signal;
        case Outcome::kClosed:
          say(absl::StrCat("the rendezvous of run '", handler_->get_run_id(),
                           "' was closed by another node; stopping the workers"));
          group.stop(SIGTERM, options_.stop_timeout);
          handler_->shutdown();
          return kExitFailed;
        case Outcome::kNodesWaiting:
          say(absl::StrCat(outcome.waiting, " node(s) waiting to join; stopping the workers to admit them in a new round"));
          group.stop(SIGTERM, options_.stop_timeout);
          if (std::optional<int> sig = group.take_signal()) return stop_now(*sig);
          continue;
        case Outcome::kFailed: {
          const WorkerExit& f = outcome.failure;
          std::string who = absl::StrCat("worker rank ", f.rank, " (local rank ", f.local_rank, ", pid ", f.pid, ") ",
                                         f.describe());
          group.stop(SIGTERM, options_.stop_timeout);
          if (std::optional<int> sig = group.take_signal()) return stop_now(*sig);
          if (restart_count < options_.max_restarts) {
            ++restart_count;
            say(absl::StrCat(who, "; restarting this node's workers (restart ", restart_count, " of ",
                             options_.max_restarts, ")"));
            continue;
          }
          say(absl::StrCat(who, "; no restarts left (--max-restarts ", options_.max_restarts, "), exiting with code ",
                           f.exit_code));
          (void)handler_->set_closed();
          handler_->shutdown();
          return f.exit_code;
        }
      }
    }
  }

 private:
  int stop_now(int sig) {
    say(absl::StrCat("stopped by ", signal_name(sig)));
    (void)handler_->set_closed();
    handler_->shutdown();
    return 128 + sig;
  }

  void report_rendezvous_error(const absl::Status& status) {
    std::optional<RendezvousErrorKind> kind = rendezvous_error_kind(status);
    if (kind == RendezvousErrorKind::kTimeout) {
      say(absl::StrCat("rendezvous timed out: ", status.message()));
    } else if (kind == RendezvousErrorKind::kClosed) {
      say(absl::StrCat("rendezvous closed: ", status.message()));
    } else {
      say(absl::StrCat("rendezvous failed: ", status.message()));
    }
  }

  // next_rendezvous() and the exchange of worker counts and the master address, on a
  // thread of its own, so that a stop signal is answered meanwhile: it closes the run,
  // which ends the wait.
  absl::StatusOr<Round> rendezvous(int* stop_signal) {
    int done[2];
    if (::pipe2(done, O_CLOEXEC) != 0) return absl::InternalError(absl::StrCat("pipe: ", strerror(errno)));
    absl::StatusOr<Round> result = absl::UnknownError("rendezvous did not finish");
    std::thread thread([&] {
      result = rendezvous_and_exchange();
      char byte = 1;
      ssize_t ignored = ::write(done[1], &byte, 1);
      (void)ignored;
    });
    bool finished = false;
    Clock::time_point give_up = Clock::time_point::max();
    while (!finished) {
      pollfd polls[2] = {{signal_fd_, POLLIN, 0}, {done[0], POLLIN, 0}};
      int timeout = -1;
      if (give_up != Clock::time_point::max()) {
        timeout = static_cast<int>(
            std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(give_up - Clock::now()).count()));
      }
      int n = ::poll(polls, 2, timeout);
      if (n < 0 && errno == EINTR) continue;
      if (n == 0) {
        // The store does not answer the close: leave without the thread (the process
        // ends here, so nothing runs on).
        say(absl::StrCat("stopped by ", signal_name(*stop_signal), " during the rendezvous (store unresponsive)"));
        std::fflush(nullptr);
        std::_Exit(128 + *stop_signal);
      }
      if (polls[1].revents != 0) finished = true;
      if (polls[0].revents != 0) {
        signalfd_siginfo info;
        while (::read(signal_fd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
          int sig = static_cast<int>(info.ssi_signo);
          if (sig == SIGCHLD || *stop_signal != 0) continue;
          *stop_signal = sig;
          (void)handler_->set_closed();
          give_up = Clock::now() + std::chrono::seconds(10);
        }
      }
    }
    thread.join();
    ::close(done[0]);
    ::close(done[1]);
    return result;
  }

  absl::StatusOr<Round> rendezvous_and_exchange() {
    FERRY_ASSIGN_OR_RETURN(RendezvousInfo info, handler_->next_rendezvous());
    Round round;
    round.group_rank = info.rank;
    round.group_world_size = info.world_size;
    Store& store = *info.store;
    auto failed = [](const absl::Status& s) {
      return is_rendezvous_error(s) ? s
                                    : rendezvous_connection_error(
                                          absl::StrCat("exchanging worker counts after the rendezvous: ", s.message()));
    };
    absl::Status set = store.set(absl::StrCat("nproc/", info.rank), to_bytes(absl::StrCat(options_.nproc_per_node)));
    if (!set.ok()) return failed(set);
    if (info.rank == 0) {
      // A port free right now on every interface (the worker of rank 0 binds it next;
      // the window is the same one torchrun has).
      absl::StatusOr<uint16_t> port = internal::free_port(internal::PortScope::kAnyInterface);
      if (!port.ok()) {
        return absl::InternalError(absl::StrCat("picking a free port for MASTER_PORT: ", port.status().message()));
      }
      set = store.set("master", to_bytes(absl::StrCat(master_addr_, " ", *port)));
      if (!set.ok()) return failed(set);
    }
    std::vector<std::string> keys;
    for (int r = 0; r < info.world_size; ++r) keys.push_back(absl::StrCat("nproc/", r));
    keys.push_back("master");
    absl::StatusOr<std::vector<Bytes>> values = store.multi_get(keys, join_timeout_);
    if (!values.ok()) return failed(values.status());
    for (int r = 0; r < info.world_size; ++r) {
      int n = 0;
      if (!absl::SimpleAtoi(to_string((*values)[static_cast<size_t>(r)]), &n) || n < 1) {
        return rendezvous_state_error(absl::StrCat("node ", r, " published a worker count of \"",
                                                   to_string((*values)[static_cast<size_t>(r)]), "\""));
      }
      if (r < info.rank) round.rank_offset += n;
      round.world_size += n;
    }
    std::string master = to_string(values->back());
    size_t space = master.rfind(' ');
    if (space == std::string::npos || !absl::SimpleAtoi(master.substr(space + 1), &round.master_port)) {
      return rendezvous_state_error(absl::StrCat("node 0 published a master address of \"", master, "\""));
    }
    round.master_addr = master.substr(0, space);
    return round;
  }

  std::vector<WorkerSpec> specs(const Round& round, int restart_count) const {
    std::vector<WorkerSpec> specs;
    for (int local = 0; local < options_.nproc_per_node; ++local) {
      WorkerSpec spec;
      spec.local_rank = local;
      spec.rank = round.rank_offset + local;
      spec.env = {
          absl::StrCat("RANK=", spec.rank),
          absl::StrCat("LOCAL_RANK=", local),
          absl::StrCat("WORLD_SIZE=", round.world_size),
          absl::StrCat("LOCAL_WORLD_SIZE=", options_.nproc_per_node),
          absl::StrCat("GROUP_RANK=", round.group_rank),
          absl::StrCat("GROUP_WORLD_SIZE=", round.group_world_size),
          absl::StrCat("MASTER_ADDR=", round.master_addr),
          absl::StrCat("MASTER_PORT=", round.master_port),
          absl::StrCat("FERRY_RUN_ID=", handler_->get_run_id()),
          absl::StrCat("FERRY_RESTART_COUNT=", restart_count),
          absl::StrCat("FERRY_MAX_RESTARTS=", options_.max_restarts),
      };
      specs.push_back(std::move(spec));
    }
    return specs;
  }

  Outcome monitor(WorkerGroup& group) {
    Clock::time_point next_check = Clock::now() + options_.monitor_interval;
    bool warned = false;
    for (;;) {
      std::vector<pollfd> polls{{signal_fd_, POLLIN, 0}};
      for (int fd : group.output_fds()) polls.push_back({fd, POLLIN, 0});
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next_check - Clock::now());
      int n = ::poll(polls.data(), polls.size(), static_cast<int>(std::max<int64_t>(0, left.count())));
      if (n < 0 && errno != EINTR) {
        say(absl::StrCat("poll: ", strerror(errno)));
        return Outcome{Outcome::kSignal, {}, 0, SIGTERM};
      }
      for (const pollfd& p : polls) {
        if (n <= 0 || p.revents == 0) continue;
        if (p.fd != signal_fd_) {
          group.forward(p.fd);
          continue;
        }
        signalfd_siginfo info;
        while (::read(signal_fd_, &info, sizeof(info)) == static_cast<ssize_t>(sizeof(info))) {
          int sig = static_cast<int>(info.ssi_signo);
          if (sig != SIGCHLD) return Outcome{Outcome::kSignal, {}, 0, sig};
        }
      }
      for (const WorkerExit& e : group.reap()) {
        if (!e.ok()) return Outcome{Outcome::kFailed, e, 0, 0};
      }
      if (group.all_exited()) return Outcome{};
      if (Clock::now() < next_check) continue;
      next_check = Clock::now() + options_.monitor_interval;
      absl::StatusOr<bool> closed = handler_->is_closed();
      absl::StatusOr<int> waiting = closed.ok() ? handler_->num_nodes_waiting() : closed.status();
      if (!waiting.ok()) {
        // The workers may well finish without the store (its host may have finished
        // already): keep watching them.
        if (!warned) say(absl::StrCat("cannot reach the rendezvous (", waiting.status().message(), "); still watching the workers"));
        warned = true;
        continue;
      }
      if (*closed) return Outcome{Outcome::kClosed, {}, 0, 0};
      if (*waiting > 0) return Outcome{Outcome::kNodesWaiting, {}, *waiting, 0};
    }
  }

  const LaunchOptions& options_;
  std::unique_ptr<RendezvousHandler> handler_;
  int signal_fd_;
  std::chrono::milliseconds join_timeout_;
  std::string master_addr_;
};

}  // namespace

absl::Status parse_nnodes(std::string_view text, int* min_nodes, int* max_nodes) {
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat("--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '",
                                                   av(text), "'"));
  };
  std::vector<std::string> parts = absl::StrSplit(av(text), ':');
  if (parts.size() > 2) return bad();
  int lo = 0, hi = 0;
  if (!absl::SimpleAtoi(parts[0], &lo)) return bad();
  hi = lo;
  if (parts.size() == 2 && !absl::SimpleAtoi(parts[1], &hi)) return bad();
  if (lo < 1 || hi < lo) return bad();
  *min_nodes = lo;
  *max_nodes = hi;
  return absl::OkStatus();
}

absl::StatusOr<RendezvousConfig> parse_rdzv_conf(std::string_view text) {
  RendezvousConfig config;
  for (absl::string_view item : absl::StrSplit(av(text), ',', absl::SkipEmpty())) {
    size_t eq = item.find('=');
    if (eq == absl::string_view::npos || eq == 0) {
      return absl::InvalidArgumentError(absl::StrCat("--rdzv-conf entries must be KEY=VALUE, got '", item, "'"));
    }
    config[std::string(item.substr(0, eq))] = std::string(item.substr(eq + 1));
  }
  return config;
}

absl::StatusOr<std::chrono::milliseconds> parse_seconds(std::string_view name, std::string_view text) {
  double seconds = 0;
  if (!absl::SimpleAtod(av(text), &seconds) || !std::isfinite(seconds) || seconds <= 0 || seconds > 86400) {
    return absl::InvalidArgumentError(
        absl::StrCat(av(name), " must be a number of seconds in (0, 86400], got '", av(text), "'"));
  }
  return std::chrono::milliseconds(std::max<int64_t>(1, std::llround(seconds * 1000)));
}

int run_launcher(const LaunchOptions& in) {
  LaunchOptions options = in;
  if (options.program.empty()) {
    say("no PROGRAM given (usage: ferry run [OPTIONS] PROGRAM ARGS...)");
    return kExitUsage;
  }
  if (options.nproc_per_node < 1) {
    say(absl::StrCat("--nproc-per-node must be at least 1, got ", options.nproc_per_node));
    return kExitUsage;
  }
  if (options.max_restarts < 0) {
    say(absl::StrCat("--max-restarts must not be negative, got ", options.max_restarts));
    return kExitUsage;
  }
  if (options.standalone) {
    if (!options.rdzv_endpoint.empty() || options.max_nodes != 1) {
      say("--standalone runs one node with its own store: leave out --rdzv-endpoint and --nnodes");
      return kExitUsage;
    }
    options.rdzv_endpoint = "127.0.0.1:0";
    options.rdzv_conf["is_host"] = true;
    if (options.rdzv_id == "none") options.rdzv_id = absl::StrCat("standalone-", ::getpid());
  } else if (options.rdzv_endpoint.empty()) {
    say("--rdzv-endpoint HOST:PORT is required (or --standalone for a single node)");
    return kExitUsage;
  }

  absl::StatusOr<RendezvousParameters> params =
      RendezvousParameters::create(options.rdzv_backend, options.rdzv_endpoint, options.rdzv_id, options.min_nodes,
                                   options.max_nodes, options.rdzv_conf);
  if (!params.ok()) {
    say(std::string(params.status().message()));
    return kExitUsage;
  }
  absl::StatusOr<std::chrono::milliseconds> join_timeout =
      params->get_as_seconds("join_timeout", StoreRendezvousOptions{}.join_timeout);
  if (!join_timeout.ok()) {
    say(std::string(join_timeout.status().message()));
    return kExitUsage;
  }

  // The stop signals and SIGCHLD come from a signalfd, read in the agent's loop;
  // blocked before any thread exists, so that every thread inherits the mask.
  sigset_t signals;
  sigemptyset(&signals);
  for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGCHLD}) sigaddset(&signals, sig);
  ::pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  ::signal(SIGPIPE, SIG_IGN);
  int signal_fd = ::signalfd(-1, &signals, SFD_NONBLOCK | SFD_CLOEXEC);
  if (signal_fd < 0) {
    say(absl::StrCat("signalfd: ", strerror(errno)));
    return kExitFailed;
  }

  absl::StatusOr<std::unique_ptr<RendezvousHandler>> handler = rendezvous_handler_registry().create_handler(*params);
  if (!handler.ok()) {
    say(absl::StrCat("cannot set up the rendezvous: ", handler.status().message()));
    ::close(signal_fd);
    return handler.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitFailed;
  }
  std::string master_addr;
  if (options.local_addr) {
    master_addr = *options.local_addr;
  } else if (is_loopback(endpoint_host(options.rdzv_endpoint))) {
    master_addr = "127.0.0.1";
  } else {
    // Not the host name: on hosts whose name resolves to loopback, workers elsewhere
    // could not reach it. The shared resolver picks the interface that reaches the
    // rendezvous host (FERRY_SOCKET_IFNAME first), as the agents do.
    absl::StatusOr<internal::ListenAddress> where =
        internal::resolve_listen_address(std::nullopt, endpoint_host(options.rdzv_endpoint));
    if (!where.ok()) {
      say(absl::StrCat("cannot choose MASTER_ADDR: ", where.status().message()));
      ::close(signal_fd);
      return kExitFailed;
    }
    master_addr = where->host;
  }
  int code = Agent(options, *std::move(handler), signal_fd, *join_timeout, master_addr).run();
  ::close(signal_fd);
  return code;
}

}  // namespace ferry::tools
