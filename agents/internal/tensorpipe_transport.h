// File: agents/internal/tensorpipe_transport.h
//
// The TensorPipe adapter under TensorPipeAgent (see agents/tensorpipe_agent.h for the
// transports and channels it offers and their priorities). Pipes to peers open on the
// first request and then stay open; requests go out on them and replies come back on
// them. Pipes peers open to us carry their requests and our replies.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "agents/internal/transport.h"

namespace ferry::internal {

struct TensorPipeTransportOptions {
  // Subsets of {"shm", "ibv", "uv"} and {"xth", "cma", "mpt_uv", "basic"}; unset: every
  // viable one (mpt_uv only when listed).
  std::optional<std::vector<std::string>> transports;
  std::optional<std::vector<std::string>> channels;
  // Left out of the defaults when `transports` is unset.
  std::vector<std::string> not_by_default;
  // The job token ("" for none; see docs/security.md). With one, every pipe starts
  // with a challenge-response before any request: the opener says who it is (name,
  // id) and both sides prove they know the token, bound to both names and the id.
  std::string auth_token;
  // This worker's id, which the hello of the pipes it opens carries.
  int self_id = -1;
  // The store's host, for the listen-address resolver (base/net.h); empty: unknown.
  std::string store_host;
};

// Decides whether a pipe whose opener proved the token and claims to be worker `id`
// named `name` is that worker: OK, or the reason it is not (the pipe is refused).
// Called on a transport thread; must not block.
using MemberCheck = std::function<absl::Status(int id, const std::string& name)>;

// The names TensorPipeTransportOptions accepts, in priority order.
const std::vector<std::string>& tensorpipe_transport_names();
const std::vector<std::string>& tensorpipe_channel_names();

// Checks the lists without creating anything: an unknown name is kInvalidArgument,
// naming it and the known ones; an empty list too.
absl::Status check_tensorpipe_options(const TensorPipeTransportOptions& options);

class TensorPipeTransport final : public Transport {
 public:
  // Creates the TensorPipe context for worker `name` with the transports and channels
  // that are viable here. Errors: bad options; a transport or channel asked for by
  // name that is not usable on this machine; none usable at all.
  static absl::StatusOr<std::unique_ptr<TensorPipeTransport>> create(const std::string& name,
                                                                      const TensorPipeTransportOptions& options);
  ~TensorPipeTransport() override;

  absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) override;
  void send(int peer, const std::string& peer_name, const std::string& address, Wire wire) override;
  void disconnect(int peer) override;
  void close() override;
  std::map<std::string, std::string> debug_info() const override;

  // With a job token: how claims on incoming pipes are checked against the
  // membership (beyond the token, which any member holds). A second pipe claiming an
  // id that has a live authenticated pipe is refused regardless. Set once, before
  // peers know our address.
  void set_member_check(MemberCheck check);

  // After listen(): the URL per transport ("uv" -> "uv://127.0.0.1:41234").
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
