#include "agents/tensorpipe/factory.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agents/core/static_members.h"
#include "agents/tensorpipe/transport.h"
#include "base/auth.h"
#include "base/status.h"

namespace ferry {
namespace {

}  // namespace

absl::Status TensorPipeAgentSettings::validate() const {
  if (num_worker_threads < 1 || num_worker_threads > kMaxWorkerThreads) {
    return absl::InvalidArgumentError(absl::StrCat("num_worker_threads must be in [1, ", kMaxWorkerThreads,
                                                   "], got ", num_worker_threads));
  }
  if (heartbeat_interval.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat_interval must be >= 0 ms (0: off), got ",
                                                   heartbeat_interval.count(), " ms"));
  }
  return internal::check_tensorpipe_options({transports, channels, {}, {}, {}});
}

bool shm_crowds_host(int local_workers) {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return local_workers > cores;
}

absl::StatusOr<std::shared_ptr<Agent>> TensorPipeAgent::start(std::shared_ptr<Store> store,
                                                                        std::string name, int rank,
                                                                        TensorPipeAgentOptions options,
                                                                        RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("rank must be >= 0, got ", rank));
  FERRY_RETURN_IF_ERROR(options.validate());
  internal::TensorPipeTransportOptions transport_options{options.transports, options.channels, {}, {},
                                                         options.store_host};
  if (shm_crowds_host(options.local_workers)) transport_options.not_by_default.push_back("shm");
  AgentOptions agent_options;
  agent_options.auth_token = internal::auth::job_token(options.auth_token);
  transport_options.auth_token = agent_options.auth_token;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<internal::TensorPipeTransport> transport,
                         internal::TensorPipeTransport::create(name, transport_options));
  agent_options.num_worker_threads = options.num_worker_threads;
  agent_options.rpc_timeout = options.rpc_timeout;
  agent_options.heartbeat = options.heartbeat_interval;
  agent_options.device_maps = std::move(options.device_maps);
  agent_options.reverse_device_maps = std::move(options.reverse_device_maps);
  agent_options.devices = std::move(options.devices);
  agent_options.store_prefix = options.store_prefix;
  agent_options.serves_inline = std::move(options.serves_inline);
  return Agent::start(WorkerInfo{std::move(name), rank}, std::move(store), std::move(agent_options),
                      std::move(handler), std::move(transport));
}

absl::StatusOr<std::shared_ptr<Agent>> TensorPipeAgent::create(std::shared_ptr<Store> store,
                                                                         std::string name, int rank, int world_size,
                                                                         TensorPipeAgentOptions options,
                                                                         RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (world_size < 1) return absl::InvalidArgumentError(absl::StrCat("world_size must be >= 1, got ", world_size));
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " out of range [0, ", world_size, ")"));
  }
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  if (!handler) return absl::InvalidArgumentError("request handler is empty");
  std::chrono::milliseconds init_timeout = options.init_timeout;
  const std::string prefix = options.store_prefix;
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> agent,
                         start(store, name, rank, std::move(options), std::move(handler)));
  FERRY_RETURN_IF_ERROR(exchange_addresses(*agent, *store, world_size, prefix, init_timeout));
  return agent;
}

namespace {

const internal::TensorPipeTransport* tensorpipe_of(const Agent& agent) {
  return dynamic_cast<const internal::TensorPipeTransport*>(&agent.transport());
}

}  // namespace

std::map<std::string, std::string> TensorPipeAgent::addresses(const Agent& agent) {
  const internal::TensorPipeTransport* tp = tensorpipe_of(agent);
  return tp ? tp->addresses() : std::map<std::string, std::string>();
}
std::vector<std::string> TensorPipeAgent::transports(const Agent& agent) {
  const internal::TensorPipeTransport* tp = tensorpipe_of(agent);
  return tp ? tp->transports() : std::vector<std::string>();
}
std::vector<std::string> TensorPipeAgent::channels(const Agent& agent) {
  const internal::TensorPipeTransport* tp = tensorpipe_of(agent);
  return tp ? tp->channels() : std::vector<std::string>();
}

}  // namespace ferry
