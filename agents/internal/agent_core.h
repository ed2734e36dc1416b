// File: agents/internal/agent_core.h
//
// AgentCore: the RpcAgent that every backend shares; a backend only adds a Transport
// (agents/internal/transport.h). It owns:
//   - the call table: ids, deadlines, a lost peer's calls failed at once;
//   - serving: requests decoded on the transport thread, run on the worker pool,
//     replies routed back the way they came; pings answered without user code;
//   - the membership: a versioned table that can grow and shrink while calls run;
//   - device staging: CUDA tensors through the device maps (requests) and the reverse
//     maps (replies), see cuda_staging.h;
//   - shutdown: join() on store counters and waits, teardown safe from any thread.
//
// Threads: transport events arrive on transport threads and never block; user code
// (request handlers, future callbacks, membership listeners) runs on the pool.
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "agents/internal/activity.h"
#include "agents/internal/call_table.h"
#include "agents/internal/cuda_staging.h"
#include "agents/internal/membership.h"
#include "agents/internal/thread_pool.h"
#include "agents/internal/transport.h"
#include "agents/rpc_agent.h"
#include "base/shared_slot.h"
#include "device_maps/device_map.h"
#include "store/store.h"

namespace ferry::internal {

struct AgentCoreOptions {
  // Threads running incoming requests, continuations and listeners; at least 1.
  int num_worker_threads = 16;
  // Default per-call timeout; zero means none.
  std::chrono::milliseconds rpc_timeout{std::chrono::seconds(60)};
  // Where this worker's CUDA tensors land on each peer, and the maps replies travel
  // back on.
  DeviceMaps device_maps;
  DeviceMaps reverse_device_maps;
  // The CUDA devices this agent handles; empty: those its maps name (the local side of
  // device_maps and of reverse_device_maps).
  std::vector<Device> devices;
  // A peer with calls pending that sends nothing for this long is pinged; one that does
  // not answer the ping within it too is lost (its calls fail with kUnavailable, even
  // those with no timeout). Zero: off.
  std::chrono::milliseconds heartbeat{std::chrono::seconds(5)};
  // Store keys of this agent's join() rounds start with this.
  std::string store_prefix = "ferry/rpc/";
  // Requests served on the transport thread that received them (see InlineFilter);
  // unset: every request goes to the pool.
  InlineFilter serves_inline;
};


// Thread-safe. Owned by shared_ptr; its own threads hold only weak references, and
// shutdown() joins them all, so whoever calls shutdown() holds the last strong one
// that matters.
class AgentCore final : public RpcAgent, public TransportEvents, public std::enable_shared_from_this<AgentCore> {
 public:
  // Starts the pool and the timer, then the transport (listening). Members come later
  // (set_members / add_member). Errors: options out of range; the transport's.
  static absl::StatusOr<std::shared_ptr<AgentCore>> start(WorkerInfo self, std::shared_ptr<Store> store,
                                                          AgentCoreOptions options, RequestHandler handler,
                                                          std::unique_ptr<Transport> transport);
  ~AgentCore() override;

  // The record peers reach this worker by (Transport::listen's).
  const std::string& address() const { return address_; }
  Transport& transport() { return *transport_; }

  // A static group: the whole table at once, and the number of workers join() waits
  // for. No pipe opens until the first call. Listeners are not told.
  absl::Status set_members(std::vector<Member> members);
  // A worker joined: listeners are told.
  absl::Status add_member(Member member);
  // Worker `id` left (kLeft) or was lost (kLost): its pending calls fail at once saying
  // so, its pipe closes, later calls to it fail at once, listeners are told.
  absl::Status remove_member(int id, MembershipChange why);
  // Dynamic groups: a lost peer is removed from the membership (static: kept, marked).
  void set_dynamic(bool dynamic) { dynamic_.store(dynamic); }
  // Dynamic groups: device maps and devices change as workers join.
  void set_device_maps(DeviceMaps device_maps, DeviceMaps reverse_device_maps, std::vector<Device> devices);
  uint64_t membership_version() const { return members_.snapshot()->version; }
  // A member that is leaving: new calls to it fail at once saying it left, the calls
  // already in flight to it may finish (at most `drain`), then it is removed as
  // remove_member(id, kLeft) does. kNotFound if not a member.
  absl::Status retire_member(int id, std::chrono::milliseconds drain);

