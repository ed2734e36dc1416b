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
  std::unique_ptr<Transport> transport = std::make_unique<internal::InprocTransport>(name, options.ignore_pauses);
  return Agent::start(WorkerInfo{std::move(name), rank}, std::move(store), std::move(options.agent),
                      std::move(handler), std::move(transport));
}

absl::StatusOr<std::shared_ptr<Agent>> InprocAgent::create(std::shared_ptr<Store> store, std::string name, int rank,
                                                           int world_size, InprocAgentOptions options,
                                                           RequestHandler handler) {
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  const std::string prefix = options.agent.store_prefix;
  const std::chrono::milliseconds timeout = options.init_timeout;
  return join_static_group(start(store, std::move(name), rank, std::move(options), std::move(handler)), *store,
                           world_size, prefix, timeout);
}

}  // namespace ferry
