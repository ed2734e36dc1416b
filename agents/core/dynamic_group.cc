#include "agents/core/dynamic_group.h"

#include <algorithm>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "agents/core/membership_lock.h"
#include "agents/core/records.h"
#include "base/logging.h"
#include "base/status.h"
#include "cereal/types/string.hpp"
#include "cereal/types/vector.hpp"
#include "device_maps/validate.h"
#include "serialization/archive.h"
#include "serialization/error.h"
#include "serialization/types.h"
#include "store/tcp_store.h"

namespace ferry {

using internal::decode_record;
using internal::encode_record;

namespace {

constexpr char kMembersKey[] = "ferry/rpc/dynamic/members";
// How long a member lets its calls to a leaver finish before failing them.
constexpr std::chrono::seconds kDrain{30};

struct MemberRecord {
  std::string name;
  int32_t rank = 0;
  std::string address;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, rank, address);
  }
};

// What a member learns when the group changes.
struct Update {
  MemberRecord worker;
  bool join = true;
  DeviceMaps reverse_device_maps;  // the receiver's new reverse maps
  std::vector<Device> devices;     // the receiver's new device list
  template <class Archive>
  void serialize(Archive& ar) {
    ar(worker, join, reverse_device_maps, devices);
  }
};

absl::StatusOr<std::vector<MemberRecord>> decode_members(const Bytes& bytes) {
  if (bytes.empty()) return std::vector<MemberRecord>();
  return decode_record<std::vector<MemberRecord>>(bytes, "group member list");
}

constexpr char kLockKey[] = "ferry/rpc/dynamic/lock";

absl::StatusOr<std::unique_ptr<internal::MembershipLock>> lock_group(const std::shared_ptr<Store>& store,
                                                                     const std::string& name,
                                                                     std::chrono::milliseconds timeout) {
  return internal::MembershipLock::acquire(store, kLockKey, name, timeout);
}

// Publishes the member list, only if this worker still holds the lock and the list is
// still the one it read (`read`): a holder that stalled past its lease must not
// overwrite what the worker that took the lock over wrote.
absl::Status publish_members(Store& store, internal::MembershipLock& lock, const Bytes& read,
                             const Bytes& members) {
  FERRY_RETURN_IF_ERROR(lock.held());
  FERRY_ASSIGN_OR_RETURN(Bytes now, store.compare_set(kMembersKey, read, members));
  if (now != members) {
    return absl::AbortedError(
        "the group's member list changed while this worker held the group-membership lock (it stalled past its "
        "lease and another worker took the lock over); nothing was published");
  }
  return absl::OkStatus();
}

absl::StatusOr<Bytes> read_members_bytes(Store& store) {
  FERRY_ASSIGN_OR_RETURN(bool present, store.check({kMembersKey}));
  if (!present) return Bytes();
  return store.get(kMembersKey, std::chrono::seconds(10));
}

Message control(std::string_view op, const Bytes& body) {
  Message m(MessageType::kControl, 0);
  PayloadWriter w(m);
  w(std::string(op), body);
  return m;
}

Message reply_with(uint64_t id, const Bytes& body) {
  Message m(MessageType::kResponse, id);
  PayloadWriter w(m);
  w(body);
  return m;
}

absl::StatusOr<Bytes> reply_body(const absl::StatusOr<Message>& reply) {
  FERRY_RETURN_IF_ERROR(reply.status());
  FERRY_ASSIGN_OR_RETURN(auto values, read_payload<Bytes>(*reply, "control reply"));
  return std::get<0>(std::move(values));
}

// The state a member keeps for the protocol.
struct Group : std::enable_shared_from_this<Group> {
  std::weak_ptr<Agent> agent;
  std::shared_ptr<Store> store;
  std::string name;
  int rank = 0;
  WorkerDeviceInfo mine;
  bool hosts_store = false;

  Message serve(const Message& request);
  absl::Status leave(std::chrono::milliseconds timeout);
};

