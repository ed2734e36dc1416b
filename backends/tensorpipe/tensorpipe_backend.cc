#include "backends/tensorpipe/tensorpipe_backend.h"

#include "absl/strings/str_cat.h"
#include "agents/core/dynamic_group.h"
#include "agents/core/registry.h"
#include "agents/tensorpipe/factory.h"
#include "backends/init_failures.h"
#include "backends/kwargs.h"
#include "backends/static_group.h"
#include "base/status.h"
#include "device_maps/validate.h"
#include "tensor/cuda.h"

namespace ferry {
namespace {

using Options = TensorPipeRpcBackendOptions;

const KwargTable<Options>& kwarg_table() {
  static const auto* table = [] {
    std::vector<KwargEntry<Options>> entries = agent_kwargs<Options>();
    entries.push_back(kwarg<Options, std::vector<std::string>>("transports",
                                                               [](Options& o, const std::vector<std::string>& v) {
                                                                 o.transports = v;
                                                                 return absl::OkStatus();
                                                               }));
    entries.push_back(kwarg<Options, std::vector<std::string>>("channels",
                                                               [](Options& o, const std::vector<std::string>& v) {
                                                                 o.channels = v;
                                                                 return absl::OkStatus();
                                                               }));
    entries.push_back(deprecated(kwarg<Options, int64_t>("heartbeat_interval_ms",
                                                         [](Options& o, int64_t ms) {
                                                           // The current spelling, so that one
                                                           // given beside it must agree.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
                                                           o.heartbeat_interval = std::chrono::milliseconds(ms);
#pragma GCC diagnostic pop
                                                           return absl::OkStatus();
                                                         }),
                                 "heartbeat_ms"));
    return new KwargTable<Options>("TENSORPIPE", std::move(entries), /*device_kwargs=*/true);
  }();
  return *table;
}

// What the registry's makers get, less the names it chooses.
TransportArgs transport_args(const BackendInitArgs& args, const Options& options, const AgentOptions& agent,
                             int local_workers) {
  TransportArgs t;
  t.worker_name = args.name;
  t.auth_token = agent.auth_token;
  t.store_host = args.store ? internal::store_host_of(*args.store) : std::string();
  t.local_workers = local_workers;
  t.heartbeat = agent.heartbeat;
  t.channels = options.channels;
  return t;
}

// This worker's agent over the transports the registry makes for `options`.
absl::StatusOr<std::shared_ptr<Agent>> start_agent(const BackendInitArgs& args, const Options& options,
                                                   AgentOptions agent, int local_workers) {
  agent.serves_inline = args.serves_inline;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport,
                         make_transport(options.transports, transport_args(args, options, agent, local_workers)));
  return Agent::start(WorkerInfo{args.name, args.rank}, args.store, std::move(agent), args.handler,
                      std::move(transport));
}

// TENSORPIPE's part of a static group: the agent listens where the peers that reach
// the store reach it, and opens no pipe until the first call; the members' addresses
// come from the second gather.
class TensorPipeGroup final : public internal::StaticGroup {
 public:
  TensorPipeGroup(const BackendInitArgs& args, const Options& options) : args_(args), options_(options) {}

  absl::StatusOr<std::shared_ptr<Agent>> start_agent(const internal::StaticInit& init, const DeviceSetup& setup,
                                                     int local_workers) override {
    AgentOptions agent = options_.agent_options();
    agent.store_prefix = init.prefix;
    agent.reverse_device_maps = setup.reverse_device_maps;
    agent.devices = setup.devices;
    return ferry::start_agent(args_, options_, std::move(agent), local_workers);
  }

  absl::Status connect(Agent& agent, std::vector<PeerAddress> members) override {
    return agent.set_members(std::move(members));
  }

 private:
  const BackendInitArgs& args_;
  const Options& options_;
};

}  // namespace

absl::Status TensorPipeRpcBackendOptions::validate() const {
  FERRY_RETURN_IF_ERROR(AgentBackendOptions::validate());
  register_builtin_transports();
  TransportArgs args;
  args.channels = channels;
  FERRY_RETURN_IF_ERROR(check_transports(transports, args));
  // Channels are TensorPipe's: named ones are checked even when no TensorPipe transport
  // is chosen (the defaults are the ring and tcp), so that a typo is still an error.
  if (channels) {
    TensorPipeAgentOptions tensorpipe;
    tensorpipe.channels = channels;
    FERRY_RETURN_IF_ERROR(tensorpipe.validate());
  }
  return absl::OkStatus();
}

AgentBackendOptions::Alias<std::chrono::milliseconds> TensorPipeRpcBackendOptions::heartbeat_alias() const {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return {"heartbeat_interval", heartbeat_interval};
#pragma GCC diagnostic pop
}

absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_tensorpipe_options(std::chrono::milliseconds rpc_timeout,
                                                                                const std::string& init_method,
                                                                                const Kwargs& kwargs) {
  return construct_options(kwarg_table(), rpc_timeout, init_method, kwargs);
}

absl::StatusOr<std::shared_ptr<RpcAgent>> init_tensorpipe_backend(const BackendInitArgs& args) {
  const auto* options = dynamic_cast<const Options*>(&args.options);
  if (options == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("TENSORPIPE backend got options of backend ",
                                                   args.options.backend_name()));
  }
  register_builtin_transports();
  std::chrono::milliseconds init_timeout =
      options->rpc_timeout.count() > 0 ? options->rpc_timeout : std::chrono::milliseconds(std::chrono::minutes(5));
  if (args.world_size > 0) {
    internal::StaticWorker worker{options->device_maps(), options->devices(), options->validate()};
    TensorPipeGroup group(args, *options);
    return internal::init_static_group(args, worker, init_timeout, group);
  }
  // A dynamic group (see agents/core/dynamic_group.h).
  FERRY_RETURN_IF_ERROR(options->validate());
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> agent,
                         start_agent(args, *options, options->agent_options(), /*local_workers=*/1));
  WorkerDeviceInfo mine;
  mine.name = args.name;
  mine.device_count = cuda_runtime()->device_count();
  mine.device_maps = options->device_maps();
  mine.devices = options->devices();
  absl::Status joined = join_dynamic_group(agent, args.store, std::move(mine), init_timeout);
  if (!joined.ok()) {
    agent->shutdown();
    return joined;
  }
  return std::shared_ptr<RpcAgent>(agent);
}

}  // namespace ferry
