#include "agents/core/membership.h"

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

const char* went(MembershipChange why) {
  switch (why) {
    case MembershipChange::kLeft: return "left the group";
    case MembershipChange::kLost: return "was lost (its connection failed)";
    case MembershipChange::kJoined: break;
  }
  return "is gone";
}

}  // namespace

const Member* Membership::Table::find(std::string_view name) const {
  auto it = ids_by_name.find(av(name));
  return it == ids_by_name.end() ? nullptr : find(it->second);
}

bool Membership::Table::has_departed(int id) const {
  for (const auto& [name, gone] : departed) {
    if (gone.first == id) return true;
  }
  return false;
}

absl::Status Membership::Table::absent(int id) const {
  for (const auto& [name, gone] : departed) {
    if (gone.first == id) {
      return absl::UnavailableError(absl::StrCat("worker \"", name, "\" (id ", id, ") ", went(gone.second)));
    }
  }
  return absl::NotFoundError(absl::StrCat("no worker with id ", id, " (group of ", by_id.size(), ")"));
}

absl::Status Membership::Table::absent(std::string_view name) const {
  auto it = departed.find(av(name));
  if (it != departed.end()) {
    return absl::UnavailableError(
        absl::StrCat("worker \"", av(name), "\" (id ", it->second.first, ") ", went(it->second.second)));
  }
  return absl::NotFoundError(absl::StrCat("unknown worker \"", av(name), "\""));
}

Membership::Membership() : table_(std::make_shared<const Table>()) {}

absl::Status Membership::add(std::vector<Member> members) {
  absl::MutexLock lock(&write_mu_);
  std::shared_ptr<const Table> now = snapshot();
  auto next = std::make_shared<Table>(*now);
  for (Member& m : members) {
    if (const Member* same = next->find(m.info.name)) {
      return absl::AlreadyExistsError(absl::StrCat("worker name \"", m.info.name, "\" is already used by id ",
                                                   same->info.id, "; names must be unique"));
    }
    if (const Member* same = next->find(m.info.id)) {
      return absl::AlreadyExistsError(absl::StrCat("worker id ", m.info.id, " (\"", m.info.name,
                                                   "\") is already used by worker \"", same->info.name, "\""));
    }
    next->departed.erase(m.info.name);
    next->ids_by_name.emplace(m.info.name, m.info.id);
    int id = m.info.id;
    next->by_id.emplace(id, std::move(m));
  }
  next->version = now->version + 1;
  const uint64_t version = next->version;
  table_.store(std::move(next));
  version_.store(version, std::memory_order_release);
  return absl::OkStatus();
}

absl::StatusOr<Member> Membership::remove(int id, MembershipChange why) {
  absl::MutexLock lock(&write_mu_);
  std::shared_ptr<const Table> now = snapshot();
  const Member* m = now->find(id);
  if (m == nullptr) return now->absent(id);
  Member removed = *m;
  auto next = std::make_shared<Table>(*now);
  next->by_id.erase(id);
  next->ids_by_name.erase(removed.info.name);
  next->departed[removed.info.name] = {id, why};
  next->version = now->version + 1;
  const uint64_t version = next->version;
  table_.store(std::move(next));
  version_.store(version, std::memory_order_release);
  return removed;
}

}  // namespace ferry::internal
