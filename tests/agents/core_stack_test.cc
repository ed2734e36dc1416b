// The agent core's pieces on their own: the job-token handshake as a pure state machine
// (two sides run against each other with no transport), the lock order's check, and a
// call's destination resolved once.
#include <gtest/gtest.h>

#include <future>
#include <thread>
#include <mutex>

#include "absl/strings/str_cat.h"

#include "agents/core/handshake.h"
#include "agents/core/join_barrier.h"
#include "agents/core/lock_order.h"
#include "agents/core/session.h"
#include "agents/inproc/factory.h"
#include "base/status.h"
#include "store/hash_store.h"

namespace ferry::internal {
namespace {

using Kind = HandshakeStep::Kind;

absl::Status any_claim(int, const std::string&) { return absl::OkStatus(); }

struct Sides {
  Handshake opener_side;
  Handshake acceptor_side;
  std::shared_ptr<Session> opener;
  Session acceptor{false, -1, "", Stage::kAwaitHello};

  Sides(std::string opener_token, std::string acceptor_token)
      : opener_side("w0", 0, std::move(opener_token)), acceptor_side("w1", 1, std::move(acceptor_token)) {
    opener = opener_side.opener(1, "w1");
  }
};

TEST(Handshake, SameTokenOpensBothSidesInThreeMessages) {
  Sides s("secret", "secret");
  EXPECT_EQ(s.opener->stage, Stage::kHello);
  HandshakeStep challenge = s.acceptor_side.step(s.acceptor, s.opener_side.hello(*s.opener), any_claim);
  ASSERT_EQ(challenge.kind, Kind::kSend);
  EXPECT_EQ(s.acceptor.peer, 0);
  EXPECT_EQ(s.acceptor.peer_name, "w0");
  HandshakeStep proof = s.opener_side.step(*s.opener, *challenge.reply, any_claim);
  ASSERT_EQ(proof.kind, Kind::kSend);
  EXPECT_TRUE(proof.flush) << "the acceptor proved the token: requests follow the proof";
  HandshakeStep admit = s.acceptor_side.step(s.acceptor, *proof.reply, any_claim);
  ASSERT_EQ(admit.kind, Kind::kAdmit);
  ASSERT_TRUE(admit.reply.has_value());
  HandshakeStep done = s.opener_side.step(*s.opener, *admit.reply, any_claim);
  EXPECT_EQ(done.kind, Kind::kNone);
  EXPECT_EQ(s.opener->stage, Stage::kOpen);
}

// An acceptor whose challenge does not prove the token gets no proof from the opener
// (it would be material for guessing the token), but a refusal saying why, and both
// sides fail the connection.
TEST(Handshake, WrongTokenFailsTheOpenerBeforeItSendsItsProof) {
  Sides s("secret", "other");
  HandshakeStep challenge = s.acceptor_side.step(s.acceptor, s.opener_side.hello(*s.opener), any_claim);
  HandshakeStep failed = s.opener_side.step(*s.opener, *challenge.reply, any_claim);
  ASSERT_EQ(failed.kind, Kind::kFail);
  EXPECT_EQ(s.opener->stage, Stage::kRefused);
  EXPECT_EQ(failed.failure.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_NE(failed.failure.message().find("could not prove"), std::string::npos) << failed.failure;
  ASSERT_TRUE(failed.reply.has_value());
  EXPECT_TRUE(refusal(*failed.reply).has_value())
      << "the opener's proof went to an acceptor that did not prove the token";
  HandshakeStep refused = s.acceptor_side.step(s.acceptor, *failed.reply, any_claim);
  ASSERT_EQ(refused.kind, Kind::kRefuse);
  EXPECT_EQ(s.acceptor.stage, Stage::kRefused);
  EXPECT_NE(refused.why.find("FERRY_AUTH_TOKEN"), std::string::npos) << refused.why;
}

// The acceptor's refusal of the opener's proof (a token the opener has and the acceptor
// does not share, seen from the opener that proved nothing wrong) fails the opener.
TEST(Handshake, ARefusedProofFailsTheOpenerSayingWhy) {
  Sides s("secret", "secret");
  HandshakeStep challenge = s.acceptor_side.step(s.acceptor, s.opener_side.hello(*s.opener), any_claim);
  HandshakeStep proof = s.opener_side.step(*s.opener, *challenge.reply, any_claim);
  ASSERT_EQ(proof.kind, Kind::kSend);
  HandshakeStep failed = s.opener_side.step(*s.opener, auth_message(AuthKind::kRefused, {"no"}), any_claim);
  ASSERT_EQ(failed.kind, Kind::kFail);
  EXPECT_NE(failed.failure.message().find("refused this worker's pipe: no"), std::string::npos) << failed.failure;
}

TEST(Handshake, WithoutTokensTheHelloAdmitsAtOnce) {
  Sides s("", "");
  EXPECT_EQ(s.opener->stage, Stage::kOpen);
  HandshakeStep admit = s.acceptor_side.step(s.acceptor, s.opener_side.hello(*s.opener), any_claim);
  EXPECT_EQ(admit.kind, Kind::kAdmit);
  EXPECT_FALSE(admit.reply.has_value());
  EXPECT_EQ(s.acceptor.peer, 0);
}

TEST(Handshake, OneSideWithoutATokenIsRefusedSayingWhich) {
  Sides none_opens("", "secret");
  HandshakeStep r1 = none_opens.acceptor_side.step(none_opens.acceptor,
                                                   none_opens.opener_side.hello(*none_opens.opener), any_claim);
  ASSERT_EQ(r1.kind, Kind::kRefuse);
  EXPECT_NE(r1.tell.find("presented none"), std::string::npos) << r1.tell;
  Sides token_opens("secret", "");
  HandshakeStep r2 = token_opens.acceptor_side.step(token_opens.acceptor,
                                                    token_opens.opener_side.hello(*token_opens.opener), any_claim);
  ASSERT_EQ(r2.kind, Kind::kRefuse);
  EXPECT_NE(r2.tell.find("has no job token"), std::string::npos) << r2.tell;
}

TEST(Handshake, AClaimTheMembershipGivesSomeoneElseIsRefused) {
  Sides s("secret", "secret");
  HandshakeStep refused =
      s.acceptor_side.step(s.acceptor, s.opener_side.hello(*s.opener), [](int id, const std::string& name) {
        return absl::PermissionDeniedError(absl::StrCat("id ", id, " is not ", name));
      });
  ASSERT_EQ(refused.kind, Kind::kRefuse);
  EXPECT_NE(refused.why.find("claims to be worker \"w0\""), std::string::npos) << refused.why;
}

TEST(Handshake, GarbageInsteadOfAHelloOrAChallengeIsRefused) {
  Sides s("secret", "secret");
  Wire garbage{"not a hello at all", {}, {}};
  EXPECT_EQ(s.acceptor_side.step(s.acceptor, garbage, any_claim).kind, Kind::kRefuse);
  HandshakeStep failed = s.opener_side.step(*s.opener, garbage, any_claim);
  ASSERT_EQ(failed.kind, Kind::kFail);
  EXPECT_NE(failed.failure.message().find("did not answer the job-token hello"), std::string::npos);
  EXPECT_EQ(s.opener->stage, Stage::kRefused);
}

TEST(Handshake, AMalformedHelloIsRefused) {
  Sides s("secret", "secret");
  Wire hello = auth_message(AuthKind::kHello, {"w0", "not-a-number", "short"});
  HandshakeStep refused = s.acceptor_side.step(s.acceptor, hello, any_claim);
  ASSERT_EQ(refused.kind, Kind::kRefuse);
  EXPECT_EQ(refused.why, "malformed hello");
}

TEST(LockOrder, TakingLocksInRankOrderIsFine) {
  RankedMutex links(LockRank::kLinks);
  RankedMutex accepted(LockRank::kAccepted);
  RankedMutex session(LockRank::kSession);
  Locked a(links);
  Locked b(accepted);
  Locked c(session);
  SUCCEED();
}

#ifndef NDEBUG
TEST(LockOrderDeathTest, TakingALowerRankWhileHoldingAHigherAbortsNamingBoth) {
  RankedMutex links(LockRank::kLinks);
  RankedMutex session(LockRank::kSession);
  EXPECT_DEATH(
      {
        Locked s(session);
        Locked l(links);
      },
      "lock order violated: taking kLinks while holding kSession");
}
#endif


// ---- The join barrier's accounting in the store.

struct Group {
  HashStore store;
  Membership members;
  explicit Group(int n) {
    for (int i = 0; i < n; ++i) EXPECT_TRUE(members.add({WorkerInfo{absl::StrCat("w", i), i}, ""}).ok());
  }
  std::unique_ptr<JoinBarrier> barrier(int id) {
    return std::make_unique<JoinBarrier>(WorkerInfo{absl::StrCat("w", id), id}, store, members, "job/",
                                         std::chrono::milliseconds(50));
  }
};

const auto kNoProbe = [](int) {};

std::chrono::steady_clock::time_point in(std::chrono::milliseconds ms) { return std::chrono::steady_clock::now() + ms; }

TEST(JoinBarrier, AWorkerThatDiedBetweenItsClaimAndItsCountDoesNotHoldTheRoundToItsDeadline) {
  Group g(2);
  // Worker 1 claimed its fate and counted its arrival, then died before counting itself
  // accounted.
  ASSERT_TRUE(g.store.compare_set("job/join/0/fate/1", {}, to_bytes("arrived")).ok());
  ASSERT_TRUE(g.store.add("job/join/0/arrived", 1).ok());
  std::unique_ptr<JoinBarrier> w0 = g.barrier(0);
  JoinBarrier::Round round = w0->begin(2);
  const auto start = std::chrono::steady_clock::now();
  absl::Status waited = w0->wait(round, in(std::chrono::seconds(20)), kNoProbe);
  EXPECT_TRUE(waited.ok()) << waited;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST(JoinBarrier, AWorkerSlowBetweenItsClaimAndItsCountIsNotReportedLost) {
  Group g(2);
  // Worker 1 claimed its fate and has not counted its arrival yet (a slow process, not
  // a dead one); worker 0's probe ends the round on the fates.
  ASSERT_TRUE(g.store.compare_set("job/join/0/fate/1", {}, to_bytes("arrived")).ok());
  std::unique_ptr<JoinBarrier> w0 = g.barrier(0);
  JoinBarrier::Round r0 = w0->begin(2);
  ASSERT_TRUE(w0->wait(r0, in(std::chrono::seconds(20)), kNoProbe).ok());
  absl::StatusOr<int64_t> arrived = w0->arrived(r0);
  ASSERT_TRUE(arrived.ok());
  ASSERT_EQ(*arrived, 1);
  // Worker 0 leaves last: it waits for worker 1, which now counts itself and leaves.
  auto left0 = std::async(std::launch::async, [&] { return w0->leave(r0, *arrived, in(std::chrono::seconds(10))); });
  ASSERT_TRUE(g.store.add("job/join/0/arrived", 1).ok());
  std::unique_ptr<JoinBarrier> w1 = g.barrier(1);
  JoinBarrier::Round r1 = w1->begin(2);
  EXPECT_TRUE(w1->leave(r1, 2, in(std::chrono::seconds(10))).ok());
  absl::Status left = left0.get();
  EXPECT_TRUE(left.ok()) << left;  // was: "1 worker(s) were lost: " naming nobody
}

TEST(JoinBarrier, AWorkerRecordedLostBeforeItArrivesIsToldSoAndDoesNotCountAsLeaving) {
  Group g(2);
  std::unique_ptr<JoinBarrier> w0 = g.barrier(0);
  std::unique_ptr<JoinBarrier> w1 = g.barrier(1);
  JoinBarrier::Round r0 = w0->begin(2);
  JoinBarrier::Round r1 = w1->begin(2);
  // Worker 0 (or a token holder in its name) records worker 1 lost before it arrives.
  (void)w0->record_loss(1, absl::UnavailableError("w1 is gone"));
  auto first = std::async(std::launch::async, [&] { return w0->wait(r0, in(std::chrono::seconds(20)), kNoProbe); });
  // Worker 0's own claim, then its claim of worker 1's loss, settle the round.
  ASSERT_TRUE(g.store.wait({"job/join/0/done"}, std::chrono::seconds(10)).ok());
  absl::Status late = w1->wait(r1, in(std::chrono::seconds(20)), kNoProbe);
  EXPECT_EQ(late.code(), absl::StatusCode::kUnavailable) << late;
  EXPECT_NE(late.message().find("recorded it as lost"), std::string::npos) << late;
  ASSERT_TRUE(first.get().ok());
  absl::StatusOr<int64_t> arrived = w0->arrived(r0);
  ASSERT_TRUE(arrived.ok());
  EXPECT_EQ(*arrived, 1);
  // Worker 0 leaves alone and names worker 1; worker 1 did not count itself as leaving.
  absl::Status left = w0->leave(r0, *arrived, in(std::chrono::seconds(5)));
  EXPECT_EQ(left.code(), absl::StatusCode::kUnavailable) << left;
  EXPECT_NE(left.message().find("\"w1\" (id 1)"), std::string::npos) << left;
  absl::StatusOr<int64_t> gone = g.store.add("job/join/0/left", 0);
  ASSERT_TRUE(gone.ok());
  EXPECT_EQ(*gone, 1);
}

TEST(JoinBarrier, APeerSeenGoingWhileThisWorkerWaitsButThatArrivedIsToldAsLeft) {
  // Peers that saw the round end leave while slower workers still wait. The waiting
  // worker does not rush to account them lost: the round ends first, and they left.
  Group g(3);
  auto barrier = [&](int id) {
    return std::make_unique<JoinBarrier>(WorkerInfo{absl::StrCat("w", id), id}, g.store, g.members, "job/",
                                         std::chrono::seconds(2));
  };
  std::unique_ptr<JoinBarrier> w0 = barrier(0);
  std::unique_ptr<JoinBarrier> w1 = barrier(1);
  std::unique_ptr<JoinBarrier> w2 = barrier(2);
  JoinBarrier::Round r0 = w0->begin(3);
  JoinBarrier::Round r1 = w1->begin(3);
  JoinBarrier::Round r2 = w2->begin(3);
  auto third = std::async(std::launch::async, [&] { return w2->wait(r2, in(std::chrono::seconds(20)), kNoProbe); });
  auto first = std::async(std::launch::async, [&] { return w0->wait(r0, in(std::chrono::seconds(20)), kNoProbe); });
  while (*g.store.add("job/join/0/arrived", 0) < 2) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(w0->record_loss(1, absl::UnavailableError("w1 closed its connection")));
  EXPECT_EQ(w0->decide(WorkerInfo{"w1", 1}), std::nullopt);
  EXPECT_TRUE(w1->wait(r1, in(std::chrono::seconds(20)), kNoProbe).ok());
  absl::Status waited = first.get();
  ASSERT_TRUE(waited.ok()) << waited;
  ASSERT_TRUE(third.get().ok());
  std::vector<std::pair<WorkerInfo, MembershipChange>> told = w0->end_wait(r0, waited);
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0].first.id, 1);
  EXPECT_EQ(told[0].second, MembershipChange::kLeft);
}

TEST(JoinBarrier, APeerLostWhileThisWorkerWaitsIsAccountedAndTheRoundEnds) {
  Group g(2);
  std::unique_ptr<JoinBarrier> w0 = g.barrier(0);
  JoinBarrier::Round r0 = w0->begin(2);
  auto first = std::async(std::launch::async, [&] { return w0->wait(r0, in(std::chrono::seconds(20)), kNoProbe); });
  while (*g.store.add("job/join/0/arrived", 0) < 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(w0->record_loss(1, absl::UnavailableError("w1 was killed")));
  EXPECT_EQ(w0->decide(WorkerInfo{"w1", 1}), std::nullopt);
  absl::Status waited = first.get();
  ASSERT_TRUE(waited.ok()) << waited;
  std::vector<std::pair<WorkerInfo, MembershipChange>> told = w0->end_wait(r0, waited);
  ASSERT_EQ(told.size(), 1u);
  EXPECT_EQ(told[0].second, MembershipChange::kLost);
  EXPECT_EQ(to_string(*g.store.get("job/join/0/fate/1", std::chrono::milliseconds(0))), "lost:0");
}

// Counts, per worker, the store reads made after the worker counted itself as left.
class WatchedStore final : public Store {
 public:
  absl::Status set(std::string_view key, const Bytes& value) override { return inner_.set(key, value); }
  absl::StatusOr<Bytes> get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) override {
    noted();
    return inner_.get(key, timeout);
  }
  absl::StatusOr<int64_t> add(std::string_view key, int64_t delta) override {
    absl::StatusOr<int64_t> added = inner_.add(key, delta);
    if (std::string(key).ends_with("/left") && delta == 1 && added.ok()) {
      std::lock_guard<std::mutex> lock(mu_);
      left_ = *added;
    }
    return added;
  }
  absl::StatusOr<Bytes> compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) override {
    return inner_.compare_set(key, expected, desired);
  }
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override { return inner_.check(keys); }
  absl::Status wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) override {
    return inner_.wait(keys, timeout);
  }
  absl::StatusOr<bool> delete_key(std::string_view key) override { return inner_.delete_key(key); }
  absl::StatusOr<int64_t> num_keys() override { return inner_.num_keys(); }
  absl::StatusOr<std::vector<Bytes>> multi_get(const std::vector<std::string>& keys,
                                               std::optional<std::chrono::milliseconds> timeout) override {
    noted();
    return inner_.multi_get(keys, timeout);
  }
  absl::Status multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override {
    return inner_.multi_set(keys, values);
  }
  int reads_after_everyone_left() {
    std::lock_guard<std::mutex> lock(mu_);
    return late_reads_;
  }
  void everyone_is(int n) {
    std::lock_guard<std::mutex> lock(mu_);
    everyone_ = n;
  }

