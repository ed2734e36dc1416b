#include "backends/process_group/process_group_backend.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agents/process_group/factory.h"
#include "backends/init_failures.h"
#include "base/net.h"
#include "base/status.h"
#include "cereal/types/string.hpp"
#include "device_maps/validate.h"
#include "process_group/process_group.h"
#include "serialization/archive.h"
#include "serialization/types.h"
#include "tensor/cuda.h"

namespace ferry {
namespace {

constexpr char kInitPrefix[] = "ferry/rpc/init/";
constexpr const char* kKnownKwargs[] = {"num_send_recv_threads", "device_maps", "devices"};

template <typename T>
absl::StatusOr<T> kwarg_as(const std::string& key, const KwargValue& value, const char* expected) {
  return ferry::kwarg_as<T>("PROCESS_GROUP", key, value, expected);
}

// Step 2's record, and step 5's (only `error`/`code` set): what failed locally, so
// every worker fails together.
struct InitRecord {
  WorkerDeviceInfo info;
  std::string error;  // empty: fine
  int32_t code = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(info, error, code);
  }
};

Bytes encode(const InitRecord& record) {
  Message m(MessageType::kResponse, 0);
  {
    PayloadWriter w(m);
    w(record);
  }
  std::string s = m.seal();
  return Bytes(s.begin(), s.end());
}

absl::StatusOr<std::vector<InitRecord>> all_gather(ProcessGroup& group, const InitRecord& mine) {
  FERRY_ASSIGN_OR_RETURN(std::vector<Bytes> all, group.all_gather_bytes(encode(mine)));
  std::vector<InitRecord> out;
  for (const Bytes& bytes : all) {
    FERRY_ASSIGN_OR_RETURN(Message m, Message::parse(std::string(bytes.begin(), bytes.end()), {}));
    FERRY_ASSIGN_OR_RETURN(auto values, read_payload<InitRecord>(m, "PROCESS_GROUP init record"));
    out.push_back(std::get<0>(std::move(values)));
  }
  return out;
}

void set_error(InitRecord& record, const absl::Status& status) {
  record.error = std::string(status.message());
  record.code = static_cast<int32_t>(status.code());
}

// Steps 0-5 of the init.
absl::StatusOr<std::shared_ptr<Agent>> init_group(const BackendInitArgs& args,
                                                              const ProcessGroupRpcBackendOptions& options,
                                                              internal::InitFailures& failures) {
  // The group's timeout bounds every later wait for a peer to take a message, so it is
  // at least Gloo's default even when calls time out sooner.
  const std::chrono::milliseconds timeout =
      options.rpc_timeout.count() > 0 ? std::max(options.rpc_timeout, ProcessGroup::kDefaultTimeout)
                                      : std::chrono::milliseconds(std::chrono::minutes(5));

  // Step 0: what can fail here before the group exists fails now, and is published:
  // the others are waiting for this rank inside ProcessGroup::create.
  FERRY_RETURN_IF_ERROR(options.validate());
  if (args.name.empty()) return absl::InvalidArgumentError("worker name is empty");
  ProcessGroupOptions group_options;
  FERRY_ASSIGN_OR_RETURN(internal::ListenAddress where,
                         internal::resolve_listen_address(std::nullopt, internal::store_host_of(*args.store)));
  group_options.address = where.host;

  // Step 1: the process group, its store waits watching for a published failure.
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> created,
                         ProcessGroup::create(failures.watching_store(), args.rank, args.world_size, timeout,
                                              group_options));
  std::shared_ptr<ProcessGroup> group(std::move(created));

  // Step 2: every worker's device info.
  InitRecord mine;
  mine.info.name = args.name;
  mine.info.device_count = cuda_runtime()->device_count();
  mine.info.device_maps = options.device_maps();
  mine.info.devices = options.devices();
  FERRY_ASSIGN_OR_RETURN(std::vector<InitRecord> all, all_gather(*group, mine));
  std::vector<WorkerDeviceInfo> infos;
  for (size_t r = 0; r < all.size(); ++r) {
    if (!all[r].error.empty()) {
      return internal::init_failure(static_cast<int>(r), all[r].info.name, static_cast<absl::StatusCode>(all[r].code),
                                    all[r].error);
    }
    for (size_t q = 0; q < r; ++q) {
      if (all[q].info.name == all[r].info.name) {
        return internal::group_verdict(absl::InvalidArgumentError(absl::StrCat(
            "worker name \"", all[r].info.name, "\" is used by both rank ", q, " and rank ", r,
            "; names must be unique")));
      }
    }
    infos.push_back(all[r].info);
  }

