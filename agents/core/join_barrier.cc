#include "agents/core/join_barrier.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

using Clock = std::chrono::steady_clock;

// When the first worker to arrive first probes the workers that have not.
constexpr std::chrono::milliseconds kFirstProbe{300};

std::chrono::milliseconds left_until(Clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()),
                  std::chrono::milliseconds(1));
}

}  // namespace

JoinBarrier::JoinBarrier(WorkerInfo self, Store& store, const Membership& members, std::string prefix,
                         std::chrono::milliseconds heartbeat)
    : self_(std::move(self)), store_(store), members_(members), prefix_(std::move(prefix)), heartbeat_(heartbeat) {}

std::optional<absl::Status> JoinBarrier::lost_status(int id) const {
  if (!any_lost_.load(std::memory_order_acquire)) return std::nullopt;
  Locked lock(mu_);
  auto it = lost_.find(id);
  if (it == lost_.end()) return std::nullopt;
  return it->second;
}

bool JoinBarrier::record_loss(int peer, absl::Status why) {
  Locked lock(mu_);
  any_lost_.store(true, std::memory_order_release);
  return lost_.emplace(peer, std::move(why)).second;
}

void JoinBarrier::retire(int id, absl::Status why) {
  Locked lock(mu_);
  lost_[id] = std::move(why);
  any_lost_.store(true, std::memory_order_release);
}

void JoinBarrier::forget(int id) {
  Locked lock(mu_);
  lost_.erase(id);
}

JoinBarrier::Verdict JoinBarrier::decide(const WorkerInfo& lost) {
  Locked lock(mu_);
  // Decided under the lock end_wait() holds when it turns departing_ on: judged before,
  // a peer that left just as this worker's round ended would be reported lost.
  Verdict verdict;
  if (!waiting_.load()) {
    verdict.tell = departing_.load() ? MembershipChange::kLeft : MembershipChange::kLost;
    return verdict;
  }
  // Waiting in a round: the loss is accounted in the store, and whether it left or was
  // lost shows once everyone is accounted for.
  deferred_.push_back(lost);
  if (!round_prefix_.empty()) {
    verdict.account = [this, prefix = round_prefix_, n = round_size_, id = lost.id] {
      return account(prefix, id, /*arrived=*/false, n).status();
    };
  }
  return verdict;
}

absl::StatusOr<int64_t> JoinBarrier::account(const std::string& prefix, int id, bool arrived, int n) {
  // A unique claim value, so a claimer knows whether it won (compare_set returns what
  // the key holds afterwards).
  const Bytes mine = to_bytes(arrived ? std::string("arrived") : absl::StrCat("lost:", self_.id));
  FERRY_ASSIGN_OR_RETURN(Bytes holds, store_.compare_set(absl::StrCat(prefix, "fate/", id), {}, mine));
  if (holds != mine) return 0;  // accounted for already
  // "arrived" counts before "accounted", so it is final once "done" is set.
  int64_t order = 0;
  if (arrived) {
    FERRY_ASSIGN_OR_RETURN(order, store_.add(prefix + "arrived", 1));
  }
  FERRY_ASSIGN_OR_RETURN(int64_t accounted, store_.add(prefix + "accounted", 1));
  if (accounted == n) FERRY_RETURN_IF_ERROR(store_.set(prefix + "done", to_bytes("1")));
  return order;
}

JoinBarrier::Round JoinBarrier::begin(int size) {
  waiting_.store(true);
  return Round{absl::StrCat(prefix_, "join/", generation_.fetch_add(1), "/"), size};
}

