#include "backends/tensorpipe/tensorpipe_backend.h"

#include <unistd.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agents/tensorpipe/factory.h"
#include "backends/init_failures.h"
#include "agents/core/dynamic_group.h"
#include "agents/core/records.h"
#include "base/logging.h"
#include "base/status.h"
#include "cereal/types/string.hpp"
#include "device_maps/validate.h"
#include "serialization/archive.h"
#include "serialization/types.h"
#include "store/collectives.h"
#include "tensor/cuda.h"

namespace ferry {
namespace {

constexpr char kInitPrefix[] = "ferry/rpc/init/";
constexpr const char* kKnownKwargs[] = {"num_worker_threads", "transports", "channels", "device_maps", "devices",
                                        "heartbeat_interval_ms", "auth_token"};

template <typename T>
absl::StatusOr<T> kwarg_as(const std::string& key, const KwargValue& value, const char* expected) {
  return ferry::kwarg_as<T>("TENSORPIPE", key, value, expected);
}

// What each worker contributes to the first all-gather: its device info and host,
// and whatever already failed locally, so that every worker fails together.
struct InitRecord {
  WorkerDeviceInfo info;
  std::string host;
  std::string error;  // empty: fine
  int32_t code = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(info, host, error, code);
  }
};

// The second all-gather: the agent's address, or why it did not start.
struct AddressRecord {
  std::string address;
  std::string error;
  int32_t code = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(address, error, code);
  }
};

template <typename T>
absl::StatusOr<std::vector<T>> all_gather(Store& store, const std::string& key, int rank, int world_size,
                                          const T& mine, std::chrono::milliseconds timeout) {
  FERRY_ASSIGN_OR_RETURN(std::vector<Bytes> all,
                         store_all_gather(store, key, rank, world_size, internal::encode_record(mine), timeout));
  std::vector<T> out;
  out.reserve(all.size());
  for (const Bytes& bytes : all) {
    FERRY_ASSIGN_OR_RETURN(T record, internal::decode_record<T>(bytes, "init record"));
    out.push_back(std::move(record));
  }
  return out;
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

// Steps 1-7 of a static group's init. Local failures travel in the records, so that
// every worker fails together; the store waits go through `failures`' watched store.
absl::StatusOr<std::shared_ptr<Agent>> init_static_group(const BackendInitArgs& args,
                                                                   const TensorPipeRpcBackendOptions& options,
                                                                   std::chrono::milliseconds init_timeout,
                                                                   const std::string& prefix,
                                                                   internal::InitFailures& failures) {
  Store& store = *failures.watching_store();
  // Steps 1-2: every worker's device info and host (and any local failure so far).
  InitRecord mine;
  mine.info.name = args.name;
  mine.info.device_count = cuda_runtime()->device_count();
  mine.info.device_maps = options.device_maps();
  mine.info.devices = options.devices();
  mine.host = host_name();
  if (absl::Status s = options.validate(); !s.ok()) {
    mine.error = std::string(s.message());
    mine.code = static_cast<int32_t>(s.code());
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<InitRecord> all,
                         all_gather(store, prefix + "info", args.rank, args.world_size, mine, init_timeout));
  std::vector<WorkerDeviceInfo> infos;
  std::map<std::string, int> ranks_by_name;
  int local_workers = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    const InitRecord& record = all[r];
    if (!record.error.empty()) {
      return internal::init_failure(static_cast<int>(r), record.info.name, static_cast<absl::StatusCode>(record.code),
                                    record.error);
    }
    auto [it, fresh] = ranks_by_name.emplace(record.info.name, static_cast<int>(r));
    if (!fresh) {
      return internal::group_verdict(absl::InvalidArgumentError(absl::StrCat(
          "worker name \"", record.info.name, "\" is used by both rank ", it->second, " and rank ", r,
          "; names must be unique")));
    }
    if (record.host == mine.host) ++local_workers;
    infos.push_back(record.info);
  }

  // Steps 3-5: validate every worker's maps (deterministic, so every worker reaches the
  // same verdict), then my reverse maps and device list.
  absl::StatusOr<DeviceSetup> setup = setup_devices(args.name, infos, /*is_static_group=*/true);
  if (!setup.ok()) return internal::group_verdict(setup.status());

  // Step 6: the agent, listening where the peers that reach the store reach it; no
  // pipe opens yet.
  TensorPipeAgentOptions agent_options;
  static_cast<TensorPipeAgentSettings&>(agent_options) = options;
  agent_options.local_workers = local_workers;
  agent_options.store_prefix = prefix;
  agent_options.rpc_timeout = options.rpc_timeout;
  agent_options.init_timeout = init_timeout;
  agent_options.device_maps = options.device_maps();
  agent_options.reverse_device_maps = setup->reverse_device_maps;
  agent_options.devices = setup->devices;
  agent_options.store_host = internal::store_host_of(*args.store);
  agent_options.serves_inline = args.serves_inline;
  absl::StatusOr<std::shared_ptr<Agent>> agent =
      TensorPipeAgent::start(args.store, args.name, args.rank, agent_options, args.handler);

  // Step 7: everyone's address, or why their agent did not start; since every worker
  // waits for all the others here, it is also the barrier.
  AddressRecord started;
  if (agent.ok()) {
    started.address = (*agent)->address();
  } else {
    started.error = std::string(agent.status().message());
    started.code = static_cast<int32_t>(agent.status().code());
  }
  absl::StatusOr<std::vector<AddressRecord>> addresses =
      all_gather(store, prefix + "address", args.rank, args.world_size, started, init_timeout);
  absl::Status failed = addresses.status();
  std::vector<PeerAddress> members;
  for (size_t r = 0; failed.ok() && r < addresses->size(); ++r) {
    const AddressRecord& record = (*addresses)[r];
    if (!record.error.empty()) {
      failed = internal::init_failure(static_cast<int>(r), all[r].info.name, static_cast<absl::StatusCode>(record.code),
                                      record.error);
    } else {
      members.push_back(PeerAddress{WorkerInfo{all[r].info.name, static_cast<int>(r)}, record.address});
    }
  }
  if (failed.ok()) failed = (*agent)->set_members(members);
  if (!failed.ok()) {
    if (agent.ok()) (*agent)->shutdown();
    return failed;
  }
  return agent;
}

}  // namespace

absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_tensorpipe_options(std::chrono::milliseconds rpc_timeout,
                                                                                const std::string& init_method,
                                                                                const Kwargs& kwargs) {
  auto options = std::make_unique<TensorPipeRpcBackendOptions>();
  options->rpc_timeout = rpc_timeout;
  options->init_method = init_method;
  for (const auto& [key, value] : kwargs) {
    if (key == "num_worker_threads") {
      FERRY_ASSIGN_OR_RETURN(int64_t n, kwarg_as<int64_t>(key, value, "int64"));
      // Clamped only to fit an int: validate() below says what the range is.
      options->num_worker_threads =
          static_cast<int>(std::clamp<int64_t>(n, -1, TensorPipeAgentSettings::kMaxWorkerThreads + 1));
    } else if (key == "heartbeat_interval_ms") {
      FERRY_ASSIGN_OR_RETURN(int64_t ms, kwarg_as<int64_t>(key, value, "int64"));
      options->heartbeat_interval = std::chrono::milliseconds(ms);
    } else if (key == "auth_token") {
      FERRY_ASSIGN_OR_RETURN(options->auth_token, kwarg_as<std::string>(key, value, "string"));
    } else if (key == "transports") {
      FERRY_ASSIGN_OR_RETURN(options->transports, kwarg_as<std::vector<std::string>>(key, value, "vector<string>"));
    } else if (key == "channels") {
      FERRY_ASSIGN_OR_RETURN(options->channels, kwarg_as<std::vector<std::string>>(key, value, "vector<string>"));
    } else {
      FERRY_ASSIGN_OR_RETURN(bool applied, apply_device_kwarg("TENSORPIPE", key, value, *options));
      if (applied) continue;
      return absl::InvalidArgumentError(absl::StrCat("TENSORPIPE backend has no option \"", key,
                                                     "\" (expected one of: ", absl::StrJoin(kKnownKwargs, ", "),
                                                     ")"));
    }
  }
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
  if (args.world_size <= 0) {
    // A dynamic group (see agents/core/dynamic_group.h).
    FERRY_RETURN_IF_ERROR(options->validate());
    TensorPipeAgentOptions agent_options;
    static_cast<TensorPipeAgentSettings&>(agent_options) = *options;
    agent_options.rpc_timeout = options->rpc_timeout;
    agent_options.init_timeout = init_timeout;
    agent_options.serves_inline = args.serves_inline;
    agent_options.device_maps = options->device_maps();
    agent_options.store_host = internal::store_host_of(*args.store);
    FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> agent,
                           TensorPipeAgent::start(args.store, args.name, args.rank, agent_options, args.handler));
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
  // Each rank numbers its inits on this store; the n-th inits of all ranks meet.
  FERRY_ASSIGN_OR_RETURN(int64_t generation,
                         args.store->add(absl::StrCat(kInitPrefix, "count/rank_", args.rank), 1));
  std::string prefix = absl::StrCat(kInitPrefix, generation, "/");
  // A failure anywhere is published under the prefix, and every other rank's waits end
  // with it (see backends/init_failures.h).
  internal::InitFailures failures(args.store, prefix);
  absl::StatusOr<std::shared_ptr<Agent>> agent = init_static_group(args, *options, init_timeout, prefix,
                                                                             failures);
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
