#include "agents/process_group/factory.h"

#include "absl/strings/str_cat.h"
#include "base/auth.h"
#include "agents/process_group/transport.h"
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

absl::StatusOr<std::shared_ptr<Agent>> ProcessGroupAgent::start(std::shared_ptr<ProcessGroup> group,
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
  AgentOptions core_options;
  core_options.auth_token = internal::auth::job_token(options.auth_token);
  core_options.num_worker_threads = options.num_send_recv_threads;
  core_options.rpc_timeout = options.rpc_timeout;
  core_options.heartbeat = options.heartbeat_interval;
  core_options.device_maps = std::move(options.device_maps);
  core_options.reverse_device_maps = std::move(options.reverse_device_maps);
  core_options.store_prefix = kKeyPrefix;
  core_options.serves_inline = std::move(options.serves_inline);
  core_options.max_requests_in_flight = options.max_requests_in_flight;
  return Agent::start(WorkerInfo{std::move(name), rank}, std::move(store), std::move(core_options),
                      std::move(handler), std::move(transport));
}

absl::StatusOr<std::shared_ptr<Agent>> ProcessGroupAgent::create(std::shared_ptr<ProcessGroup> group,
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
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> agent,
                         start(std::move(group), std::move(store), name, std::move(options), std::move(handler)));
  std::vector<internal::Member> members;
  for (size_t r = 0; r < names.size(); ++r) {
    members.push_back(internal::Member{WorkerInfo{names[r], static_cast<int>(r)},
                                       internal::process_group_address(static_cast<int>(r))});
  }
  FERRY_RETURN_IF_ERROR(agent->set_members(std::move(members)));
  return agent;
}

ProcessGroup* ProcessGroupAgent::process_group(Agent& agent) {
  auto* transport = dynamic_cast<internal::ProcessGroupTransport*>(&agent.transport());
  return transport ? &transport->group() : nullptr;
}

}  // namespace ferry