absl::Status JoinBarrier::wait(const Round& round, Clock::time_point deadline, const std::function<void(int)>& probe) {
  const std::string& prefix = round.prefix;
  const int n = round.size;
  FERRY_ASSIGN_OR_RETURN(int64_t order, account(prefix, self_.id, /*arrived=*/true, n));
  // Losses seen before now are accounted here; later ones through decide().
  std::vector<int> lost;
  {
    Locked lock(mu_);
    round_prefix_ = prefix;
    round_size_ = n;
    for (const auto& [id, why] : lost_) lost.push_back(id);
  }
  for (int id : lost) FERRY_RETURN_IF_ERROR(account(prefix, id, /*arrived=*/false, n).status());
  // A large group does not check every key from every worker: the first to arrive
  // probes soon, the others later (in case that one is gone).
  const std::chrono::milliseconds every = std::max(heartbeat_, kFirstProbe);
  const std::chrono::milliseconds period = order == 1 ? every : 2 * every;
  Clock::time_point next_probe = Clock::now() + (order == 1 ? kFirstProbe : period);
  for (;;) {
    std::chrono::milliseconds slice = std::max(
        std::chrono::milliseconds(1),
        std::chrono::duration_cast<std::chrono::milliseconds>(std::min(next_probe, deadline) - Clock::now()));
    absl::Status all = store_.wait({prefix + "done"}, slice);
    if (all.ok()) return absl::OkStatus();
    if (all.code() != absl::StatusCode::kDeadlineExceeded || Clock::now() >= deadline) {
      return absl::Status(all.code(), absl::StrCat(self_.name, ": waiting for every worker to join: ", all.message()));
    }
    if (Clock::now() < next_probe) continue;
    std::shared_ptr<const Membership::Table> table = members_.snapshot();
    for (const auto& [id, member] : table->by_id) {
      if (id == self_.id) continue;
      absl::StatusOr<bool> accounted = store_.check({absl::StrCat(prefix, "fate/", id)});
      if (!accounted.ok() || *accounted) continue;
      probe(id);
    }
    next_probe = Clock::now() + period;
  }
}

std::vector<std::pair<WorkerInfo, MembershipChange>> JoinBarrier::end_wait(const Round& round,
                                                                          const absl::Status& waited) {
  std::vector<WorkerInfo> deferred;
  {
    Locked lock(mu_);
    waiting_.store(false);
    round_prefix_.clear();
    // Everyone arrived or was lost: whoever goes now leaves.
    if (waited.ok()) departing_.store(true);
    deferred.swap(deferred_);
  }
  std::vector<std::pair<WorkerInfo, MembershipChange>> told;
  for (WorkerInfo& w : deferred) {
    absl::StatusOr<Bytes> fate =
        store_.get(absl::StrCat(round.prefix, "fate/", w.id), std::chrono::milliseconds(0));
    bool left = waited.ok() && fate.ok() && to_string(*fate) == "arrived";
    told.emplace_back(std::move(w), left ? MembershipChange::kLeft : MembershipChange::kLost);
  }
  return told;
}

absl::StatusOr<int64_t> JoinBarrier::arrived(const Round& round) { return store_.add(round.prefix + "arrived", 0); }

absl::Status JoinBarrier::leave(const Round& round, int64_t arrived, Clock::time_point deadline) {
  const std::string& prefix = round.prefix;
  const int n = round.size;
  // Worker 0 usually hosts the store: it leaves last, so nobody loses the store while
  // still reading "done".
  FERRY_ASSIGN_OR_RETURN(int64_t gone, store_.add(prefix + "left", 1));
  if (gone == arrived) FERRY_RETURN_IF_ERROR(store_.set(prefix + "all_left", to_bytes("1")));
  if (self_.id == 0) {
    absl::Status left = store_.wait({prefix + "all_left"}, left_until(deadline));
    if (!left.ok()) {
      return absl::Status(left.code(), absl::StrCat(self_.name, ": waiting for every worker to finish joining: ",
                                                    left.message()));
    }
  }
  if (arrived == n) return absl::OkStatus();
  // Some worker was lost: say which, wherever it was seen.
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  std::vector<WorkerInfo> members;
  for (const auto& [id, m] : table->by_id) members.push_back(m.info);
  std::sort(members.begin(), members.end(), [](const WorkerInfo& a, const WorkerInfo& b) { return a.id < b.id; });
  std::vector<std::string> keys;
  for (const WorkerInfo& w : members) keys.push_back(absl::StrCat(prefix, "fate/", w.id));
  FERRY_ASSIGN_OR_RETURN(std::vector<Bytes> fates, store_.multi_get(keys, left_until(deadline)));
  std::vector<std::string> names;
  for (size_t i = 0; i < members.size(); ++i) {
    if (to_string(fates[i]) == "arrived") continue;
    std::string why;
    if (std::optional<absl::Status> lost = lost_status(members[i].id)) why = absl::StrCat(": ", lost->message());
    names.push_back(absl::StrCat("\"", members[i].name, "\" (id ", members[i].id, ")", why));
  }
  return absl::UnavailableError(absl::StrCat(self_.name, ": joined the rest of the group, but ", n - arrived,
                                             " worker(s) were lost: ", absl::StrJoin(names, "; ")));
}

}  // namespace ferry::internal
