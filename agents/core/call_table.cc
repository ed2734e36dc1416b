#include "agents/core/call_table.h"

#include <algorithm>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/core/observe.h"

namespace ferry::internal {

CallTable::CallTable(std::weak_ptr<Executor> executor, std::shared_ptr<Activity> activity)
    : executor_(std::move(executor)), activity_(std::move(activity)), timer_([this] { run_timer(); }) {}

CallTable::~CallTable() { stop(); }

CallTable::Started CallTable::start(int peer, std::string_view peer_name, std::chrono::milliseconds timeout,
                                   AgentStats::Call observed) {
  Pending pending{Promise<Message>(executor_), peer, Clock::time_point::max(), std::string(peer_name), observed};
  Future<Message> future = pending.promise.get_future();
  if (timeout.count() > 0) pending.deadline = Clock::now() + timeout;
  activity_->enter();
  uint64_t id;
  bool earliest = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    id = next_id_++;
    if (pending.deadline != Clock::time_point::max()) {
      trim_lane();
      if (lane_.empty()) lane_timeout_ = timeout;
      if (timeout == lane_timeout_) {
        // Two callers may read the clock in one order and get here in the other: the
        // later one's deadline moves the few nanoseconds that keep the lane in order.
        if (!lane_.empty()) pending.deadline = std::max(pending.deadline, lane_.back().first);
        lane_.emplace_back(pending.deadline, id);
        pending.in_lane = true;
      } else {
        deadlines_.emplace(pending.deadline, id);
      }
      earliest = pending.deadline < timer_until_;
    }
    if (heartbeat_.count() > 0 && !checks_.contains(peer)) {
      // Silence is measured from now, or from the last reply if that is later.
      auto heard = heard_.find(peer);
      Clock::time_point since = heard == heard_.end() ? Clock::now() : std::max(heard->second, Clock::now());
      const Clock::time_point at = since + heartbeat_;
      schedule_check(peer, at);
      earliest = earliest || at < timer_until_;
    }
    calls_.emplace(id, std::move(pending));
  }
  // Only a deadline before the timer's wake-up changes when it must wake.
  if (earliest) timer_cv_.notify_one();
  return Started{id, std::move(future)};
}

void CallTable::finish(Pending& pending, absl::StatusOr<Message> result) {
  // Statistics are recorded after the result is set: the caller need not wait for them.
  const AgentStats::Call observed = pending.observed;
  const absl::StatusCode code = result.status().code();
  const uint64_t bytes = observed.cell != nullptr && result.ok() ? wire_bytes(result->buffer().size(), result->tensors()) : 0;
  pending.promise.set_result(std::move(result));
  AgentStats::call_finished(observed, code, bytes);
  activity_->exit();
  if (peer_waiters_.load(std::memory_order_acquire) > 0) {
    std::lock_guard<std::mutex> lock(mu_);  // so a waiter between its check and its wait still hears it
    done_cv_.notify_all();
  }
}

bool CallTable::wait_peer_idle(int peer, std::chrono::milliseconds timeout) {
  auto idle = [&] {
    for (const auto& [id, p] : calls_) {
      if (p.peer == peer) return false;
    }
    return true;
  };
  std::unique_lock<std::mutex> lock(mu_);
  ++peer_waiters_;
  bool done = done_cv_.wait_for(lock, timeout, idle);
  --peer_waiters_;
  return done;
}

void CallTable::set_heartbeat(std::chrono::milliseconds interval, std::function<void(int peer)> suspect) {
  std::lock_guard<std::mutex> lock(mu_);
  heartbeat_ = interval;
  suspect_ = std::move(suspect);
}

void CallTable::trim_lane() {
  while (!lane_.empty() && !calls_.contains(lane_.front().second)) lane_.pop_front();
  // A call pending far longer than those after it holds the front: compact instead.
  if (lane_.size() > 2 * calls_.size() + 64) {
    std::erase_if(lane_,
                  [this](const std::pair<Clock::time_point, uint64_t>& e) { return !calls_.contains(e.second); });
  }
}

CallTable::Clock::time_point CallTable::next_due() {
  trim_lane();  // the front is then a pending call's deadline
  Clock::time_point next = Clock::time_point::max();
  if (!deadlines_.empty()) next = deadlines_.begin()->first;
  if (!lane_.empty()) next = std::min(next, lane_.front().first);
  if (!tasks_.empty()) next = std::min(next, tasks_.begin()->first);
  return next;
}

void CallTable::schedule_check(int peer, Clock::time_point at) {
  checks_[peer] = at;
  deadlines_.emplace(at, kHeartbeatBit | static_cast<uint64_t>(peer));
}

bool CallTable::complete(uint64_t id, absl::StatusOr<Message> result) { return settle(id, std::nullopt, std::move(result)); }

bool CallTable::complete_from(int peer, uint64_t id, absl::StatusOr<Message> result) {
  return settle(id, peer, std::move(result));
}

bool CallTable::settle(uint64_t id, std::optional<int> from, absl::StatusOr<Message> result) {
  // Not a default-made Pending: its promise would allocate a state only to drop it.
  std::optional<Pending> pending;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(id);
    if (it == calls_.end() || (from && it->second.peer != *from)) return false;
    if (heartbeat_.count() > 0) heard_[it->second.peer] = Clock::now();
    pending.emplace(std::move(it->second));
    calls_.erase(it);
    if (pending->deadline != Clock::time_point::max() && !pending->in_lane) deadlines_.erase({pending->deadline, id});
  }
  finish(*pending, std::move(result));
  return true;
}

