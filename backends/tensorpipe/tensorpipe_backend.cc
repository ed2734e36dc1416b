#include "backends/tensorpipe/tensorpipe_backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "agents/core/dynamic_group.h"
#include "agents/tensorpipe/factory.h"
#include "backends/init_failures.h"
#include "backends/kwargs.h"
#include "backends/static_group.h"
#include "base/status.h"
#include "device_maps/validate.h"
#include "tensor/cuda.h"

namespace ferry {
namespace {

const KwargTable<TensorPipeRpcBackendOptions>& kwarg_table() {
  using Options = TensorPipeRpcBackendOptions;
  static const auto* table = new KwargTable<Options>(
      "TENSORPIPE",
      {
          kwarg<Options, int64_t>("num_worker_threads",
                                  [](Options& o, int64_t n) {
                                    // Clamped only to fit an int: validate() says what the range is.
                                    o.num_worker_threads = static_cast<int>(
                                        std::clamp<int64_t>(n, -1, TensorPipeAgentSettings::kMaxWorkerThreads + 1));
                                    return absl::OkStatus();
                                  }),
          kwarg<Options, std::vector<std::string>>("transports",
                                                   [](Options& o, const std::vector<std::string>& v) {
                                                     o.transports = v;
                                                     return absl::OkStatus();
                                                   }),
          kwarg<Options, std::vector<std::string>>("channels",
                                                   [](Options& o, const std::vector<std::string>& v) {
                                                     o.channels = v;
                                                     return absl::OkStatus();
                                                   }),
          kwarg<Options, int64_t>("heartbeat_interval_ms",
                                  [](Options& o, int64_t ms) {
                                    o.heartbeat_interval = std::chrono::milliseconds(ms);
                                    return absl::OkStatus();
                                  }),
          kwarg<Options, std::string>("auth_token",
                                      [](Options& o, const std::string& token) {
                                        o.auth_token = token;
                                        return absl::OkStatus();
                                      }),
      },
      /*device_kwargs=*/true);
  return *table;
}

// The agent options both kinds of group share.
TensorPipeAgentOptions agent_options(const BackendInitArgs& args, const TensorPipeRpcBackendOptions& options,
                                     std::chrono::milliseconds init_timeout) {
  TensorPipeAgentOptions agent_options;
  static_cast<TensorPipeAgentSettings&>(agent_options) = options;
  agent_options.rpc_timeout = options.rpc_timeout;
  agent_options.init_timeout = init_timeout;
  agent_options.device_maps = options.device_maps();
  agent_options.store_host = internal::store_host_of(*args.store);
  agent_options.serves_inline = args.serves_inline;
  return agent_options;
}

// TENSORPIPE's part of a static group: the agent listens where the peers that reach
// the store reach it, and opens no pipe until the first call; the members' addresses
// come from the second gather.
class TensorPipeGroup final : public internal::StaticGroup {
 public:
  TensorPipeGroup(const BackendInitArgs& args, const TensorPipeRpcBackendOptions& options)
      : args_(args), options_(options) {}

  absl::StatusOr<std::shared_ptr<Agent>> start_agent(const internal::StaticInit& init, const DeviceSetup& setup,
                                                     int local_workers) override {
    TensorPipeAgentOptions o = agent_options(args_, options_, init.timeout);
    o.local_workers = local_workers;
    o.store_prefix = init.prefix;
    o.reverse_device_maps = setup.reverse_device_maps;
    o.devices = setup.devices;
    return TensorPipeAgent::start(args_.store, args_.name, args_.rank, o, args_.handler);
  }

  absl::Status connect(Agent& agent, std::vector<PeerAddress> members) override {
    return agent.set_members(std::move(members));
  }

 private:
  const BackendInitArgs& args_;
  const TensorPipeRpcBackendOptions& options_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_tensorpipe_options(std::chrono::milliseconds rpc_timeout,
                                                                                const std::string& init_method,
                                                                                const Kwargs& kwargs) {
  auto options = std::make_unique<TensorPipeRpcBackendOptions>();
  options->rpc_timeout = rpc_timeout;
  options->init_method = init_method;
  FERRY_RETURN_IF_ERROR(kwarg_table().apply(kwargs, *options));
  FERRY_RETURN_IF_ERROR(options->validate());
  return options;
}

absl::StatusOr<std::shared_ptr<RpcAgent>> init_tensorpipe_backend(const BackendInitArgs& args) {
  const auto* options = dynamic_cast<const TensorPipeRpcBackendOptions*>(&args.options);
  if (options == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("TENSORPIPE backend got options of backend ",
                                                   args.options.backend_name()));
  }
  std::chrono::milliseconds init_timeout =
      options->rpc_timeout.count() > 0 ? options->rpc_timeout : std::chrono::milliseconds(std::chrono::minutes(5));
  if (args.world_size > 0) {
    internal::StaticWorker worker{options->device_maps(), options->devices(), options->validate()};
    TensorPipeGroup group(args, *options);
    return internal::init_static_group(args, worker, init_timeout, group);
  }
  // A dynamic group (see agents/core/dynamic_group.h).
  FERRY_RETURN_IF_ERROR(options->validate());
  FERRY_ASSIGN_OR_RETURN(
      std::shared_ptr<Agent> agent,
      TensorPipeAgent::start(args.store, args.name, args.rank, agent_options(args, *options, init_timeout),
                             args.handler));
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
