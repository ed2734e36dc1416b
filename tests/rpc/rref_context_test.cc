// The owner's side of the RRef protocol in one process: protocol messages served by an
// RRefContext, and the membership listener dropping the forks of lost and departed
// workers. The agent here only names workers and reports membership changes (the
// TensorPipe agent does not report lost peers yet); rref_test.cc runs the protocol
// between real processes.
#include "rpc/internal/rref_context.h"

#include <atomic>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "rpc/call.h"
#include "serialization/error.h"
#include "tests/testing/status_matchers.h"

namespace ferry::internal {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

// Names three workers and lets the test report membership changes. It sends nothing:
// the owner's side never needs to send.
class MembershipAgent : public RpcAgent {
 public:
  MembershipAgent() : workers_{{"owner", 0}, {"worker1", 1}, {"worker2", 2}} {}

  Future<Message> send(int, Message, std::optional<std::chrono::milliseconds>) override {
    return make_ready_future<Message>(absl::UnavailableError("this test agent does not send"));
  }
  const WorkerInfo& self() const override { return workers_[0]; }
  absl::StatusOr<WorkerInfo> worker_info(std::string_view name) const override {
    for (const WorkerInfo& w : workers_) {
      if (w.name == name) return w;
    }
    return absl::NotFoundError("unknown worker");
  }
  absl::StatusOr<WorkerInfo> worker_info(int id) const override {
    if (id < 0 || id >= static_cast<int>(workers_.size())) return absl::NotFoundError("unknown worker");
    return workers_[static_cast<size_t>(id)];
  }
  std::vector<WorkerInfo> worker_infos() const override { return workers_; }
  std::chrono::milliseconds default_timeout() const override { return std::chrono::seconds(5); }
  absl::Status join(std::chrono::milliseconds) override { return absl::OkStatus(); }
  absl::Status sync(std::chrono::milliseconds) override { return absl::OkStatus(); }
  void shutdown() override {}
  void add_membership_listener(MembershipListener listener) override { listeners_.push_back(std::move(listener)); }
  std::map<std::string, std::string> debug_info() const override { return {}; }

  void report(int id, MembershipChange change) {
    for (const MembershipListener& l : listeners_) l(workers_[static_cast<size_t>(id)], change);
  }
  const WorkerInfo& worker(int id) const { return workers_[static_cast<size_t>(id)]; }

 private:
  std::vector<WorkerInfo> workers_;
  std::vector<MembershipListener> listeners_;
};

std::atomic<int> live{0};
struct Counted {
  int64_t v = 0;
  Counted() { ++live; }
  explicit Counted(int64_t v) : v(v) { ++live; }
  Counted(const Counted& o) : v(o.v) { ++live; }
  ~Counted() { --live; }
  template <class Archive>
  void serialize(Archive& ar) {
    ar(v);
  }
};

template <typename... Fields>
Message protocol(std::string_view name, const Fields&... fields) {
  Message m(MessageType::kRequest, 9);
  PayloadWriter w(m);
  write_string(w, name);
  write_string(w, "");
  (w(fields), ...);
  return m;
}

absl::Status status_of(const Message& reply) {
  return reply.type() == MessageType::kError ? error_from_message(reply) : absl::OkStatus();
}

class RRefContextTest : public ::testing::Test {
 protected:
  RRefContextTest() {
    EXPECT_OK(registry_.add("make", make_registered_function([](int64_t v) { return Counted(v); })));
    EXPECT_OK(registry_.add("fail", make_registered_function([](int64_t) -> absl::StatusOr<Counted> {
                              return absl::InternalError("no counted today");
                            })));
    agent_ = std::make_shared<MembershipAgent>();
    ctx_ = std::make_shared<RRefContext>("owner");
    ctx_->attach(agent_);
  }
  ~RRefContextTest() override { ctx_->close(); }

  absl::Status serve(const Message& request, int from) {
    return status_of(ctx_->serve(registry_, request, agent_->worker(from)));
  }
  absl::Status create(RRefId id, RRefId fork, int from, std::string fn = "make", int64_t v = 1) {
    return serve(protocol("ferry::rref::create", id, fork, TypeName<Counted>::get(), fn,
                          std::string("(int64) -> ") + TypeName<Counted>::get(), v),
                 from);
  }
  absl::StatusOr<Counted> fetch(RRefId id, int from) {
    Message reply =
        ctx_->serve(registry_, protocol("ferry::rref::fetch", id, TypeName<Counted>::get()), agent_->worker(from));
    absl::Status s = status_of(reply);
    if (!s.ok()) return s;
    return decode_reply<Counted>(absl::StatusOr<Message>(std::move(reply)));
  }

