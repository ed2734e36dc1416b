#include "agents/core/liveness.h"

#include "absl/strings/str_cat.h"
#include "agents/core/call_table.h"
#include "agents/core/links.h"
#include "agents/core/membership.h"
#include "agents/core/outbox.h"

namespace ferry::internal {
namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

Liveness::Liveness(std::string self_name, int self_id, std::chrono::milliseconds heartbeat, Outbox& outbox,
                   Links& links, CallTable& calls, const Membership& members, std::weak_ptr<void> owner,
                   std::function<void(int, absl::Status)> lost)
    : self_name_(std::move(self_name)),
      self_id_(self_id),
      heartbeat_(heartbeat),
      outbox_(outbox),
      links_(links),
      calls_(calls),
      members_(members),
      owner_(std::move(owner)),
      lost_(std::move(lost)) {}

void Liveness::suspect(int peer, std::chrono::milliseconds wait) {
  {
    Locked lock(pinging_mu_);
    if (!pinging_.insert(peer).second) return;  // one ping at a time
  }
  std::shared_ptr<const Membership::Table> table = members_.snapshot();
  const Member* member = table->find(peer);
  std::string name = member != nullptr ? member->info.name : absl::StrCat("id ", peer);
  const Clock::time_point pinged = Clock::now();
  outbox_.send(peer, Message(MessageType::kPing, 0), wait)
      .add_callback([this, owner = owner_, peer, name, wait, pinged](const absl::StatusOr<Message>& pong) {
        std::shared_ptr<void> alive = owner.lock();
        if (!alive) return;
        {
          Locked lock(pinging_mu_);
          pinging_.erase(peer);
        }
        // A reply to any other call since the ping proves the peer alive: the ping may
        // only be queued behind a burst of requests.
        if (pong.status().code() == absl::StatusCode::kDeadlineExceeded && calls_.last_heard(peer) < pinged) {
          links_.drop(peer);
          lost_(peer, absl::UnavailableError(absl::StrCat("worker \"", name, "\" (id ", peer,
                                                          ") did not answer a heartbeat within ", wait.count(),
                                                          " ms; declared lost")));
        }
      });
}

void Liveness::watch(int peer, bool watched) {
  if (heartbeat_.count() == 0 || peer == self_id_) return;
  {
    Locked lock(watch_mu_);
    if (!watched) {
      watched_.erase(peer);
      return;
    }
    watched_.insert(peer);
    if (watching_) return;
    watching_ = true;
  }
  calls_.run_at(Clock::now() + heartbeat_ / 2, [this, owner = owner_] {
    if (std::shared_ptr<void> alive = owner.lock()) check_watched();
  });
}

void Liveness::check_watched() {
  std::vector<int> peers;
  {
    Locked lock(watch_mu_);
    if (watched_.empty() || stopped_.load()) {
      watching_ = false;
      return;
    }
    peers.assign(watched_.begin(), watched_.end());
  }
  // A peer heard from within the last half heartbeat needs no ping.
  const Clock::time_point recent = Clock::now() - heartbeat_ / 2;
  for (int peer : peers) {
    if (calls_.last_heard(peer) < recent) suspect(peer, heartbeat_ / 2);
  }
  calls_.run_at(Clock::now() + heartbeat_ / 2, [this, owner = owner_] {
    if (std::shared_ptr<void> alive = owner.lock()) check_watched();
  });
}

}  // namespace ferry::internal
