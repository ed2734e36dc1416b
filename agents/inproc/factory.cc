#include "agents/inproc/factory.h"

#include "agents/core/static_members.h"
#include "agents/inproc/transport.h"
#include "base/status.h"

namespace ferry {

std::unique_ptr<Transport> make_inproc_transport(std::string name) {
  return std::make_unique<internal::InprocTransport>(std::move(name));
}

absl::StatusOr<std::shared_ptr<Agent>> InprocAgent::start(std::shared_ptr<Store> store, std::string name, int rank,
                                                          InprocAgentOptions options, RequestHandler handler) {
  std::unique_ptr<Transport> transport = make_inproc_transport(name);
  return Agent::start(WorkerInfo{std::move(name), rank}, std::move(store), std::move(options.agent),
                      std::move(handler), std::move(transport));
}

absl::StatusOr<std::shared_ptr<Agent>> InprocAgent::create(std::shared_ptr<Store> store, std::string name, int rank,
                                                           int world_size, InprocAgentOptions options,
                                                           RequestHandler handler) {
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  const std::string prefix = options.agent.store_prefix;
  const std::chrono::milliseconds timeout = options.init_timeout;
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> agent,
                         start(store, std::move(name), rank, std::move(options), std::move(handler)));
  absl::Status joined = exchange_addresses(*agent, *store, world_size, prefix, timeout);
  if (!joined.ok()) {
    agent->shutdown();
    return joined;
  }
  return agent;
}

}  // namespace ferry
