#include "agents/tensorpipe_agent.h"

#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "agents/internal/agent_core.h"
#include "agents/internal/tensorpipe_transport.h"
#include "base/auth.h"
#include "base/status.h"
#include "serialization/types.h"

namespace ferry {
namespace {

// What create() publishes in the store.
struct Published {
  std::string name;
  std::string address;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, address);
  }
};

Bytes encode(const Published& p) {
  Message m(MessageType::kResponse, 0);
  {
    PayloadWriter w(m);
    w(p);
  }
  std::string s = m.seal();
  return Bytes(s.begin(), s.end());
}

absl::StatusOr<Published> decode(const Bytes& bytes) {
  FERRY_ASSIGN_OR_RETURN(Message m, Message::parse(std::string(bytes.begin(), bytes.end()), {}));
  FERRY_ASSIGN_OR_RETURN(auto values, read_payload<Published>(m, "worker address record"));
  return std::get<0>(std::move(values));
}

std::vector<internal::Member> to_members(const std::vector<PeerAddress>& peers) {
  std::vector<internal::Member> out;
  out.reserve(peers.size());
  for (const PeerAddress& p : peers) out.push_back(internal::Member{p.info, p.address});
  return out;
}

}  // namespace

absl::Status TensorPipeAgentSettings::validate() const {
  if (num_worker_threads < 1 || num_worker_threads > kMaxWorkerThreads) {
    return absl::InvalidArgumentError(absl::StrCat("num_worker_threads must be in [1, ", kMaxWorkerThreads,
                                                   "], got ", num_worker_threads));
  }
  if (heartbeat_interval.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat_interval must be >= 0 ms (0: off), got ",
                                                   heartbeat_interval.count(), " ms"));
  }
  return internal::check_tensorpipe_options({transports, channels, {}, {}, -1, {}});
}

bool shm_crowds_host(int local_workers) {
  int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return local_workers > cores;
}

TensorPipeAgent::TensorPipeAgent(std::shared_ptr<internal::AgentCore> core, internal::TensorPipeTransport* transport)
    : core_(std::move(core)), transport_(transport) {}

TensorPipeAgent::~TensorPipeAgent() {
  // On one of the agent's own threads this refuses; the core then finishes the
  // teardown on a thread of its own when its last reference goes.
  if (!internal::on_agent_thread()) core_->shutdown();
}

absl::StatusOr<std::shared_ptr<TensorPipeAgent>> TensorPipeAgent::start(std::shared_ptr<Store> store,
                                                                        std::string name, int rank,
                                                                        TensorPipeAgentOptions options,
                                                                        RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (rank < 0) return absl::InvalidArgumentError(absl::StrCat("rank must be >= 0, got ", rank));
  FERRY_RETURN_IF_ERROR(options.validate());
  internal::TensorPipeTransportOptions transport_options{options.transports, options.channels, {}, {}, -1,
                                                         options.store_host};
  if (shm_crowds_host(options.local_workers)) transport_options.not_by_default.push_back("shm");
  transport_options.auth_token = internal::auth::job_token(options.auth_token);
  transport_options.self_id = rank;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<internal::TensorPipeTransport> transport,
                         internal::TensorPipeTransport::create(name, transport_options));
  internal::TensorPipeTransport* raw = transport.get();
  internal::AgentCoreOptions core_options;
  core_options.num_worker_threads = options.num_worker_threads;
  core_options.rpc_timeout = options.rpc_timeout;
  core_options.heartbeat = options.heartbeat_interval;
  core_options.device_maps = std::move(options.device_maps);
  core_options.reverse_device_maps = std::move(options.reverse_device_maps);
  core_options.devices = std::move(options.devices);
  core_options.store_prefix = options.store_prefix;
  core_options.serves_inline = std::move(options.serves_inline);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<internal::AgentCore> core,
                         internal::AgentCore::start(WorkerInfo{std::move(name), rank}, std::move(store),
                                                    std::move(core_options), std::move(handler),
                                                    std::move(transport)));
  // A pipe's claim (a member's id and name) is checked against the membership: a
  // name or id the table gives someone else is refused. One not in the table yet (a
  // peer faster than our set_members) passes on the token alone.
  raw->set_member_check([weak = std::weak_ptr<internal::AgentCore>(core)](int id, const std::string& claimed) {
    std::shared_ptr<internal::AgentCore> core = weak.lock();
    if (!core) return absl::UnavailableError("the agent is shutting down");
    absl::StatusOr<WorkerInfo> by_id = core->worker_info(id);
    if (by_id.ok() && by_id->name != claimed) {
      return absl::PermissionDeniedError(
          absl::StrCat("the membership names worker id ", id, " \"", by_id->name, "\", not \"", claimed, "\""));
    }
    absl::StatusOr<WorkerInfo> by_name = core->worker_info(claimed);
    if (by_name.ok() && by_name->id != id) {
      return absl::PermissionDeniedError(
          absl::StrCat("the membership gives worker \"", claimed, "\" id ", by_name->id, ", not ", id));
    }
    return absl::OkStatus();
  });
  return std::shared_ptr<TensorPipeAgent>(new TensorPipeAgent(std::move(core), raw));
}

