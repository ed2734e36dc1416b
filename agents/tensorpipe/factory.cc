#include "agents/tensorpipe/factory.h"

#include <algorithm>
#include <thread>

#include "absl/strings/str_cat.h"
#include "agents/core/static_members.h"
#include "agents/core/transport_set.h"
#include "agents/tensorpipe/transport.h"
#include "base/status.h"

namespace ferry {
namespace {

constexpr char kShm[] = "shm";

// The transport for `transports` (unset: the defaults), leaving shm out of the
// defaults when `leave_out_shm`.
absl::StatusOr<std::unique_ptr<Transport>> make_tensorpipe(const std::string& name,
                                                           std::optional<std::vector<std::string>> transports,
                                                           std::optional<std::vector<std::string>> channels,
                                                           std::vector<std::string> not_by_default,
                                                           std::string auth_token, std::string store_host) {
  internal::TensorPipeTransportOptions options{std::move(transports), std::move(channels), std::move(not_by_default),
                                               std::move(auth_token), std::move(store_host)};
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<internal::TensorPipeTransport> made,
                         internal::TensorPipeTransport::create(name, options));
  return std::unique_ptr<Transport>(std::move(made));
}

}  // namespace

absl::Status TensorPipeAgentOptions::validate() const {
  if (transports && transports->empty()) {
    return absl::InvalidArgumentError("transports is empty (expected some of shm, ibv, uv)");
  }
  return internal::check_tensorpipe_options({transports, channels, {}, {}, {}});
}

bool shm_crowds_host(int local_workers) {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return local_workers > cores;
}

TransportEntry tensorpipe_transport_entry() {
  TransportEntry entry;
  entry.names = internal::tensorpipe_transport_names();
  entry.rank = 200;
  entry.by_default = true;
  entry.same_host_names = {kShm};
  entry.other_host_names = {"ibv", "uv"};
  entry.reaches = [](const std::string& record) {
    const std::map<std::string, std::string> urls = internal::decode_address(record);
    for (const std::string& t : internal::tensorpipe_transport_names()) {
      if (urls.count(t) != 0) return true;
    }
    return false;
  };
  entry.check = [](const TransportArgs& args) {
    return internal::check_tensorpipe_options({args.names, args.channels, {}, {}, {}});
  };
  entry.make = [](const TransportArgs& args) -> absl::StatusOr<std::unique_ptr<Transport>> {
    if (args.listed) return make_tensorpipe(args.worker_name, args.names, args.channels, {}, args.auth_token,
                                            args.store_host);
    // Defaults: those of its names the registry left in (not shm when a transport of
    // lower rank serves this host), and not shm on a crowded host either.
    std::vector<std::string> left_out;
    for (const std::string& t : internal::tensorpipe_transport_names()) {
      if (std::find(args.names.begin(), args.names.end(), t) == args.names.end()) left_out.push_back(t);
    }
    if (shm_crowds_host(args.local_workers)) left_out.push_back(kShm);
    return make_tensorpipe(args.worker_name, std::nullopt, args.channels, std::move(left_out), args.auth_token,
                           args.store_host);
  };
  return entry;
}

absl::StatusOr<std::shared_ptr<Agent>> TensorPipeAgent::start(std::shared_ptr<Store> store, std::string name, int rank,
                                                              TensorPipeAgentOptions options, RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("rank must be >= 0, got ", rank));
  FERRY_RETURN_IF_ERROR(options.validate());
  std::vector<std::string> left_out;
  if (shm_crowds_host(options.local_workers)) left_out.push_back(kShm);
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport,
                         make_tensorpipe(name, std::move(options.transports), std::move(options.channels),
                                         std::move(left_out), options.agent.auth_token, options.store_host));
  return Agent::start(WorkerInfo{std::move(name), rank}, std::move(store), std::move(options.agent),
                      std::move(handler), std::move(transport));
}

absl::StatusOr<std::shared_ptr<Agent>> TensorPipeAgent::create(std::shared_ptr<Store> store, std::string name,
                                                               int rank, int world_size,
                                                               TensorPipeAgentOptions options,
                                                               RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (world_size < 1) return absl::InvalidArgumentError(absl::StrCat("world_size must be >= 1, got ", world_size));
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " out of range [0, ", world_size, ")"));
  }
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  if (!handler) return absl::InvalidArgumentError("request handler is empty");
  const std::chrono::milliseconds init_timeout = options.init_timeout;
  const std::string prefix = options.agent.store_prefix;
  return join_static_group(start(store, name, rank, std::move(options), std::move(handler)), *store, world_size,
                           prefix, init_timeout);
}

namespace {

const internal::TensorPipeTransport* tensorpipe_of(const Agent& agent) {
  return find_transport<internal::TensorPipeTransport>(agent.transport());
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
