#include "agents/core/join_barrier.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace ferry::internal {
namespace {

using Clock = std::chrono::steady_clock;

// When the first worker to arrive first probes the workers that have not.
constexpr std::chrono::milliseconds kFirstProbe{300};
// How often a waiting worker wakes to account the losses it saw meanwhile.
constexpr std::chrono::milliseconds kAccountEvery{1000};

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

std::optional<MembershipChange> JoinBarrier::decide(const WorkerInfo& lost) {
  Locked lock(mu_);
  // Decided under the lock end_wait() holds when it turns departing_ on: judged before,
  // a peer that left just as this worker's round ended would be reported lost.
  if (!waiting_.load()) return departing_.load() ? MembershipChange::kLeft : MembershipChange::kLost;
  deferred_.push_back(lost);
  unaccounted_.push_back(lost.id);
  return std::nullopt;
}

absl::StatusOr<int64_t> JoinBarrier::account(const std::string& prefix, int id, bool arrived, int n) {
  // A unique claim value, so a claimer knows whether it won (compare_set returns what
  // the key holds afterwards).
  const Bytes mine = to_bytes(arrived ? std::string("arrived") : absl::StrCat("lost:", self_.id));
  FERRY_ASSIGN_OR_RETURN(Bytes holds, store_.compare_set(absl::StrCat(prefix, "fate/", id), {}, mine));
  if (holds != mine) {
    if (!arrived) return 0;  // accounted for already
    // Another worker recorded this one lost before it arrived (a false loss, or a
    // hostile token holder): it was counted as lost, so counting it again as arrived,
    // or as leaving, would end the round or its leaving one worker early.
    return absl::UnavailableError(absl::StrCat(self_.name, ": arrived at join round ", prefix,
                                               " after another worker had recorded it as lost (", to_string(holds),
                                               "); it leaves without the rest of the group"));
  }
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
    for (const auto& [id, why] : lost_) lost.push_back(id);
    unaccounted_.clear();
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
    slice = std::min(slice, kAccountEvery);
    absl::Status all = store_.wait({prefix + "done"}, slice);
    if (all.ok()) return absl::OkStatus();
    if (all.code() != absl::StatusCode::kDeadlineExceeded || Clock::now() >= deadline) {
      return absl::Status(all.code(), absl::StrCat(self_.name, ": waiting for every worker to join: ", all.message()));
    }
    {
      Locked lock(mu_);
      lost = std::exchange(unaccounted_, {});
    }
    for (int id : lost) FERRY_RETURN_IF_ERROR(account(prefix, id, /*arrived=*/false, n).status());
    if (Clock::now() < next_probe) continue;
    std::shared_ptr<const Membership::Table> table = members_.snapshot();
    int settled = 1;  // this worker's own fate
    for (const auto& [id, member] : table->by_id) {
      if (id == self_.id) continue;
      absl::StatusOr<bool> accounted = store_.check({absl::StrCat(prefix, "fate/", id)});
      if (!accounted.ok()) continue;
      if (*accounted) {
        ++settled;
        continue;
      }
      probe(id);
    }
    // A worker that died between claiming a fate and counting it leaves "accounted"
    // short for good: the fates themselves say the round is over.
    if (settled >= n) FERRY_RETURN_IF_ERROR(store_.set(prefix + "done", to_bytes("1")));
    next_probe = Clock::now() + period;
  }
}

std::vector<std::pair<WorkerInfo, MembershipChange>> JoinBarrier::end_wait(const Round& round,
                                                                          const absl::Status& waited) {
  std::vector<WorkerInfo> deferred;
  {
    Locked lock(mu_);
    waiting_.store(false);
    // Everyone arrived or was lost: whoever goes now leaves.
    if (waited.ok()) departing_.store(true);
    deferred.swap(deferred_);
  }
  std::vector<std::pair<WorkerInfo, MembershipChange>> told;
  if (deferred.empty()) return told;
  // Once the round is done every worker's fate is set: one read for all of them.
  std::vector<Bytes> fates;
  if (waited.ok()) {
    std::vector<std::string> keys;
    for (const WorkerInfo& w : deferred) keys.push_back(absl::StrCat(round.prefix, "fate/", w.id));
    absl::StatusOr<std::vector<Bytes>> read = store_.multi_get(keys, std::chrono::milliseconds(0));
    if (read.ok()) fates = *std::move(read);
  }
  for (size_t i = 0; i < deferred.size(); ++i) {
    const bool left = i < fates.size() && to_string(fates[i]) == "arrived";
    told.emplace_back(std::move(deferred[i]), left ? MembershipChange::kLeft : MembershipChange::kLost);
  }
  return told;
}

absl::StatusOr<int64_t> JoinBarrier::arrived(const Round& round) { return store_.add(round.prefix + "arrived", 0); }

absl::Status JoinBarrier::leave(const Round& round, int64_t arrived, Clock::time_point deadline) {
  const std::string& prefix = round.prefix;
  const int n = round.size;
  // Worker 0 usually hosts the store: it leaves last, so nobody loses the store while
  // still reading "done".
  // Whatever a worker reads from the store it reads before it counts itself gone: the
  // last count lets worker 0 go, and with it the store.
  absl::Status lost = arrived == n ? absl::OkStatus() : lost_in(round, arrived, deadline);
  FERRY_ASSIGN_OR_RETURN(int64_t gone, store_.add(prefix + "left", 1));
  if (gone == arrived) FERRY_RETURN_IF_ERROR(store_.set(prefix + "all_left", to_bytes("1")));
  if (self_.id == 0) {
    absl::Status left = store_.wait({prefix + "all_left"}, left_until(deadline));
    if (!left.ok()) {
      return absl::Status(left.code(), absl::StrCat(self_.name, ": waiting for every worker to finish joining: ",
                                                    left.message()));
    }
  }
  return lost;
}

absl::Status JoinBarrier::lost_in(const Round& round, int64_t& arrived, Clock::time_point deadline) {
  const std::string& prefix = round.prefix;
  const int n = round.size;
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
  // The fates are what is true: a worker slow between its claim and its count (the
  // round's probe may end the round on the fates alone) is no loss, and it will leave.
  if (names.empty() && members.size() == static_cast<size_t>(n)) {
    arrived = n;
    return absl::OkStatus();
  }
  return absl::UnavailableError(absl::StrCat(self_.name, ": joined the rest of the group, but ", n - arrived,
                                             " worker(s) were lost: ", absl::StrJoin(names, "; ")));
}

}  // namespace ferry::internal