Message Group::serve(const Message& request) {
  auto error = [&](absl::Status status) { return make_error_message(request.id(), name, std::move(status)); };
  absl::StatusOr<std::tuple<std::string, Bytes>> parsed = read_payload<std::string, Bytes>(request, "control request");
  if (!parsed.ok()) return error(parsed.status());
  auto& [op, body] = *parsed;
  std::shared_ptr<Agent> owner = agent.lock();
  if (owner == nullptr) return error(absl::CancelledError(absl::StrCat(name, ": shutting down")));
  Agent& core = *owner;
  if (op == "device_info") return reply_with(request.id(), encode_record(mine));
  if (op == "update") {
    absl::StatusOr<Update> update = decode_record<Update>(body, "membership update");
    if (!update.ok()) return error(update.status());
    if (update->join) {
      absl::Status added = core.add_member(PeerAddress{WorkerInfo{update->worker.name, update->worker.rank},
                                                  update->worker.address});
      if (!added.ok() && added.code() != absl::StatusCode::kAlreadyExists) return error(added);
      core.set_device_maps(mine.device_maps, update->reverse_device_maps, update->devices);
    } else {
      absl::Status gone = core.retire_member(update->worker.rank, kDrain);
      // Already gone (it was lost, or told twice): nothing left to do.
      if (!gone.ok() && gone.code() != absl::StatusCode::kNotFound && gone.code() != absl::StatusCode::kUnavailable) {
        return error(gone);
      }
    }
    return reply_with(request.id(), {});
  }
  return error(absl::InvalidArgumentError(absl::StrCat(name, ": unknown control operation \"", op, "\"")));
}

absl::Status Group::leave(std::chrono::milliseconds timeout) {
  std::shared_ptr<Agent> owner = agent.lock();
  if (owner == nullptr) return absl::OkStatus();
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<internal::MembershipLock> lock, lock_group(store, name, timeout));
  FERRY_ASSIGN_OR_RETURN(const Bytes read, read_members_bytes(*store));
  FERRY_ASSIGN_OR_RETURN(std::vector<MemberRecord> members, decode_members(read));
  std::erase_if(members, [&](const MemberRecord& m) { return m.name == name; });
  if (hosts_store && !members.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "worker \"", name, "\" hosts the store of this dynamic group and ", members.size(),
        " other worker(s) still use it (first: \"", members.front().name,
        "\"); it can leave only last. Let the others shut down first, or host the store outside the group "
        "(ferry store serve, or any reachable tcp:// store). This worker keeps running."));
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // Every member at once: each stops calling me, lets its calls in flight to me finish
  // (I serve them meanwhile), forgets me, and answers. Until then a member's call may
  // still be on its way, so requests are taken as usual.
  owner->begin_leave();
  Update update;
  update.worker = MemberRecord{name, rank, owner->address()};
  update.join = false;
  const Bytes body = encode_record(update);
  std::vector<Future<Message>> told;
  told.reserve(members.size());
  for (const MemberRecord& m : members) told.push_back(owner->send(m.rank, control("update", body), timeout));
  for (size_t i = 0; i < members.size(); ++i) {
    if (absl::Status s = told[i].status(); !s.ok()) {
      FERRY_LOG(INFO) << name << ": leaving, could not tell " << members[i].name << ": " << s;
    }
  }
  // No member calls me any more: a stray request is refused, and what I serve and my
  // own calls finish.
  owner->refuse_requests();
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
  absl::Status drained = owner->sync(std::max(left, std::chrono::milliseconds(0)));
  FERRY_RETURN_IF_ERROR(publish_members(*store, *lock, read, encode_record(members)));
  return drained;
}

}  // namespace

