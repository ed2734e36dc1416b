// File: agents/tensorpipe/transport.h (not installed)
//
// The TensorPipe adapter (see agents/tensorpipe/factory.h for the transports and
// channels it offers and their priorities): a Connection is one TensorPipe pipe. Pipes
// this worker opens carry its requests out and the replies back; pipes peers open
// carry their requests in and our replies out. Every pipe keeps one read armed. A
// TensorPipe listener that fails an accept accepts nothing more; the transport replaces
// it with one on the same addresses, so what listen() returned stays valid
// (docs/hardening.md, "TensorPipe listeners").
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/core/transport.h"
#include "agents/tensorpipe/choices.h"

namespace ferry::internal {

class TensorPipeTransport final : public Transport {
 public:
  // Creates the TensorPipe context for worker `name` with the transports and channels
  // that are viable here (see build_context for the errors).
  static absl::StatusOr<std::unique_ptr<TensorPipeTransport>> create(const std::string& name,
                                                                      const TensorPipeTransportOptions& options);
  ~TensorPipeTransport() override;

  absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) override;
  std::shared_ptr<Connection> connect(std::shared_ptr<Session> session, const std::string& peer_name,
                                      const std::string& address) override;
  // Whether `address` lists a transport this worker registered.
  bool reaches(const std::string& address) const override;
  void close() override;
  std::map<std::string, std::string> debug_info() const override;

  // After listen(): the URL per transport ("uv" -> "uv://127.0.0.1:41234"); the same for
  // the transport's life, across replaced listeners.
  std::map<std::string, std::string> addresses() const;
  // The transports and channels registered, in priority order.
  const std::vector<std::string>& transports() const;
  const std::vector<std::string>& channels() const;

  struct State;

 private:
  explicit TensorPipeTransport(std::shared_ptr<State> state);
  std::shared_ptr<State> state_;
};

}  // namespace ferry::internal
