#include "agents/tensorpipe/factory.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "agents/core/static_members.h"
#include "agents/core/transport_set.h"
#include "agents/ring/factory.h"
#include "agents/ring/transport.h"
#include "agents/tensorpipe/transport.h"
#include "base/auth.h"
#include "base/status.h"

namespace ferry {
namespace {

constexpr char kRing[] = "ring";

// The transports asked for: the option, else FERRY_TRANSPORTS, else unset (defaults).
absl::StatusOr<std::optional<std::vector<std::string>>> chosen_transports(
    const std::optional<std::vector<std::string>>& given) {
  if (given) return given;
  const char* env = std::getenv("FERRY_TRANSPORTS");
  if (env == nullptr || *env == '\0') return std::optional<std::vector<std::string>>();
  std::vector<std::string> names = absl::StrSplit(env, ',', absl::SkipWhitespace());
  if (names.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("FERRY_TRANSPORTS=\"", env, "\" names no transport"));
  }
  return std::optional<std::vector<std::string>>(std::move(names));
}

// `transports` split into whether the ring is used and TensorPipe's own list (unset:
// its defaults; empty: no TensorPipe at all).
struct Split {
  bool ring = kRingByDefault;
  std::optional<std::vector<std::string>> tensorpipe;
};
Split split(const std::optional<std::vector<std::string>>& transports) {
  Split out;
  if (!transports) return out;
  out.ring = std::find(transports->begin(), transports->end(), kRing) != transports->end();
  out.tensorpipe.emplace();
  for (const std::string& t : *transports) {
    if (t != kRing) out.tensorpipe->push_back(t);
  }
  return out;
}

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
  if (transports && transports->empty()) {
    return absl::InvalidArgumentError("transports is empty (expected some of ring, shm, ibv, uv)");
  }
  Split parts = split(transports);
  if (parts.tensorpipe && parts.tensorpipe->empty()) parts.tensorpipe.reset();  // only the ring: nothing to check
  absl::Status checked = internal::check_tensorpipe_options({parts.tensorpipe, channels, {}, {}, {}});
  if (!checked.ok() && transports) {
    return absl::InvalidArgumentError(absl::StrCat(checked.message(), "; \"ring\" is also accepted"));
  }
  return checked;
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
  FERRY_ASSIGN_OR_RETURN(options.transports, chosen_transports(options.transports));
  FERRY_RETURN_IF_ERROR(options.validate());
  const Split parts = split(options.transports);
  internal::TensorPipeTransportOptions transport_options{parts.tensorpipe, options.channels, {}, {},
                                                         options.store_host};
  // The ring serves the peers on this host, which shm would otherwise; shm's reactor
  // polls for as long as it lives, so by default it goes when the ring is there.
  if (parts.ring || shm_crowds_host(options.local_workers)) transport_options.not_by_default.push_back("shm");
  AgentOptions agent_options;
  agent_options.auth_token = internal::auth::job_token(options.auth_token);
  transport_options.auth_token = agent_options.auth_token;
  std::vector<std::unique_ptr<Transport>> transports;
  if (parts.ring) transports.push_back(make_ring_transport(name));
  if (!parts.tensorpipe || !parts.tensorpipe->empty()) {
    FERRY_ASSIGN_OR_RETURN(std::unique_ptr<internal::TensorPipeTransport> tensorpipe,
                           internal::TensorPipeTransport::create(name, transport_options));
    transports.push_back(std::move(tensorpipe));
  }
  std::unique_ptr<Transport> transport = transports.size() == 1
                                             ? std::move(transports.front())
                                             : std::make_unique<TransportSet>(std::move(transports));
  agent_options.num_worker_threads = options.num_worker_threads;
  agent_options.rpc_timeout = options.rpc_timeout;
  agent_options.heartbeat = options.heartbeat_interval;
  agent_options.device_maps = std::move(options.device_maps);
  agent_options.reverse_device_maps = std::move(options.reverse_device_maps);
  agent_options.devices = std::move(options.devices);
  agent_options.store_prefix = options.store_prefix;
  agent_options.serves_inline = std::move(options.serves_inline);
  agent_options.max_requests_in_flight = options.max_requests_in_flight;
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
  std::vector<std::string> out;
  if (find_transport<internal::RingTransport>(agent.transport()) != nullptr) out.push_back(kRing);
  if (const internal::TensorPipeTransport* tp = tensorpipe_of(agent)) {
    out.insert(out.end(), tp->transports().begin(), tp->transports().end());
  }
  return out;
}
std::vector<std::string> TensorPipeAgent::channels(const Agent& agent) {
  const internal::TensorPipeTransport* tp = tensorpipe_of(agent);
  return tp ? tp->channels() : std::vector<std::string>();
}

}  // namespace ferry