 private:
  void noted() {
    std::lock_guard<std::mutex> lock(mu_);
    if (everyone_ > 0 && left_ >= everyone_) ++late_reads_;
  }
  HashStore inner_;
  std::mutex mu_;
  int64_t left_ = 0;
  int everyone_ = 0;
  int late_reads_ = 0;
};

TEST(JoinBarrier, NoWorkerReadsTheStoreAfterTheLastOneCountedItselfGone) {
  // Three workers, one lost: the two that arrive name it, and neither reads the store
  // once both counted themselves gone (worker 0 may then take the store down).
  WatchedStore store;
  Membership members;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(members.add({WorkerInfo{absl::StrCat("w", i), i}, ""}).ok());
  auto barrier = [&](int id) {
    return std::make_unique<JoinBarrier>(WorkerInfo{absl::StrCat("w", id), id}, store, members, "job/",
                                         std::chrono::milliseconds(50));
  };
  std::unique_ptr<JoinBarrier> w0 = barrier(0);
  std::unique_ptr<JoinBarrier> w1 = barrier(1);
  (void)w0->record_loss(2, absl::UnavailableError("w2 is gone"));
  store.everyone_is(2);
  auto run = [&](JoinBarrier& w) {
    JoinBarrier::Round round = w.begin(3);
    FERRY_RETURN_IF_ERROR(w.wait(round, in(std::chrono::seconds(20)), kNoProbe));
    FERRY_ASSIGN_OR_RETURN(int64_t arrived, w.arrived(round));
    return w.leave(round, arrived, in(std::chrono::seconds(20)));
  };
  auto one = std::async(std::launch::async, [&] { return run(*w1); });
  absl::Status zero = run(*w0);
  absl::Status other = one.get();
  for (const absl::Status& s : {zero, other}) {
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
    EXPECT_NE(s.message().find("\"w2\" (id 2)"), std::string::npos) << s;
  }
  EXPECT_EQ(store.reads_after_everyone_left(), 0);
}

}  // namespace
}  // namespace ferry::internal

