// File: agents/inproc/transport.h (not installed)
//
// InprocTransport: connections between workers of one process. Workers find each other
// in a process-wide table of endpoints by their "inproc:<n>" address. A connection is
// a pair of Links, one per side; what one side writes is queued for the other side's
// delivery thread, which asks its core to admit the sizes, copies the tensors into
// fresh buffers and delivers the message. Closing either side ends both. A paused
// connection keeps what arrives aside until resumed.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "agents/core/transport.h"

namespace ferry::internal {

class InprocTransport final : public Transport {
 public:
  // `ignores_pauses`: its connections deliver past Connection::pause_reads(), as a
  // transport that cannot pause would (tests of the core's refusal at the cap).
  explicit InprocTransport(std::string name, bool ignores_pauses = false);
  ~InprocTransport() override;

  absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) override;
  std::shared_ptr<Connection> connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                      const std::string& address) override;
  void close() override;
  std::map<std::string, std::string> debug_info() const override;

  struct Endpoint;

 private:
  std::shared_ptr<Endpoint> endpoint_;
};

}  // namespace ferry::internal
