// File: agents/core/static_members.h
//
// A static group's membership through the store, for adapters whose workers find each
// other by address records: every worker publishes its agent's address, reads
// everyone's, and sets the whole table at once.
//
//   FERRY_RETURN_IF_ERROR(exchange_addresses(*agent, *store, world_size, "ferry/rpc/", seconds(60)));
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "store/store.h"

namespace ferry {

// Publishes the agent's address under `prefix` + "worker/<id>", waits for all
// `world_size` workers' records, and sets them as the agent's members (id = rank).
// Errors: kDeadlineExceeded (saying what it waited for) when not every worker published
// within `timeout`, a name used by two ranks (naming both), the store's errors.
absl::Status exchange_addresses(Agent& agent, Store& store, int world_size, const std::string& prefix,
                                std::chrono::milliseconds timeout);

// An adapter's create(): the agent `started` (its start()'s result), then
// exchange_addresses; the agent is shut down when that fails.
absl::StatusOr<std::shared_ptr<Agent>> join_static_group(absl::StatusOr<std::shared_ptr<Agent>> started,
                                                         Store& store, int world_size, const std::string& prefix,
                                                         std::chrono::milliseconds timeout);

}  // namespace ferry
