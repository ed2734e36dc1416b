// File: agents/tcp/transport.h (not installed)
//
// TcpTransport: connections between workers over TCP sockets, on any hosts. See
// agents/tcp/factory.h for what it offers and docs/performance.md ("tcp") for how it
// behaves.
//
// A worker listens on the address the interface resolver picks (base/net.h) and
// publishes "tcp tcp://<host>:<port>". A connection is one socket, opened by the
// caller; its first bytes are the opener's hello, its own listening address, so that
// the acceptor's calls to the opener can ride the same socket back
// (Connection::carries_calls_to). Then frames go both ways (agents/tcp/protocol.h).
//
// One thread per worker, the endpoint's loop (agents/tcp/endpoint.h), accepts, reads
// and delivers events, unless a waiting ferry thread reads them itself (base/progress.h);
// writers send on their own thread while the socket takes it, and leave the rest to
// whichever thread reads.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "agents/core/transport.h"
#include "agents/tcp/options.h"

namespace ferry::internal {

namespace tcp {
struct Endpoint;
}  // namespace tcp

// Thread-safe, as Transport requires. Owns its endpoint and joins its thread in
// close() (the destructor calls it).
class TcpTransport final : public Transport {
 public:
  TcpTransport(std::string name, TcpOptions options);
  ~TcpTransport() override;

  absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) override;
  std::shared_ptr<Connection> connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                      const std::string& address) override;
  bool reaches(const std::string& address) const override;
  void close() override;
  std::map<std::string, std::string> debug_info() const override;

 private:
  TcpOptions options_;
  std::shared_ptr<tcp::Endpoint> endpoint_;
};

}  // namespace ferry::internal