  // Serves kControl requests (the group-membership protocol of a backend), on the
  // pool like requests. Without one, a kControl request gets an error reply.
  void set_control_handler(RequestHandler handler);
  // Replaces join() (a dynamic group leaves instead of waiting for everyone).
  void set_join(std::function<absl::Status(std::chrono::milliseconds)> join);

  // RpcAgent.
  Future<Message> send(int to, Message message, std::optional<std::chrono::milliseconds> timeout) override;
  const WorkerInfo& self() const override { return self_; }
  absl::StatusOr<WorkerInfo> worker_info(std::string_view name) const override;
  absl::StatusOr<WorkerInfo> worker_info(int id) const override;
  std::vector<WorkerInfo> worker_infos() const override;
  std::chrono::milliseconds default_timeout() const override { return options_.rpc_timeout; }
  absl::Status join(std::chrono::milliseconds timeout) override;
  absl::Status sync(std::chrono::milliseconds timeout) override;
  void shutdown() override;
  void add_membership_listener(MembershipListener listener) override;
  std::map<std::string, std::string> debug_info() const override;

  // TransportEvents.
  void on_request(std::shared_ptr<ReplyPath> from, absl::StatusOr<Wire> wire) override;
  void on_reply(int peer, Wire wire) override;
  void on_peer_lost(int peer, absl::Status why) override;

 private:
  AgentCore(WorkerInfo self, std::shared_ptr<Store> store, AgentCoreOptions options, RequestHandler handler,
            std::unique_ptr<Transport> transport);
  void serve(const std::shared_ptr<ReplyPath>& from, std::vector<std::string> targets, Message request);
  void forget_lost(int id);
  void suspect(int peer);
  void complete_reply(int peer, std::vector<std::string> targets, Message reply);
  void notify(WorkerInfo worker, MembershipChange change);
  void deliver_changes();
  std::shared_ptr<const DeviceMaps> device_maps() const { return device_maps_.load(); }
  std::shared_ptr<const DeviceMaps> reverse_device_maps() const { return reverse_device_maps_.load(); }

  const WorkerInfo self_;
  const std::shared_ptr<Store> store_;
  const AgentCoreOptions options_;
  const RequestHandler handler_;
  std::unique_ptr<Transport> transport_;
  std::string address_;

  const std::shared_ptr<Activity> activity_ = std::make_shared<Activity>();
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<CallTable> calls_;
  Membership members_;
  std::unique_ptr<CudaStaging> staging_;
  SharedSlot<const DeviceMaps> device_maps_;
  SharedSlot<const DeviceMaps> reverse_device_maps_;
  std::atomic<bool> dynamic_{false};
  std::atomic<int> group_size_{0};
  // Lost members of a static group, kept in the table: id -> why.
  mutable std::mutex lost_mu_;
  absl::flat_hash_map<int, absl::Status> lost_;  // guarded by lost_mu_
  std::atomic<bool> any_lost_{false};
  std::mutex pinging_mu_;
  absl::flat_hash_set<int> pinging_;  // guarded by pinging_mu_: peers with a heartbeat ping out

  std::mutex hooks_mu_;
  std::shared_ptr<const RequestHandler> control_handler_;                               // guarded by hooks_mu_
  std::shared_ptr<const std::function<absl::Status(std::chrono::milliseconds)>> join_;  // guarded by hooks_mu_

  std::mutex listeners_mu_;  // held while listeners run: one change at a time
  std::vector<MembershipListener> listeners_;
  // Changes wait here so that listeners hear them in the order they happened,
  // though the pool has many threads: one pool task at a time delivers them.
  std::mutex changes_mu_;
  std::deque<std::pair<WorkerInfo, MembershipChange>> changes_;  // guarded by changes_mu_
  bool delivering_ = false;                                       // guarded by changes_mu_

  std::atomic<uint64_t> requests_served_{0};
  std::atomic<bool> shut_down_{false};
  std::atomic<int> join_generation_{0};
};

}  // namespace ferry::internal
