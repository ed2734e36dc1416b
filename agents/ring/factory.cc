#include "agents/ring/factory.h"

#include "agents/core/static_members.h"
#include "agents/ring/record.h"
#include "agents/ring/transport.h"
#include "base/status.h"

namespace ferry {

std::unique_ptr<Transport> make_ring_transport(std::string name, RingOptions options) {
  return std::make_unique<internal::RingTransport>(std::move(name), options);
}

bool ring_reaches(const std::string& record) {
  // As RingTransport::reaches judges: the record's format is read in record.h only.
  internal::ring::RingRecord r;
  return internal::ring::parse_record(record, r) && r.scope == internal::ring::host_scope();
}

TransportEntry ring_transport_entry() {
  TransportEntry entry;
  entry.names = {"ring"};
  entry.rank = 100;
  entry.by_default = true;
  entry.same_host_names = {"ring"};
  entry.reaches = &ring_reaches;
  entry.make = [](const TransportArgs& args) -> absl::StatusOr<std::unique_ptr<Transport>> {
    return make_ring_transport(args.worker_name);
  };
  return entry;
}

absl::StatusOr<std::shared_ptr<Agent>> RingAgent::start(std::shared_ptr<Store> store, std::string name, int rank,
                                                        RingAgentOptions options, RequestHandler handler) {
  FERRY_RETURN_IF_ERROR(validate(options.ring));
  std::unique_ptr<Transport> transport = make_ring_transport(name, options.ring);
  return Agent::start(WorkerInfo{std::move(name), rank}, std::move(store), std::move(options.agent),
                      std::move(handler), std::move(transport));
}

absl::StatusOr<std::shared_ptr<Agent>> RingAgent::create(std::shared_ptr<Store> store, std::string name, int rank,
                                                         int world_size, RingAgentOptions options,
                                                         RequestHandler handler) {
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  const std::string prefix = options.agent.store_prefix;
  const std::chrono::milliseconds timeout = options.init_timeout;
  return join_static_group(start(store, std::move(name), rank, std::move(options), std::move(handler)), *store,
                           world_size, prefix, timeout);
}

}  // namespace ferry