size_t CallTable::fail_peer(int peer, const absl::Status& status) {
  std::vector<Pending> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    heard_.erase(peer);  // a later pipe to it starts unheard
    for (auto it = calls_.begin(); it != calls_.end();) {
      if (it->second.peer != peer) {
        ++it;
        continue;
      }
      if (it->second.deadline != Clock::time_point::max() && !it->second.in_lane) {
        deadlines_.erase({it->second.deadline, it->first});
      }
      failed.push_back(std::move(it->second));
      calls_.erase(it++);
    }
  }
  for (Pending& p : failed) finish(p, status);
  return failed.size();
}

size_t CallTable::fail_all(const absl::Status& status) {
  absl::flat_hash_map<uint64_t, Pending> failed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    failed.swap(calls_);
    deadlines_.clear();
    lane_.clear();
    checks_.clear();
  }
  for (auto& [id, p] : failed) finish(p, status);
  return failed.size();
}

void CallTable::heard(int peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (heartbeat_.count() > 0) heard_[peer] = Clock::now();
}

CallTable::Clock::time_point CallTable::last_heard(int peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = heard_.find(peer);
  return it == heard_.end() ? Clock::time_point() : it->second;
}

std::optional<CallTable::Clock::time_point> CallTable::deadline_of(uint64_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(id);
  if (it == calls_.end()) return std::nullopt;
  return it->second.deadline;
}

size_t CallTable::queued_deadlines() const {
  std::lock_guard<std::mutex> lock(mu_);
  return deadlines_.size() + lane_.size();
}

size_t CallTable::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_.size();
}

void CallTable::run_at(Clock::time_point when, std::function<void()> task) {
  bool earliest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    tasks_.emplace(when, std::move(task));
    earliest = when < timer_until_;
  }
  if (earliest) timer_cv_.notify_one();
}

void CallTable::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  timer_cv_.notify_all();
  if (timer_.joinable()) timer_.join();
}

void CallTable::run_timer() {
  // Expired calls' callbacks go to the pool, like a transport thread's.
  set_on_agent_thread(true);
  set_on_transport_thread(true);
  std::unique_lock<std::mutex> lock(mu_);
  while (!stopping_) {
    Clock::time_point next = next_due();
    if (Clock::now() < next) {
      timer_until_ = next;
      if (next == Clock::time_point::max()) {
        timer_cv_.wait(lock);
      } else {
        timer_cv_.wait_until(lock, next);
      }
      timer_until_ = Clock::time_point::min();  // awake: it looks again before it sleeps
      continue;
    }
    std::vector<std::pair<uint64_t, Pending>> expired;
    std::vector<int> suspects;
    std::vector<std::function<void()>> due;
    Clock::time_point now = Clock::now();
    while (!tasks_.empty() && tasks_.begin()->first <= now) {
      due.push_back(std::move(tasks_.begin()->second));
      tasks_.erase(tasks_.begin());
    }
    while (!deadlines_.empty() && deadlines_.begin()->first <= now) {
      uint64_t id = deadlines_.begin()->second;
      deadlines_.erase(deadlines_.begin());
      if (id & kHeartbeatBit) {
        int peer = static_cast<int>(id & ~kHeartbeatBit);
        checks_.erase(peer);
        bool waiting = false;
        for (const auto& [call, p] : calls_) {
          if (p.peer == peer) {
            waiting = true;
            break;
          }
        }
        if (!waiting) continue;  // nothing pending: the next call schedules a check
        // A peer never heard from is judged by the time since the call that scheduled
        // this check (a heartbeat ago): a process stopped before its first reply
        // (or before its connection came up) is silent too, and would otherwise hold a
        // call with no timeout forever (issue 27, finding 8). A connection still coming
        // up on a loaded host has the ping's wait besides.
        auto heard_it = heard_.find(peer);
        Clock::time_point heard = heard_it == heard_.end() ? Clock::time_point() : heard_it->second;
        if (now - heard < heartbeat_) {
          schedule_check(peer, heard + heartbeat_);
        } else {
          suspects.push_back(peer);
          schedule_check(peer, now + heartbeat_);
        }
        continue;
      }
      auto it = calls_.find(id);
      if (it == calls_.end()) continue;
      expired.emplace_back(id, std::move(it->second));
      calls_.erase(it);
    }
    while (!lane_.empty() && lane_.front().first <= now) {
      auto it = calls_.find(lane_.front().second);
      lane_.pop_front();
      if (it == calls_.end()) continue;  // ended before its deadline
      expired.emplace_back(it->first, std::move(it->second));
      calls_.erase(it);
    }
    lock.unlock();
    for (std::function<void()>& task : due) task();
    due.clear();
    for (int peer : suspects) suspect_(peer);
    for (auto& [id, p] : expired) {
      absl::Status timed_out = absl::DeadlineExceededError(
          absl::StrCat("rpc to worker \"", p.peer_name, "\" (call ", id, ") timed out"));
      finish(p, timed_out);
    }
    lock.lock();
  }
}

}  // namespace ferry::internal
