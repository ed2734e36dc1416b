#include "backends/process_group/process_group_backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "agents/process_group/factory.h"
#include "backends/init_failures.h"
#include "backends/kwargs.h"
#include "backends/static_group.h"
#include "base/net.h"
#include "base/status.h"
#include "process_group/process_group.h"

namespace ferry {
namespace {

using Options = ProcessGroupRpcBackendOptions;

const KwargTable<Options>& kwarg_table() {
  static const auto* table = [] {
    std::vector<KwargEntry<Options>> entries = agent_kwargs<Options>();
    entries.push_back(deprecated(kwarg<Options, int64_t>("num_send_recv_threads",
                                                         [](Options& o, int64_t n) {
                                                           // Clamped only to fit an int: validate()
                                                           // says what the range is.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
                                                           o.num_send_recv_threads = static_cast<int>(
                                                               std::clamp<int64_t>(n, -1, Options::kMaxWorkerThreads + 1));
#pragma GCC diagnostic pop
                                                           return absl::OkStatus();
                                                         }),
                                 "num_worker_threads"));
    return new KwargTable<Options>("PROCESS_GROUP", std::move(entries), /*device_kwargs=*/true);
  }();
  return *table;
}

// PROCESS_GROUP's part of a static group: the process group connects its mesh first,
// the gathers run over it, and the agent takes every rank as a member.
class ProcessGroupGroup final : public internal::StaticGroup {
 public:
  ProcessGroupGroup(const BackendInitArgs& args, const ProcessGroupRpcBackendOptions& options)
      : args_(args), options_(options) {}

  absl::Status prepare(const internal::StaticInit& init) override {
    ProcessGroupOptions group_options;
    FERRY_ASSIGN_OR_RETURN(internal::ListenAddress where,
                           internal::resolve_listen_address(std::nullopt, internal::store_host_of(*args_.store)));
    group_options.address = where.host;
    // A rank or world size that does not match the other ranks' fails here.
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> created,
                           ProcessGroup::create(init.store, args_.rank, args_.world_size, init.timeout, group_options));
    group_ = std::move(created);
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<Bytes>> all_gather(const internal::StaticInit&, int, int, const std::string&,
                                                const Bytes& mine) override {
    return group_->all_gather_bytes(mine);
  }

  absl::StatusOr<std::shared_ptr<Agent>> start_agent(const internal::StaticInit&, const DeviceSetup& setup,
                                                     int) override {
    ProcessGroupAgentOptions agent_options;
    agent_options.agent = options_.agent_options();
    agent_options.agent.store_prefix = process_group_agent_defaults().store_prefix;
    agent_options.agent.reverse_device_maps = setup.reverse_device_maps;
    agent_options.agent.serves_inline = args_.serves_inline;
    return ProcessGroupAgent::create(group_, args_.store, args_.name, std::move(agent_options), args_.handler);
  }

 private:
  const BackendInitArgs& args_;
  const ProcessGroupRpcBackendOptions& options_;
  std::shared_ptr<ProcessGroup> group_;
};

}  // namespace

AgentBackendOptions::Alias<int> ProcessGroupRpcBackendOptions::num_worker_threads_alias() const {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return {"num_send_recv_threads", num_send_recv_threads};
#pragma GCC diagnostic pop
}

absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_process_group_options(
    std::chrono::milliseconds rpc_timeout, const std::string& init_method, const Kwargs& kwargs) {
  return construct_options(kwarg_table(), rpc_timeout, init_method, kwargs);
}

absl::StatusOr<std::shared_ptr<RpcAgent>> init_process_group_backend(const BackendInitArgs& args) {
  const auto* options = dynamic_cast<const ProcessGroupRpcBackendOptions*>(&args.options);
  if (options == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("PROCESS_GROUP backend got options of backend ", args.options.backend_name()));
  }
  if (args.world_size <= 0) {
    return absl::UnimplementedError(
        "PROCESS_GROUP: dynamic groups (no world size) are not supported: a process group cannot gain members; "
        "use TENSORPIPE");
  }
  // The group's timeout bounds every later wait for a peer to take a message, so it is
  // at least Gloo's default even when calls time out sooner.
  const std::chrono::milliseconds timeout =
      options->rpc_timeout.count() > 0 ? std::max(options->rpc_timeout, ProcessGroup::kDefaultTimeout)
                                       : std::chrono::milliseconds(std::chrono::minutes(5));
  internal::StaticWorker worker{options->device_maps(), options->devices(), options->validate()};
  ProcessGroupGroup group(args, *options);
  return internal::init_static_group(args, worker, timeout, group);
}

}  // namespace ferry
