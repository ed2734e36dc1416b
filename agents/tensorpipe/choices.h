// File: agents/tensorpipe/choices.h (not installed)
//
// Which TensorPipe transports and channels a worker registers, in which priority
// (documented in agents/tensorpipe/factory.h), where it listens, and the address
// record peers connect by: one "transport url" line per transport.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tensorpipe {
class Context;
}  // namespace tensorpipe

namespace ferry::internal {

struct TensorPipeTransportOptions {
  // Subsets of {"shm", "ibv", "uv"} and {"xth", "cma", "mpt_uv", "basic"}; unset: every
  // viable one (mpt_uv only when listed).
  std::optional<std::vector<std::string>> transports;
  std::optional<std::vector<std::string>> channels;
  // Left out of the defaults when `transports` is unset.
  std::vector<std::string> not_by_default;
  // The job token ("" for none), only to warn when a worker listens beyond loopback
  // without one; the handshake itself is the agent core's.
  std::string auth_token;
  // The store's host, for the listen-address resolver (base/net.h); empty: unknown.
  std::string store_host;
};

// The names TensorPipeTransportOptions accepts, in priority order.
const std::vector<std::string>& tensorpipe_transport_names();
const std::vector<std::string>& tensorpipe_channel_names();

// Checks the lists without creating anything: an unknown name is kInvalidArgument,
// naming it and the known ones; an empty list too.
absl::Status check_tensorpipe_options(const TensorPipeTransportOptions& options);

// A TensorPipe context with the transports and channels viable here registered.
struct BuiltContext {
  std::shared_ptr<tensorpipe::Context> context;
  std::vector<std::string> transport_names;  // registered, in priority order
  std::vector<std::string> channel_names;
  std::vector<std::string> listen_urls;  // one per transport
};
// Errors: bad options; a transport or channel asked for by name that is not usable on
// this machine; none usable at all.
absl::StatusOr<BuiltContext> build_context(const std::string& name, const TensorPipeTransportOptions& options);

std::string encode_address(const std::map<std::string, std::string>& urls);
std::map<std::string, std::string> decode_address(const std::string& record);

}  // namespace ferry::internal