// ---- One lookup per call: a Destination the agent resolved is used as is.


namespace ferry {
namespace {

Message echo_handler(const Message& request, const WorkerInfo&) {
  Message reply(MessageType::kResponse, request.id());
  return reply;
}

TEST(Destination, ASendToAResolvedWorkerReachesItAndAStaleOneIsLookedUpAgain) {
  auto store = std::make_shared<HashStore>();
  InprocAgentOptions options;
  absl::StatusOr<std::shared_ptr<Agent>> a = InprocAgent::start(store, "a", 0, options, echo_handler);
  absl::StatusOr<std::shared_ptr<Agent>> b = InprocAgent::start(store, "b", 1, options, echo_handler);
  ASSERT_TRUE(a.ok() && b.ok());
  std::vector<PeerAddress> members{{WorkerInfo{"a", 0}, (*a)->address()}, {WorkerInfo{"b", 1}, (*b)->address()}};
  ASSERT_TRUE((*a)->set_members(members).ok());
  ASSERT_TRUE((*b)->set_members(members).ok());

  absl::StatusOr<Destination> to_b = (*a)->resolve("b");
  ASSERT_TRUE(to_b.ok()) << to_b.status();
  EXPECT_EQ(to_b->info(), (WorkerInfo{"b", 1}));
  EXPECT_EQ(to_b->resolver() != nullptr, true);
  EXPECT_TRUE((*a)->send(*to_b, Message(MessageType::kRequest, 0), std::chrono::seconds(10)).status().ok());

  absl::StatusOr<Destination> nobody = (*a)->resolve("nobody");
  EXPECT_EQ(nobody.status().code(), absl::StatusCode::kNotFound);

  // b leaves after a resolved it: the entry is stale, and the send says b left.
  ASSERT_TRUE((*a)->remove_member(1, MembershipChange::kLeft).ok());
  absl::Status stale = (*a)->send(*to_b, Message(MessageType::kRequest, 0), std::chrono::seconds(10)).status();
  EXPECT_EQ(stale.code(), absl::StatusCode::kUnavailable) << stale;
  EXPECT_NE(stale.message().find("left"), std::string::npos) << stale;
  (*a)->shutdown();
  (*b)->shutdown();
}

}  // namespace
}  // namespace ferry
