#include "agents/process_group/factory.h"

#include "absl/strings/str_cat.h"
#include "agents/process_group/transport.h"
#include "base/status.h"
#include "cereal/types/string.hpp"

namespace ferry {
namespace {

constexpr char kKeyPrefix[] = "ferry/rpc/pg/";

}  // namespace

AgentOptions process_group_agent_defaults() {
  AgentOptions agent;
  agent.num_worker_threads = 4;
  agent.store_prefix = kKeyPrefix;
  return agent;
}

absl::StatusOr<std::shared_ptr<Agent>> ProcessGroupAgent::start(std::shared_ptr<ProcessGroup> group,
                                                                          std::shared_ptr<Store> store,
                                                                          std::string name,
                                                                          ProcessGroupAgentOptions options,
                                                                          RequestHandler handler) {
  if (name.empty()) return absl::InvalidArgumentError("worker name is empty");
  if (group == nullptr) return absl::InvalidArgumentError("the process group is null");
  const int rank = group->rank();
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<internal::ProcessGroupTransport> transport,
                         internal::ProcessGroupTransport::create(name, std::move(group),
                                                                 options.agent.num_worker_threads));
  return Agent::start(WorkerInfo{std::move(name), rank}, std::move(store), std::move(options.agent),
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
