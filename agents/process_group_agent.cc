#include "agents/process_group_agent.h"

#include "absl/strings/str_cat.h"
#include "agents/internal/agent_core.h"
#include "agents/internal/process_group_transport.h"
#include "base/status.h"
#include "cereal/types/string.hpp"

namespace ferry {
namespace {

constexpr char kKeyPrefix[] = "ferry/rpc/pg/";

}  // namespace

absl::Status ProcessGroupAgentOptions::validate() const {
  if (num_send_recv_threads < 1 || num_send_recv_threads > kMaxSendRecvThreads) {
    return absl::InvalidArgumentError(absl::StrCat("num_send_recv_threads must be in [1, ", kMaxSendRecvThreads,
                                                   "], got ", num_send_recv_threads));
  }
  if (rpc_timeout.count() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("rpc_timeout must not be negative, got ", rpc_timeout.count(), " ms (zero means no timeout)"));
  }
  if (heartbeat_interval.count() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("heartbeat_interval must be >= 0 ms (0: off), got ",
                                                   heartbeat_interval.count(), " ms"));
  }
  return absl::OkStatus();
}

ProcessGroupAgent::ProcessGroupAgent(std::shared_ptr<internal::AgentCore> core,
                                     internal::ProcessGroupTransport* transport)
    : core_(std::move(core)), transport_(transport) {}

ProcessGroupAgent::~ProcessGroupAgent() {
  // On one of the agent's own threads this refuses; the core then finishes the
  // teardown on a thread of its own when its last reference goes.
  if (!internal::on_agent_thread()) core_->shutdown();
}

absl::StatusOr<std::shared_ptr<ProcessGroupAgent>> ProcessGroupAgent::start(std::shared_ptr<ProcessGroup> group,
                                                                          std::shared_ptr<Store> store,
                                                                          std::string name,
                                                                          ProcessGroupAgentOptions options,
                                                                          RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (group == nullptr) return absl::InvalidArgumentError("the process group is null");
  FERRY_RETURN_IF_ERROR(options.validate());
  const int rank = group->rank();
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<internal::ProcessGroupTransport> transport,
                         internal::ProcessGroupTransport::create(name, std::move(group),
                                                                 options.num_send_recv_threads));
  internal::ProcessGroupTransport* raw = transport.get();
  internal::AgentCoreOptions core_options;
  core_options.num_worker_threads = options.num_send_recv_threads;
  core_options.rpc_timeout = options.rpc_timeout;
  core_options.heartbeat = options.heartbeat_interval;
  core_options.device_maps = std::move(options.device_maps);
  core_options.reverse_device_maps = std::move(options.reverse_device_maps);
  core_options.store_prefix = kKeyPrefix;
  core_options.serves_inline = std::move(options.serves_inline);
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<internal::AgentCore> core,
                         internal::AgentCore::start(WorkerInfo{std::move(name), rank}, std::move(store),
                                                    std::move(core_options), std::move(handler),
                                                    std::move(transport)));
  return std::shared_ptr<ProcessGroupAgent>(new ProcessGroupAgent(std::move(core), raw));
}

absl::StatusOr<std::shared_ptr<ProcessGroupAgent>> ProcessGroupAgent::create(std::shared_ptr<ProcessGroup> group,
                                                                           std::shared_ptr<Store> store,
                                                                           std::string name,
                                                                           ProcessGroupAgentOptions options,
                                                                           RequestHandler handler) {
  if (group == nullptr) return absl::InvalidArgumentError("the process group is null");
  if (!group->is_member()) return absl::InvalidArgumentError("this process is not a member of the process group");
  if (store == nullptr) return absl::InvalidArgumentError("store is null");
  if (!handler) return absl::InvalidArgumentError("request handler is empty");
  // Every rank's name, through the group itself; a rank whose options are bad still
  // takes part, so that every rank fails instead of waiting for it.
  ProcessGroup& pg = *group;
  FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names, pg.all_gather_object(name));
  for (size_t r = 0; r < names.size(); ++r) {
    for (size_t q = 0; q < r; ++q) {
      if (names[q] == names[r]) {
        return absl::InvalidArgumentError(absl::StrCat("worker name \"", names[r], "\" is used by both rank ", q,
                                                       " and rank ", r, "; names must be unique"));
      }
    }
  }
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ProcessGroupAgent> agent,
                         start(std::move(group), std::move(store), name, std::move(options), std::move(handler)));
  std::vector<internal::Member> members;
  for (size_t r = 0; r < names.size(); ++r) {
    members.push_back(internal::Member{WorkerInfo{names[r], static_cast<int>(r)},
                                       internal::process_group_address(static_cast<int>(r))});
  }
  FERRY_RETURN_IF_ERROR(agent->core_->set_members(std::move(members)));
  return agent;
}

const std::string& ProcessGroupAgent::address() const { return core_->address(); }
absl::Status ProcessGroupAgent::add_member(WorkerInfo info, std::string address) {
  return core_->add_member(internal::Member{std::move(info), std::move(address)});
}
absl::Status ProcessGroupAgent::remove_member(int id, MembershipChange why) { return core_->remove_member(id, why); }
ProcessGroup& ProcessGroupAgent::process_group() { return transport_->group(); }

Future<Message> ProcessGroupAgent::send(int to, Message message, std::optional<std::chrono::milliseconds> timeout) {
  return core_->send(to, std::move(message), timeout);
}
const WorkerInfo& ProcessGroupAgent::self() const { return core_->self(); }
absl::StatusOr<WorkerInfo> ProcessGroupAgent::worker_info(std::string_view name) const {
  return core_->worker_info(name);
}
absl::StatusOr<WorkerInfo> ProcessGroupAgent::worker_info(int id) const { return core_->worker_info(id); }
std::vector<WorkerInfo> ProcessGroupAgent::worker_infos() const { return core_->worker_infos(); }
std::chrono::milliseconds ProcessGroupAgent::default_timeout() const { return core_->default_timeout(); }
absl::Status ProcessGroupAgent::join(std::chrono::milliseconds timeout) { return core_->join(timeout); }
absl::Status ProcessGroupAgent::sync(std::chrono::milliseconds timeout) { return core_->sync(timeout); }
void ProcessGroupAgent::shutdown() { core_->shutdown(); }
void ProcessGroupAgent::add_membership_listener(MembershipListener listener) {
  core_->add_membership_listener(std::move(listener));
}
std::map<std::string, std::string> ProcessGroupAgent::debug_info() const { return core_->debug_info(); }

}  // namespace ferry