absl::StatusOr<std::shared_ptr<TensorPipeAgent>> TensorPipeAgent::create(std::shared_ptr<Store> store,
                                                                         std::string name, int rank, int world_size,
                                                                         TensorPipeAgentOptions options,
                                                                         RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (world_size < 1) return absl::InvalidArgumentError(absl::StrCat("world_size must be >= 1, got ", world_size));
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(absl::StrCat("rank ", rank, " out of range [0, ", world_size, ")"));
  }
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  if (!handler) return absl::InvalidArgumentError("request handler is empty");
  std::chrono::milliseconds init_timeout = options.init_timeout;
  const std::string prefix = options.store_prefix;
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<TensorPipeAgent> agent,
                         start(store, name, rank, std::move(options), std::move(handler)));
  FERRY_RETURN_IF_ERROR(store->set(absl::StrCat(prefix, "worker/", rank), encode({name, agent->address()})));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(absl::StrCat(prefix, "worker/", r));
  absl::StatusOr<std::vector<Bytes>> values = store->multi_get(keys, init_timeout);
  if (!values.ok()) {
    return absl::Status(values.status().code(),
                        absl::StrCat("waiting for every worker to publish its address: ", values.status().message()));
  }
  std::vector<PeerAddress> members;
  for (int r = 0; r < world_size; ++r) {
    FERRY_ASSIGN_OR_RETURN(Published p, decode((*values)[static_cast<size_t>(r)]));
    for (const PeerAddress& m : members) {
      if (m.info.name == p.name) {
        return absl::InvalidArgumentError(absl::StrCat("worker name \"", p.name, "\" is used by both rank ",
                                                       m.info.id, " and rank ", r, "; names must be unique"));
      }
    }
    members.push_back(PeerAddress{WorkerInfo{p.name, r}, std::move(p.address)});
  }
  FERRY_RETURN_IF_ERROR(agent->set_members(members));
  return agent;
}

const std::string& TensorPipeAgent::address() const { return core_->address(); }
absl::Status TensorPipeAgent::set_members(const std::vector<PeerAddress>& members) {
  return core_->set_members(to_members(members));
}
absl::Status TensorPipeAgent::add_member(const PeerAddress& member) {
  return core_->add_member(internal::Member{member.info, member.address});
}
absl::Status TensorPipeAgent::remove_member(int id, MembershipChange why) { return core_->remove_member(id, why); }

Future<Message> TensorPipeAgent::send(int to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  return core_->send(to, std::move(message), timeout);
}
const WorkerInfo& TensorPipeAgent::self() const { return core_->self(); }
absl::StatusOr<WorkerInfo> TensorPipeAgent::worker_info(std::string_view name) const {
  return core_->worker_info(name);
}
absl::StatusOr<WorkerInfo> TensorPipeAgent::worker_info(int id) const { return core_->worker_info(id); }
std::vector<WorkerInfo> TensorPipeAgent::worker_infos() const { return core_->worker_infos(); }
std::chrono::milliseconds TensorPipeAgent::default_timeout() const { return core_->default_timeout(); }
absl::Status TensorPipeAgent::join(std::chrono::milliseconds timeout) { return core_->join(timeout); }
absl::Status TensorPipeAgent::sync(std::chrono::milliseconds timeout) { return core_->sync(timeout); }
void TensorPipeAgent::shutdown() { core_->shutdown(); }
void TensorPipeAgent::add_membership_listener(MembershipListener listener) {
  core_->add_membership_listener(std::move(listener));
}
std::map<std::string, std::string> TensorPipeAgent::debug_info() const { return core_->debug_info(); }

absl::Status TensorPipeAgent::ping_all(std::chrono::milliseconds timeout) {
  std::vector<Future<Message>> replies;
  for (const WorkerInfo& w : worker_infos()) replies.push_back(send(w.id, Message(MessageType::kPing, 0), timeout));
  for (const Future<Message>& reply : replies) FERRY_RETURN_IF_ERROR(reply.status());
  return absl::OkStatus();
}

std::map<std::string, std::string> TensorPipeAgent::addresses() const { return transport_->addresses(); }
std::vector<std::string> TensorPipeAgent::transports() const { return transport_->transports(); }
std::vector<std::string> TensorPipeAgent::channels() const { return transport_->channels(); }

}  // namespace ferry
