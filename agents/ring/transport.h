// File: agents/ring/transport.h (not installed)
//
// RingTransport: connections between workers on one host through shared memory. See
// agents/ring/factory.h for what it offers and docs/performance.md ("ring") for how it
// behaves.
//
// A worker listens on an abstract Unix socket (private to its network namespace). A
// connection is a memfd the connecting side creates, sealed against resizing, holding
// one single-producer single-consumer byte ring per direction (agents/ring/ring.h); it
// and each side's bell travel over the socket with SCM_RIGHTS. The socket then carries
// nothing but its end, which says at once that the peer closed or died.
//
// Two threads per worker: the data thread moves bytes out of the rings, delivers every
// event and sleeps on the worker's bell when idle, after a spin that adapts to how soon
// work came the last times; the control thread accepts sockets, exchanges the memfds
// and watches for ends. A thread of the worker that polls while it waits (a caller for
// its reply, an idle pool thread: base/progress.h) does the data thread's work itself
// meanwhile, and the data thread sleeps: events are then delivered on that thread,
// under a TransportThreadScope, one thread at a time as always.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "agents/core/transport.h"
#include "agents/ring/options.h"

namespace ferry::internal {

namespace ring {
struct Endpoint;
}  // namespace ring

// Thread-safe, as Transport requires. Owns its endpoint (agents/ring/endpoint.h) and
// joins the endpoint's threads in close() (the destructor calls it).
class RingTransport final : public Transport {
 public:
  RingTransport(std::string name, RingOptions options);
  ~RingTransport() override;

  absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) override;
  std::shared_ptr<Connection> connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                      const std::string& address) override;
  bool reaches(const std::string& address) const override;
  void close() override;
  std::map<std::string, std::string> debug_info() const override;

 private:
  std::shared_ptr<ring::Endpoint> endpoint_;
};

}  // namespace ferry::internal
