#include "agents/core/static_members.h"

#include "absl/strings/str_cat.h"
#include "agents/core/records.h"
#include "base/status.h"
#include "cereal/types/string.hpp"

namespace ferry {
namespace {

struct Published {
  std::string name;
  std::string address;
  template <class Archive>
  void serialize(Archive& ar) {
    ar(name, address);
  }
};

}  // namespace

absl::Status exchange_addresses(Agent& agent, Store& store, int world_size, const std::string& prefix,
                                std::chrono::milliseconds timeout) {
  const WorkerInfo& self = agent.self();
  FERRY_RETURN_IF_ERROR(store.set(absl::StrCat(prefix, "worker/", self.id),
                                  internal::encode_record(Published{self.name, agent.address()})));
  std::vector<std::string> keys;
  for (int r = 0; r < world_size; ++r) keys.push_back(absl::StrCat(prefix, "worker/", r));
  absl::StatusOr<std::vector<Bytes>> values = store.multi_get(keys, timeout);
  if (!values.ok()) {
    return absl::Status(values.status().code(),
                        absl::StrCat("waiting for every worker to publish its address: ", values.status().message()));
  }
  std::vector<PeerAddress> members;
  for (int r = 0; r < world_size; ++r) {
    FERRY_ASSIGN_OR_RETURN(Published p, internal::decode_record<Published>((*values)[static_cast<size_t>(r)],
                                                                           "worker address record"));
    for (const PeerAddress& m : members) {
      if (m.info.name == p.name) {
        return absl::InvalidArgumentError(absl::StrCat("worker name \"", p.name, "\" is used by both rank ",
                                                       m.info.id, " and rank ", r, "; names must be unique"));
      }
    }
    members.push_back(PeerAddress{WorkerInfo{p.name, r}, std::move(p.address)});
  }
  return agent.set_members(std::move(members));
}

absl::StatusOr<std::shared_ptr<Agent>> join_static_group(absl::StatusOr<std::shared_ptr<Agent>> started,
                                                         Store& store, int world_size, const std::string& prefix,
                                                         std::chrono::milliseconds timeout) {
  FERRY_ASSIGN_OR_RETURN(std::shared_ptr<Agent> agent, std::move(started));
  absl::Status joined = exchange_addresses(*agent, store, world_size, prefix, timeout);
  if (!joined.ok()) {
    agent->shutdown();
    return joined;
  }
  return agent;
}

}  // namespace ferry