absl::Status join_dynamic_group(const std::shared_ptr<Agent>& agent, std::shared_ptr<Store> store,
                                WorkerDeviceInfo mine, std::chrono::milliseconds timeout) {
  if (!agent->transport().connects_on_demand()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "init_rpc: worker \"", agent->self().name, "\": dynamic groups (no world size) need a transport that ",
        "connects to workers as they join, and this agent's cannot (a process group's mesh is fixed when it is ",
        "created); give a world size, or use TENSORPIPE"));
  }
  const WorkerInfo& self = agent->self();
  struct Args {
    std::shared_ptr<Store> store;
    std::string name;
    int rank;
  } args{std::move(store), self.name, self.id};
  const DeviceMaps device_maps = mine.device_maps;
  auto group = std::make_shared<Group>();
  group->agent = agent;
  group->store = args.store;
  group->name = args.name;
  group->rank = args.rank;
  group->mine = std::move(mine);
  if (auto* tcp = dynamic_cast<TCPStore*>(args.store.get())) group->hosts_store = tcp->server() != nullptr;
  Agent& core = *agent;
  core.set_dynamic(true);
  core.set_control_handler([group](const Message& request, const WorkerInfo&) { return group->serve(request); });

  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto left = [&] {
    return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()),
                    std::chrono::milliseconds(1));
  };
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<internal::MembershipLock> lock, lock_group(args.store, args.name, timeout));
  FERRY_ASSIGN_OR_RETURN(const Bytes read, read_members_bytes(*args.store));
  FERRY_ASSIGN_OR_RETURN(std::vector<MemberRecord> members, decode_members(read));
  for (const MemberRecord& m : members) {
    if (m.name == args.name) {
      return absl::AlreadyExistsError(absl::StrCat("init_rpc: worker name \"", args.name,
                                                   "\" is already used by a member of the group (rank ", m.rank, ")"));
    }
    if (m.rank == args.rank) {
      return absl::AlreadyExistsError(absl::StrCat("init_rpc: rank ", args.rank, " is already used by worker \"",
                                                   m.name, "\"; every member needs its own rank"));
    }
  }
  std::vector<PeerAddress> peers;
  for (const MemberRecord& m : members) peers.push_back(PeerAddress{WorkerInfo{m.name, m.rank}, m.address});
  peers.push_back(PeerAddress{WorkerInfo{args.name, args.rank}, agent->address()});
  FERRY_RETURN_IF_ERROR(agent->set_members(peers));

  // Under the lock, a member that does not answer in time holds up every join, so it
  // is taken for lost, as one that is unreachable is (issue 27, finding 6: a stopped
  // member answered kDeadlineExceeded and every later join failed). The members are
  // asked at once, and get half the time left, so that the updates have the rest.
  auto lost = [&](const MemberRecord& m, const absl::Status& why) {
    if (why.code() != absl::StatusCode::kUnavailable && why.code() != absl::StatusCode::kDeadlineExceeded) {
      return false;
    }
    FERRY_LOG(WARNING) << args.name << ": joining, member \"" << m.name << "\" is dropped from the group: " << why;
    (void)core.remove_member(m.rank, MembershipChange::kLost);
    return true;
  };
  // A member whose record vanished (its lease expired: it died) is dropped without
  // being asked, so that a dead host does not cost half the time left.
  std::vector<bool> dead(members.size(), false);
  if (args.store->has_leases() && !members.empty()) {
    std::vector<std::string> keys;
    for (const MemberRecord& m : members) keys.push_back(core.record_key(m.rank));
    FERRY_ASSIGN_OR_RETURN(std::vector<std::string> vanished,
                           args.store->wait_gone(keys, std::chrono::milliseconds(0), [] { return false; }));
    for (size_t i = 0; i < members.size(); ++i) {
      dead[i] = std::find(vanished.begin(), vanished.end(), keys[i]) != vanished.end();
    }
  }
  std::vector<Future<Message>> asked;
  asked.reserve(members.size());
  const std::chrono::milliseconds ask_within = left() / 2;
  for (size_t i = 0; i < members.size(); ++i) {
    asked.push_back(dead[i] ? make_ready_future<Message>(absl::UnavailableError(
                                  "its record in the store vanished (its store lease expired: it died)"))
                            : agent->send(members[i].rank, control("device_info", {}), ask_within));
  }
  std::vector<WorkerDeviceInfo> infos;
  std::vector<MemberRecord> alive;
  for (size_t i = 0; i < members.size(); ++i) {
    absl::StatusOr<Bytes> info = reply_body(asked[i].result());
    if (!info.ok() && lost(members[i], info.status())) continue;
    FERRY_RETURN_IF_ERROR(info.status());
    FERRY_ASSIGN_OR_RETURN(WorkerDeviceInfo decoded, decode_record<WorkerDeviceInfo>(*info, "device info"));
    infos.push_back(std::move(decoded));
    alive.push_back(members[i]);
  }
  infos.push_back(group->mine);

  // Validate the whole group as it will be; nothing has changed anywhere yet.
  FERRY_ASSIGN_OR_RETURN(DeviceSetup own, setup_devices(args.name, infos, /*is_static_group=*/false));
  std::vector<Future<Message>> told;
  told.reserve(alive.size());
  const std::chrono::milliseconds tell_within = left();
  for (size_t i = 0; i < alive.size(); ++i) {
    FERRY_ASSIGN_OR_RETURN(DeviceSetup setup, setup_devices(alive[i].name, infos, /*is_static_group=*/false));
    Update update;
    update.worker = MemberRecord{args.name, args.rank, agent->address()};
    update.join = true;
    update.reverse_device_maps = std::move(setup.reverse_device_maps);
    update.devices = std::move(setup.devices);
    told.push_back(agent->send(alive[i].rank, control("update", encode_record(update)), tell_within));
  }
  std::vector<MemberRecord> joined;
  for (size_t i = 0; i < alive.size(); ++i) {
    absl::Status s = reply_body(told[i].result()).status();
    if (!s.ok() && lost(alive[i], s)) continue;
    FERRY_RETURN_IF_ERROR(s);
    joined.push_back(alive[i]);
  }
  core.set_device_maps(device_maps, own.reverse_device_maps, own.devices);
  joined.push_back(MemberRecord{args.name, args.rank, agent->address()});
  FERRY_RETURN_IF_ERROR(publish_members(*args.store, *lock, read, encode_record(joined)));
  core.set_join([group](std::chrono::milliseconds t) { return group->leave(t); });
  return absl::OkStatus();
}

}  // namespace ferry