  FunctionRegistry registry_;
  std::shared_ptr<MembershipAgent> agent_;
  std::shared_ptr<RRefContext> ctx_;
};

TEST_F(RRefContextTest, LostAndDepartedHoldersLoseTheirForks) {
  RRefId a{1, 1}, b{1, 2};
  ASSERT_OK(create(a, RRefId{1, 10}, 1, "make", 5));
  ASSERT_OK(create(b, RRefId{1, 11}, 1, "make", 6));
  ASSERT_OK(serve(protocol("ferry::rref::fork", a, RRefId{2, 20}, true), 2));
  EXPECT_EQ(ctx_->counts().owned, 2u);
  EXPECT_EQ(ctx_->counts().forks, 3u);
  EXPECT_EQ(live.load(), 2);
  // A join changes nothing; worker1's loss drops its two forks: b goes, a stays for worker2.
  agent_->report(1, MembershipChange::kJoined);
  EXPECT_EQ(ctx_->counts().forks, 3u);
  agent_->report(1, MembershipChange::kLost);
  EXPECT_EQ(ctx_->counts().membership_events, 1u);
  EXPECT_EQ(ctx_->counts().owned, 1u);
  EXPECT_EQ(live.load(), 1);
  EXPECT_EQ(fetch(a, 2).value().v, 5);
  // worker2 leaving drops the rest.
  agent_->report(2, MembershipChange::kLeft);
  EXPECT_OK(ctx_->wait_until_nothing_owned(std::chrono::milliseconds(0)));
  EXPECT_EQ(live.load(), 0);
}

TEST_F(RRefContextTest, ReleasesCountForksOut) {
  RRefId a{1, 1};
  ASSERT_OK(create(a, RRefId{1, 10}, 1));
  ASSERT_OK(serve(protocol("ferry::rref::fork", a, RRefId{2, 20}, true), 2));
  ASSERT_OK(serve(protocol("ferry::rref::release", a, RRefId{1, 10}), 1));
  // Releasing a fork twice, or one never made, changes nothing.
  ASSERT_OK(serve(protocol("ferry::rref::release", a, RRefId{1, 10}), 1));
  ASSERT_OK(serve(protocol("ferry::rref::release", a, RRefId{7, 7}), 1));
  EXPECT_EQ(ctx_->counts().owned, 1u);
  EXPECT_EQ(live.load(), 1);
  ASSERT_OK(serve(protocol("ferry::rref::release", a, RRefId{2, 20}), 2));
  EXPECT_EQ(ctx_->counts().owned, 0u);
  EXPECT_EQ(live.load(), 0);
  // Gone: a fetch, or a fork from a confirmed sender, is refused with the reason.
  EXPECT_THAT(fetch(a, 1).status(),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("every reference to it was released")));
  EXPECT_THAT(serve(protocol("ferry::rref::fork", a, RRefId{2, 21}, true), 2),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("is no longer held here")));
  EXPECT_EQ(ctx_->counts().owned, 0u);
}

TEST_F(RRefContextTest, AForkThatOvertakesTheCreationWaitsForIt) {
  RRefId a{1, 1};
  // worker2's fork arrives before worker1's creation: the entry waits for the value.
  ASSERT_OK(serve(protocol("ferry::rref::fork", a, RRefId{2, 20}, false), 2));
  EXPECT_EQ(ctx_->counts().owned, 1u);
  EXPECT_EQ(live.load(), 0);
  ASSERT_OK(create(a, RRefId{1, 10}, 1, "make", 9));
  EXPECT_EQ(ctx_->counts().forks, 2u);
  EXPECT_EQ(fetch(a, 2).value().v, 9);
}

TEST_F(RRefContextTest, ACreationErrorIsKeptAndFetched) {
  RRefId a{1, 1}, b{1, 2}, c{1, 3};
  // The creator's fork is recorded either way; the error is what a fetch returns.
  ASSERT_OK(create(a, RRefId{1, 10}, 1, "fail"));
  EXPECT_THAT(fetch(a, 1).status(),
              StatusIs(absl::StatusCode::kInternal, HasSubstr("owner: function \"fail\" failed: no counted today")));
  ASSERT_OK(create(b, RRefId{1, 11}, 1, "nope"));
  EXPECT_THAT(fetch(b, 1).status(), StatusIs(absl::StatusCode::kNotFound, HasSubstr("no function named \"nope\"")));
  ASSERT_OK(serve(protocol("ferry::rref::create", c, RRefId{1, 12}, TypeName<Counted>::get(), std::string("make"),
                           std::string("(string) -> x"), std::string("1")),
                  1));
  EXPECT_THAT(fetch(c, 1).status(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has signature")));
  // A fetch for another type than the value's.
  ASSERT_OK(create(RRefId{1, 4}, RRefId{1, 13}, 1, "make", 2));
  Message reply =
      ctx_->serve(registry_, protocol("ferry::rref::fetch", RRefId{1, 4}, std::string("float64")), agent_->worker(1));
  EXPECT_THAT(status_of(reply), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not a float64")));
  // Malformed and unknown protocol messages.
  EXPECT_THAT(serve(protocol("ferry::rref::fork", int8_t{1}), 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("RRef fork")));
  EXPECT_THAT(serve(protocol("ferry::rref::bogus"), 1),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"ferry::rref::bogus\"")));
}

TEST_F(RRefContextTest, AfterCloseProtocolMessagesAreRefused) {
  ASSERT_OK(create(RRefId{1, 1}, RRefId{1, 10}, 1));
  EXPECT_EQ(live.load(), 1);
  ctx_->close();
  EXPECT_EQ(live.load(), 0);
  EXPECT_THAT(create(RRefId{1, 2}, RRefId{1, 11}, 1),
              StatusIs(absl::StatusCode::kCancelled, HasSubstr("shutting down")));
}

}  // namespace
}  // namespace ferry::internal
