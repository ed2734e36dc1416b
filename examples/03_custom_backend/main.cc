// 03_custom_backend: registering your own RPC backend. "TCP_ONLY" is a backend with its
// own options type (a thread count) whose init handler starts a TensorPipeAgent over
// TCP and the basic channel only, with no process group. Two forked workers start it
// through init_rpc and call each other; or, under a launcher that sets RANK, WORLD_SIZE,
// MASTER_ADDR and MASTER_PORT, each process is one of the two, meeting through env://:
//   ferry run --standalone --nproc-per-node 2 build/examples/03_custom_backend
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "agents/tensorpipe/factory.h"
#include "backends/agent_backend_options.h"
#include "rpc/ferry.h"

namespace {

// The backend's options: what construct_rpc_backend_options builds from kwargs. It
// derives from AgentBackendOptions, so it has the agent's settings every backend shares
// (num_worker_threads, heartbeat, auth_token, device maps) and turns them into the
// agent's options (the job token read from FERRY_AUTH_TOKEN when unset).
class TcpOnlyOptions final : public ferry::AgentBackendOptions {
 public:
  TcpOnlyOptions() : AgentBackendOptions(/*default_num_worker_threads=*/2) {}
  std::string backend_name() const override { return "TCP_ONLY"; }
};

absl::StatusOr<std::unique_ptr<ferry::RpcBackendOptions>> make_options(std::chrono::milliseconds rpc_timeout,
                                                                      const std::string& init_method,
                                                                      const ferry::Kwargs& kwargs) {
  auto options = std::make_unique<TcpOnlyOptions>();
  options->rpc_timeout = rpc_timeout;
  options->init_method = init_method;
  for (const auto& [key, value] : kwargs) {
    const int64_t* threads = std::get_if<int64_t>(&value);
    if (key != "threads" || threads == nullptr) {
      return absl::InvalidArgumentError("TCP_ONLY takes one option, \"threads\" (int64); got \"" + key + "\"");
    }
    options->num_worker_threads = static_cast<int>(*threads);
  }
  absl::Status valid = options->validate();
  if (!valid.ok()) return valid;
  return options;
}

absl::StatusOr<std::shared_ptr<ferry::RpcAgent>> start_agent(const ferry::BackendInitArgs& args) {
  const auto& options = static_cast<const TcpOnlyOptions&>(args.options);
  ferry::TensorPipeAgentOptions agent_options;
  agent_options.agent = options.agent_options();
  agent_options.transports = std::vector<std::string>{"uv"};
  agent_options.channels = std::vector<std::string>{"basic"};
  auto agent = ferry::TensorPipeAgent::create(args.store, args.name, args.rank, args.world_size, agent_options,
                                              args.handler);
  if (!agent.ok()) return agent.status();
  return std::shared_ptr<ferry::RpcAgent>(*agent);
}

int run(int rank, const std::string& init_method) {
  (void)ferry::register_function("greet", [](std::string who) {
    return "hello " + who + ", from " + ferry::get_worker_info().name;
  });
  absl::StatusOr<ferry::BackendType> backend = ferry::register_backend("TCP_ONLY", &make_options, &start_agent);
  if (!backend.ok()) return 1;
  auto options = ferry::construct_rpc_backend_options(*backend, std::chrono::seconds(30), init_method,
                                                      {{"threads", int64_t{2}}});
  if (!options.ok()) return 1;
  std::string name = "worker" + std::to_string(rank);
  absl::Status started = ferry::init_rpc(name, *backend, rank, 2, **options);
  if (!started.ok()) {
    std::fprintf(stderr, "%s: %s\n", name.c_str(), started.ToString().c_str());
    return 1;
  }
  std::string reply = ferry::rpc_sync<std::string>("worker" + std::to_string(1 - rank), "greet", name);
  std::printf("%s (backend %s, transports %s): %s\n", name.c_str(), backend->name.c_str(),
              ferry::current_agent()->debug_info().at("transports").c_str(), reply.c_str());
  std::fflush(stdout);
  return ferry::shutdown().ok() ? 0 : 1;
}

}  // namespace

int main() {
  if (std::getenv("RANK") != nullptr && std::getenv("MASTER_ADDR") != nullptr) {  // started by a launcher
    const char* world = std::getenv("WORLD_SIZE");
    if (world == nullptr || std::atoi(world) != 2) {
      std::fprintf(stderr, "03_custom_backend needs WORLD_SIZE=2 (--nproc-per-node 2), got %s\n",
                   world == nullptr ? "none" : world);
      return 2;
    }
    return run(std::atoi(std::getenv("RANK")), "env://");
  }
  std::string store = (std::filesystem::temp_directory_path() / ("ferry-03-" + std::to_string(getpid()))).string();
  std::vector<pid_t> children;
  for (int rank = 0; rank < 2; ++rank) {
    pid_t pid = fork();
    if (pid == 0) _exit(run(rank, "file://" + store));
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::filesystem::remove(store);
  return failed == 0 ? 0 : 1;
}
