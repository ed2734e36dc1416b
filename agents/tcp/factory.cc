#include "agents/tcp/factory.h"

#include "agents/core/static_members.h"
#include "agents/tcp/address.h"
#include "agents/tcp/transport.h"
#include "base/status.h"

namespace ferry {

std::unique_ptr<Transport> make_tcp_transport(std::string name, TcpOptions options) {
  return std::make_unique<internal::TcpTransport>(std::move(name), std::move(options));
}

bool tcp_reaches(const std::string& record) {
  internal::tcp::HostPort where;
  return internal::tcp::parse_record(record, where);
}

TransportEntry tcp_transport_entry() {
  TransportEntry entry;
  entry.names = {"tcp"};
  entry.rank = 150;
  entry.by_default = true;
  entry.other_host_names = {"tcp"};
  entry.reaches = &tcp_reaches;
  entry.make = [](const TransportArgs& args) -> absl::StatusOr<std::unique_ptr<Transport>> {
    TcpOptions options;
    options.store_host = args.store_host;
    // Keepalive outlasts the core's heartbeat, which notices a lost peer first; it is
    // for the idle connection a middlebox forgets.
    if (args.heartbeat.count() > 0) options.keepalive = 2 * args.heartbeat;
    return make_tcp_transport(args.worker_name, std::move(options));
  };
  return entry;
}

absl::StatusOr<std::shared_ptr<Agent>> TcpAgent::start(std::shared_ptr<Store> store, std::string name, int rank,
                                                       TcpAgentOptions options, RequestHandler handler) {
  FERRY_RETURN_IF_ERROR(validate(options.tcp));
  if (options.tcp.keepalive.count() == 0) options.tcp.keepalive = 2 * options.agent.heartbeat;
  std::unique_ptr<Transport> transport = make_tcp_transport(name, options.tcp);
  return Agent::start(WorkerInfo{std::move(name), rank}, std::move(store), std::move(options.agent),
                      std::move(handler), std::move(transport));
}

absl::StatusOr<std::shared_ptr<Agent>> TcpAgent::create(std::shared_ptr<Store> store, std::string name, int rank,
                                                        int world_size, TcpAgentOptions options,
                                                        RequestHandler handler) {
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  const std::string prefix = options.agent.store_prefix;
  const std::chrono::milliseconds timeout = options.init_timeout;
  return join_static_group(start(store, std::move(name), rank, std::move(options), std::move(handler)), *store,
                           world_size, prefix, timeout);
}

}  // namespace ferry
