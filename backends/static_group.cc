#include "backends/static_group.h"

#include <unistd.h>

#include <map>

#include "absl/strings/str_cat.h"
#include "agents/core/records.h"
#include "backends/init_failures.h"
#include "base/status.h"
#include "cereal/types/string.hpp"
#include "serialization/types.h"
#include "store/collectives.h"
#include "tensor/cuda.h"

namespace ferry::internal {
namespace {

constexpr char kInitPrefix[] = "ferry/rpc/init/";

// The first gather: a worker's device info and host, and whatever already failed
// locally, so that every worker fails together.
struct InfoRecord {
  WorkerDeviceInfo info;
  std::string host;
  std::string error;  // empty: fine
  int32_t code = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(info, host, error, code);
  }
};

// The second gather: the agent's address, or why it did not start.
struct StartedRecord {
  std::string address;
  std::string error;
  int32_t code = 0;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(address, error, code);
  }
};

template <typename T>
absl::StatusOr<std::vector<T>> gather(StaticGroup& group, const StaticInit& init, const BackendInitArgs& args,
                                      const std::string& step, const T& mine) {
  FERRY_ASSIGN_OR_RETURN(std::vector<Bytes> all,
                         group.all_gather(init, args.rank, args.world_size, step, encode_record(mine)));
  if (all.size() != static_cast<size_t>(args.world_size)) {
    return absl::InternalError(absl::StrCat("init gather \"", step, "\" returned ", all.size(), " records for ",
                                            args.world_size, " ranks"));
  }
  std::vector<T> out;
  out.reserve(all.size());
  for (const Bytes& bytes : all) {
    FERRY_ASSIGN_OR_RETURN(T record, decode_record<T>(bytes, "init record"));
    out.push_back(std::move(record));
  }
  return out;
}

std::string host_name() {
  char name[256] = {};
  if (gethostname(name, sizeof(name) - 1) != 0) return "";
  return name;
}

void set_error(std::string& error, int32_t& code, const absl::Status& status) {
  error = std::string(status.message());
  code = static_cast<int32_t>(status.code());
}

// The steps, from the first gather to the barrier. Local failures travel in the
// records, so that every worker fails together.
absl::StatusOr<std::shared_ptr<Agent>> run_steps(const BackendInitArgs& args, const StaticWorker& worker,
                                                 const StaticInit& init, StaticGroup& group) {
  FERRY_RETURN_IF_ERROR(group.prepare(init));

  InfoRecord mine;
  mine.info.name = args.name;
  mine.info.device_count = cuda_runtime()->device_count();
  mine.info.device_maps = worker.device_maps;
  mine.info.devices = worker.devices;
  mine.host = host_name();
  if (!worker.valid.ok()) {
    set_error(mine.error, mine.code, worker.valid);
  } else if (args.name.empty()) {
    set_error(mine.error, mine.code, absl::InvalidArgumentError("worker name is empty"));
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<InfoRecord> all, gather(group, init, args, "info", mine));
  std::vector<WorkerDeviceInfo> infos;
  std::map<std::string, int> ranks_by_name;
  int local_workers = 0;
  for (size_t r = 0; r < all.size(); ++r) {
    const InfoRecord& record = all[r];
    if (!record.error.empty()) {
      return init_failure(static_cast<int>(r), record.info.name, static_cast<absl::StatusCode>(record.code),
                          record.error);
    }
    auto [it, fresh] = ranks_by_name.emplace(record.info.name, static_cast<int>(r));
    if (!fresh) {
      return group_verdict(absl::InvalidArgumentError(absl::StrCat("worker name \"", record.info.name,
                                                                   "\" is used by both rank ", it->second,
                                                                   " and rank ", r, "; names must be unique")));
    }
    if (record.host == mine.host) ++local_workers;
    infos.push_back(record.info);
  }

  absl::StatusOr<DeviceSetup> setup = setup_devices(args.name, infos, /*is_static_group=*/true);
  if (!setup.ok()) return group_verdict(setup.status());

  absl::StatusOr<std::shared_ptr<Agent>> agent = group.start_agent(init, *setup, local_workers);

  // Every worker waits for all the others here, so this is also the barrier.
  StartedRecord started;
  if (agent.ok()) {
    started.address = (*agent)->address();
  } else {
    set_error(started.error, started.code, agent.status());
  }
  absl::StatusOr<std::vector<StartedRecord>> addresses = gather(group, init, args, "address", started);
  absl::Status failed = addresses.status();
  std::vector<PeerAddress> members;
  for (size_t r = 0; failed.ok() && r < addresses->size(); ++r) {
    const StartedRecord& record = (*addresses)[r];
    if (!record.error.empty()) {
      failed = init_failure(static_cast<int>(r), all[r].info.name, static_cast<absl::StatusCode>(record.code),
                            record.error);
    } else {
      members.push_back(PeerAddress{WorkerInfo{all[r].info.name, static_cast<int>(r)}, record.address});
    }
  }
  if (failed.ok()) failed = group.connect(**agent, std::move(members));
  if (!failed.ok()) {
    if (agent.ok()) (*agent)->shutdown();
    return failed;
  }
  return agent;
}

}  // namespace

absl::Status StaticGroup::prepare(const StaticInit&) { return absl::OkStatus(); }

absl::StatusOr<std::vector<Bytes>> StaticGroup::all_gather(const StaticInit& init, int rank, int world_size,
                                                           const std::string& step, const Bytes& mine) {
  return store_all_gather(*init.store, init.prefix + step, rank, world_size, mine, init.timeout);
}

absl::Status StaticGroup::connect(Agent&, std::vector<PeerAddress>) { return absl::OkStatus(); }

absl::StatusOr<std::shared_ptr<RpcAgent>> init_static_group(const BackendInitArgs& args, const StaticWorker& worker,
                                                            std::chrono::milliseconds timeout, StaticGroup& group) {
  FERRY_ASSIGN_OR_RETURN(int64_t generation, args.store->add(absl::StrCat(kInitPrefix, "count/rank_", args.rank), 1));
  StaticInit init;
  init.prefix = absl::StrCat(kInitPrefix, generation, "/");
  init.timeout = timeout;
  // A failure anywhere is published under the prefix, and every other rank's waits end
  // with it.
  InitFailures failures(args.store, init.prefix);
  init.store = failures.watching_store();
  absl::StatusOr<std::shared_ptr<Agent>> agent = run_steps(args, worker, init, group);
  absl::Status status = failures.conclude(args.rank, args.name, agent.status());
  if (!status.ok()) {
    if (agent.ok()) (*agent)->shutdown();
    failures.linger(args.world_size);
    return status;
  }
  failures.disarm();
  return std::shared_ptr<RpcAgent>(*std::move(agent));
}

}  // namespace ferry::internal