  // Step 3: deterministic, so every worker reaches the same verdict.
  absl::StatusOr<DeviceSetup> setup = setup_devices(args.name, infos, /*is_static_group=*/true);
  if (!setup.ok()) return internal::group_verdict(setup.status());

  // Step 4: the agent; every rank of the group is a member.
  ProcessGroupAgentOptions agent_options;
  agent_options.num_send_recv_threads = options.num_send_recv_threads;
  agent_options.rpc_timeout = options.rpc_timeout;
  agent_options.device_maps = options.device_maps();
  agent_options.reverse_device_maps = setup->reverse_device_maps;
  agent_options.serves_inline = args.serves_inline;
  ProcessGroup& pg = *group;
  absl::StatusOr<std::shared_ptr<Agent>> agent =
      ProcessGroupAgent::create(group, args.store, args.name, std::move(agent_options), args.handler);

  // Step 5: the barrier, which also tells every worker whether all agents started.
  InitRecord started;
  started.info.name = args.name;
  if (!agent.ok()) set_error(started, agent.status());
  absl::StatusOr<std::vector<InitRecord>> verdicts = all_gather(agent.ok() ? *ProcessGroupAgent::process_group(**agent) : pg, started);
  absl::Status failed = verdicts.status();
  if (verdicts.ok()) {
    for (size_t r = 0; r < verdicts->size(); ++r) {
      const InitRecord& v = (*verdicts)[r];
      if (!v.error.empty()) {
        failed = internal::init_failure(static_cast<int>(r), v.info.name, static_cast<absl::StatusCode>(v.code), v.error);
        break;
      }
    }
  }
  if (!failed.ok()) {
    if (agent.ok()) (*agent)->shutdown();
    return failed;
  }
  return agent;
}

}  // namespace

absl::Status ProcessGroupRpcBackendOptions::validate() const {
  ProcessGroupAgentOptions agent;
  agent.num_send_recv_threads = num_send_recv_threads;
  agent.rpc_timeout = rpc_timeout;
  return agent.validate();
}

absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_process_group_options(
    std::chrono::milliseconds rpc_timeout, const std::string& init_method, const Kwargs& kwargs) {
  auto options = std::make_unique<ProcessGroupRpcBackendOptions>();
  options->rpc_timeout = rpc_timeout;
  options->init_method = init_method;
  for (const auto& [key, value] : kwargs) {
    if (key == "num_send_recv_threads") {
      FERRY_ASSIGN_OR_RETURN(int64_t n, kwarg_as<int64_t>(key, value, "int64"));
      // Clamped only to fit an int: validate() below says what the range is.
      options->num_send_recv_threads =
          static_cast<int>(std::clamp<int64_t>(n, -1, ProcessGroupAgentOptions::kMaxSendRecvThreads + 1));
    } else {
      FERRY_ASSIGN_OR_RETURN(bool applied, apply_device_kwarg("PROCESS_GROUP", key, value, *options));
      if (applied) continue;
      return absl::InvalidArgumentError(absl::StrCat("PROCESS_GROUP backend has no option \"", key,
                                                     "\" (expected one of: ", absl::StrJoin(kKnownKwargs, ", "),
                                                     ")"));
    }
  }
  FERRY_RETURN_IF_ERROR(options->validate());
  return options;
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
  // Each rank numbers its inits on this store; the n-th inits of all ranks meet. A
  // failure anywhere is published under the init's prefix, and every other rank's
  // waits end with it (see backends/init_failures.h).
  FERRY_ASSIGN_OR_RETURN(int64_t generation,
                         args.store->add(absl::StrCat(kInitPrefix, "count/rank_", args.rank), 1));
  internal::InitFailures failures(args.store, absl::StrCat(kInitPrefix, generation, "/"));
  absl::StatusOr<std::shared_ptr<Agent>> agent = init_group(args, *options, failures);
  absl::Status status = failures.conclude(args.rank, args.name, agent.status());
  if (!status.ok()) {
    if (agent.ok()) (*agent)->shutdown();
    failures.linger(args.world_size);
    return status;
  }
  failures.disarm();
  return std::shared_ptr<RpcAgent>(*std::move(agent));
}

}  // namespace ferry
