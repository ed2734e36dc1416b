// The agent core's pieces on their own: the job-token handshake as a pure state machine
// (two sides run against each other with no transport), the lock order's check, and a
// call's destination resolved once.
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "agents/core/handshake.h"
#include "agents/core/lock_order.h"
#include "agents/core/session.h"
#include "agents/inproc/factory.h"
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
