#include "agents/core/membership_lock.h"

#include <algorithm>
#include <random>
#include <thread>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/auth.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/thread_name.h"

namespace ferry::internal {

namespace {

using Clock = std::chrono::steady_clock;

// "<owner>\n<nonce>\n<renewal count>": the nonce keeps two holders of one name apart,
// and the count changes the value at every renewal, which is how waiters tell a live
// holder from one that stopped.
Bytes lease_value(const std::string& owner, const std::string& nonce, uint64_t count) {
  return to_bytes(absl::StrCat(owner, "\n", nonce, "\n", count));
}

std::string owner_of(const Bytes& value) {
  std::string s = to_string(value);
  return s.substr(0, s.find('\n'));
}

}  // namespace

struct MembershipLock::State {
  std::shared_ptr<Store> store;
  std::string key;
  std::string owner;
  std::string nonce;
  std::chrono::milliseconds lease;

  absl::Mutex mu;
  Bytes value ABSL_GUARDED_BY(mu);  // what the key holds while this holder has it
  uint64_t count ABSL_GUARDED_BY(mu) = 0;
  bool lost ABSL_GUARDED_BY(mu) = false;
  bool stopping ABSL_GUARDED_BY(mu) = false;
  // The last renewal the store confirmed.
  Clock::time_point renewed ABSL_GUARDED_BY(mu);
  std::thread renewer;

  // One renewal: a compare_set from the value this holder wrote last.
  absl::Status renew_now() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (lost) return lost_status();
    if (stopping) return absl::FailedPreconditionError(absl::StrCat("worker \"", owner, "\" released the group-membership lock"));
    Bytes next = lease_value(owner, nonce, count + 1);
    // Under mu: a renewal and a release never interleave, so the value is current.
    absl::StatusOr<Bytes> now = store->compare_set_owned(key, value, next);
    if (!now.ok()) {
      // The store did not answer: this holder cannot know, and waiters may take over
      // once a lease passed without a renewal they saw.
      if (Clock::now() - renewed >= lease) {
        lost = true;
        return absl::AbortedError(absl::StrCat("the group-membership lock held by \"", owner,
                                               "\" could not be renewed for a whole lease (", lease.count(),
                                               " ms): ", now.status().message()));
      }
      return absl::OkStatus();
    }
    if (*now != next) {
      lost = true;
      FERRY_LOG(WARNING) << owner << ": lost the group-membership lock to \"" << owner_of(*now)
                         << "\": this worker did not renew it for a whole lease (stopped or too slow?)";
      return lost_status();
    }
    value = std::move(next);
    ++count;
    renewed = Clock::now();
    return absl::OkStatus();
  }

  absl::Status lost_status() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return absl::AbortedError(absl::StrCat("worker \"", owner,
                                           "\" lost the group-membership lock: it did not renew it within its lease (",
                                           lease.count(), " ms), and another worker took it over"));
  }

  void run_renewer() {
    for (;;) {
      {
        absl::MutexLock lock(&mu);
        // A few renewals per lease, so a waiter sees the value change well before it
        // would call the lease run out.
        mu.AwaitWithTimeout(absl::Condition(&stopping), absl::FromChrono(lease / 4));
        if (stopping || lost) return;
      }
      (void)renew_now();
    }
  }
};

absl::StatusOr<std::unique_ptr<MembershipLock>> MembershipLock::acquire(std::shared_ptr<Store> store, std::string key,
                                                                        std::string owner,
                                                                        std::chrono::milliseconds timeout,
                                                                        std::chrono::milliseconds lease) {
  if (lease.count() <= 0) return absl::InvalidArgumentError("MembershipLock: the lease must be positive");
  auto state = std::make_shared<State>();
  state->store = std::move(store);
  state->key = std::move(key);
  state->owner = std::move(owner);
  state->nonce = absl::BytesToHexString(auth::nonce());
  state->lease = lease;
  const Bytes mine = lease_value(state->owner, state->nonce, 0);
  const Clock::time_point deadline = Clock::now() + timeout;
  // The holder's value as this waiter last saw it change, and when.
  Bytes seen;
  Clock::time_point seen_since = Clock::now();
  std::chrono::milliseconds pause(5);
  for (;;) {
    // A free lock is a missing key or an empty value (what release() leaves).
    FERRY_ASSIGN_OR_RETURN(Bytes now, state->store->compare_set_owned(state->key, Bytes(), mine));
    if (now == mine) break;
    const Clock::time_point t = Clock::now();
    if (now != seen) {
      seen = std::move(now);
      seen_since = t;
    } else if (t - seen_since >= lease) {
      // Not renewed for a whole lease as this waiter measures it: the holder stopped
      // or hung. Take it from exactly that value, so that only one waiter does.
      FERRY_ASSIGN_OR_RETURN(Bytes took, state->store->compare_set_owned(state->key, seen, mine));
      if (took == mine) {
        FERRY_LOG(WARNING) << state->owner << ": took the group-membership lock over from \"" << owner_of(seen)
                           << "\", which did not renew it for " << lease.count() << " ms (stopped or hung?)";
        break;
      }
      seen = std::move(took);
      seen_since = t;
    }
    if (t >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("worker \"", state->owner, "\" waited ", timeout.count(),
                       " ms for the group-membership lock; worker \"", owner_of(seen),
                       "\" holds it (still joining or leaving, or stopped: a holder that stops loses it ",
                       lease.count(), " ms after its last renewal)"));
    }
    std::this_thread::sleep_for(std::min({pause, std::chrono::duration_cast<std::chrono::milliseconds>(deadline - t) +
                                                     std::chrono::milliseconds(1),
                                          lease / 4}));
    pause = std::min(pause * 2, std::chrono::milliseconds(100));
  }
  {
    absl::MutexLock lock(&state->mu);
    state->value = mine;
    state->renewed = Clock::now();
  }
  state->renewer = std::thread([s = state.get()] {
    name_this_thread("ferry-lease");
    s->run_renewer();
  });
  return std::unique_ptr<MembershipLock>(new MembershipLock(std::move(state)));
}

MembershipLock::MembershipLock(std::shared_ptr<State> state) : state_(std::move(state)) {}

MembershipLock::~MembershipLock() { release(); }

absl::Status MembershipLock::held() { return state_->renew_now(); }

void MembershipLock::release() {
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    if (s.stopping) return;
    s.stopping = true;
  }
  if (s.renewer.joinable()) s.renewer.join();
  absl::MutexLock lock(&s.mu);
  if (s.lost) return;
  absl::StatusOr<Bytes> now = s.store->compare_set(s.key, s.value, Bytes());
  if (!now.ok()) {
    FERRY_LOG(ERROR) << s.owner << ": releasing the group-membership lock: " << now.status()
                     << " (others take it over when the lease runs out)";
  } else if (!now->empty()) {
    FERRY_LOG(WARNING) << s.owner << ": the group-membership lock was taken over by \"" << owner_of(*now)
                       << "\" before this worker released it";
  }
}

}  // namespace ferry::internal
