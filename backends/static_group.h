// File: backends/static_group.h (not installed)
//
// A static group's init, written once for every backend whose workers know the world
// size: each worker's device info gathered, names checked, device maps validated (the
// same records give every worker the same verdict), this worker's agent started, and a
// second gather (each agent's address, or why it did not start) that is also the
// barrier. A failure on any rank ends every rank's init with the same error, naming the
// rank at fault (backends/init_failures.h).
//
// A backend supplies its part as a StaticGroup:
//
//   class MyGroup final : public internal::StaticGroup {
//     absl::StatusOr<std::shared_ptr<Agent>> start_agent(const StaticInit& init,
//                                                        const DeviceSetup& setup,
//                                                        int local_workers) override;
//   };
//   MyGroup group(...);
//   return internal::init_static_group(args, worker, timeout, group);
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "agents/core/agent.h"
#include "backends/backend_registry.h"
#include "device_maps/validate.h"
#include "store/store.h"

namespace ferry::internal {

// What this worker brings to the group.
struct StaticWorker {
  DeviceMaps device_maps;
  std::vector<Device> devices;
  // Why this worker's options are unusable, if they are: it travels in the first
  // gather, so that every worker fails together, naming this one.
  absl::Status valid;
};

// One init's scope, the same for every step.
struct StaticInit {
  std::string prefix;  // "ferry/rpc/init/<n>/": this init's keys in the store
  // The init's store; its waits end soon after another rank publishes a failure.
  std::shared_ptr<Store> store;
  std::chrono::milliseconds timeout{0};  // for each wait of the init
};

// A backend's part of the init. Its methods run on the init thread, in the order
// declared, each at most once per gather; an error fails every rank's init.
class StaticGroup {
 public:
  virtual ~StaticGroup() = default;

  // Sets up what the gathers need (the process group connects its mesh here).
  virtual absl::Status prepare(const StaticInit& init);

  // Every rank's `mine`, in rank order. `step` names the gather ("info", "address").
  // By default through the store, under init.prefix + step.
  virtual absl::StatusOr<std::vector<Bytes>> all_gather(const StaticInit& init, int rank, int world_size,
                                                        const std::string& step, const Bytes& mine);

  // Starts this worker's agent. `setup` is the group's verdict on devices (reverse
  // maps, the devices this worker handles); `local_workers` counts the workers on this
  // host, this one included.
  virtual absl::StatusOr<std::shared_ptr<Agent>> start_agent(const StaticInit& init, const DeviceSetup& setup,
                                                             int local_workers) = 0;

  // Every worker's agent started: `members` holds each one's name, rank and address.
  // By default nothing (an agent that knows its members already).
  virtual absl::Status connect(Agent& agent, std::vector<PeerAddress> members);
};

// Runs the init for `args` (world_size > 0) with `group`'s steps. Each rank numbers its
// inits on the store, so the n-th init of every rank meets the others' n-th. Errors:
// the same on every rank, "init_rpc failed on rank R (worker \"NAME\"): why" (with that
// rank's code), or a verdict every rank reaches itself (a name used by two ranks,
// device maps that do not fit), or kDeadlineExceeded naming the ranks that never came.
absl::StatusOr<std::shared_ptr<RpcAgent>> init_static_group(const BackendInitArgs& args, const StaticWorker& worker,
                                                            std::chrono::milliseconds timeout, StaticGroup& group);

}  // namespace ferry::internal
