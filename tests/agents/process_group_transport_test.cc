// The process-group transport's own behaviour (agents/process_group/transport.h),
// beyond the agent conformance suite: how the end of a rank reaches the core. A rank
// that closes says goodbye, and the links to and from it end then, after what it sent
// before, naming it; a later connect to it, or a call through the agent, fails at once;
// a rank that dies without a goodbye still ends its links.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "agents/process_group/factory.h"
#include "agents/process_group/transport.h"
#include "gtest/gtest.h"
#include "store/file_store.h"
#include "tests/agents/transport_events.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;
using ::ferry::testing::Recorder;
using ::ferry::testing::Side;
using ::ferry::testing::StatusIs;
using ::ferry::testing::text;
using ::testing::HasSubstr;
using ::testing::Not;

std::shared_ptr<Store> file_store(const std::string& dir) {
  auto store = FileStore::create(dir + "/store", {});
  if (!store.ok()) throw std::runtime_error(std::string(store.status().message()));
  return std::shared_ptr<Store>(std::move(*store));
}

// Worker "w<rank>" of a group of `n` ranks over `store`, listening.
std::unique_ptr<Side> side(std::shared_ptr<Store> store, int rank, int n) {
  auto group = ProcessGroup::create(std::move(store), rank, n, seconds(20));
  if (!group.ok()) throw std::runtime_error(std::string(group.status().message()));
  auto made = internal::ProcessGroupTransport::create(absl::StrCat("w", rank),
                                                      std::shared_ptr<ProcessGroup>(std::move(*group)), 2);
  if (!made.ok()) throw std::runtime_error(std::string(made.status().message()));
  return std::make_unique<Side>(*std::move(made));
}

// The texts of what `events` received so far.
std::vector<std::string> texts(Recorder& events) {
  std::lock_guard<std::mutex> lock(events.mu_);
  std::vector<std::string> out;
  for (const Recorder::Received& r : events.received_) out.push_back(r.wire.metadata);
  return out;
}

size_t closes(Recorder& events) {
  std::lock_guard<std::mutex> lock(events.mu_);
  return events.closed_.size();
}

void wait_until_set(Store& store, const std::string& key) { ASSERT_OK(store.wait({key}, seconds(20))); }

// Opens this rank's link to the other one and sends a request on it; returns that link
// once the other rank's request came in here (null if it did not).
std::shared_ptr<Connection> call_each_other(Side& me, int rank) {
  std::shared_ptr<Connection> out =
      me.transport->connect(nullptr, absl::StrCat("w", 1 - rank), internal::process_group_address(1 - rank));
  out->write(text(absl::StrCat("request from w", rank)));
  Recorder& events = *me.events;
  if (!events.wait_for([&] { return events.accepted_.size() == 1 && !events.received_.empty(); })) return nullptr;
  return out;
}

// w0 and w1 call each other; w1 answers w0's request, then closes. w0 gets the answer,
// and then both of its links with w1 end, once each, saying w1 said goodbye.
TEST(ProcessGroupTransport, AGoodbyeEndsBothLinksOnceAfterWhatCameBefore) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Store> store = file_store(dir.path());
    std::unique_ptr<Side> me = side(store, rank, 2);
    Recorder& events = *me->events;
    std::shared_ptr<Connection> out = call_each_other(*me, rank);
    ASSERT_NE(out, nullptr) << "no request came from the other rank";
    if (rank == 1) {
      std::shared_ptr<Connection> in;
      {
        std::lock_guard<std::mutex> lock(events.mu_);
        in = events.accepted_[0];
      }
      in->write(text("reply from w1"));
      me->transport->close();  // sends what is queued, then the goodbye
      EXPECT_EQ(closes(events), 0u) << "a transport's own close() reports nothing";
      ASSERT_OK(store->set("closed", to_bytes("1")));
      return;
    }
    ASSERT_TRUE(events.wait_for([&] { return events.closed_.size() >= 2; })) << "w1's goodbye ended no link";
    // The reply came before the goodbye, and was delivered before the links ended.
    std::vector<std::string> got = texts(events);
    EXPECT_NE(std::find(got.begin(), got.end(), "reply from w1"), got.end());
    {
      std::lock_guard<std::mutex> lock(events.mu_);
      ASSERT_EQ(events.closed_.size(), 2u);
      EXPECT_TRUE(events.closed_[0].first == out || events.closed_[1].first == out);
      EXPECT_TRUE(events.closed_[0].first == events.accepted_[0] || events.closed_[1].first == events.accepted_[0]);
      for (const auto& [connection, why] : events.closed_) {
        EXPECT_THAT(why, StatusIs(absl::StatusCode::kUnavailable,
                                  HasSubstr("worker \"w1\" (rank 1) shut down: it said goodbye")));
      }
    }
    wait_until_set(*store, "closed");
    // A link opened after the goodbye ends at once, and nothing waits for w1.
    std::shared_ptr<Connection> again = me->transport->connect(nullptr, "w1", internal::process_group_address(1));
    ASSERT_EQ(closes(events), 3u) << "a connect to a rank that said goodbye did not end at once";
    {
      std::lock_guard<std::mutex> lock(events.mu_);
      EXPECT_EQ(events.closed_[2].first, again);
      EXPECT_THAT(events.closed_[2].second,
                  StatusIs(absl::StatusCode::kUnavailable,
                           HasSubstr("worker \"w1\" (rank 1) shut down: it said goodbye earlier, and a process "
                                     "group cannot reconnect to a rank that left")));
    }
    again->write(text("too late"));
    out->write(text("too late"));
    std::this_thread::sleep_for(milliseconds(200));
    EXPECT_EQ(closes(events), 3u) << "a link was reported closed twice";
    EXPECT_EQ(me->transport->debug_info().at("frames_sent"), "1") << "a frame went to a rank that left";
    // Nothing is left for w1 to drain: closing does not wait for it.
    auto start = std::chrono::steady_clock::now();
    me->transport->close();
    EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(3));
  }));
}

// A rank that only ever called us is named by its goodbye, which carries its name.
TEST(ProcessGroupTransport, AGoodbyeNamesAWorkerThatOnlyCalledUs) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Store> store = file_store(dir.path());
    std::unique_ptr<Side> me = side(store, rank, 2);
    Recorder& events = *me->events;
    if (rank == 1) {
      std::shared_ptr<Connection> out = me->transport->connect(nullptr, "w0", internal::process_group_address(0));
      out->write(text("request from w1"));
      wait_until_set(*store, "heard");
      me->transport->close();
      return;
    }
    ASSERT_TRUE(events.wait_for([&] { return events.accepted_.size() == 1 && !events.received_.empty(); }));
    ASSERT_OK(store->set("heard", to_bytes("1")));
    ASSERT_TRUE(events.wait_for([&] { return !events.closed_.empty(); })) << "w1's goodbye ended no link";
    {
      std::lock_guard<std::mutex> lock(events.mu_);
      EXPECT_EQ(events.closed_[0].first, events.accepted_[0]);
      EXPECT_THAT(events.closed_[0].second, StatusIs(absl::StatusCode::kUnavailable,
                                                     HasSubstr("worker \"w1\" (rank 1) shut down: it said goodbye")));
    }
    std::this_thread::sleep_for(milliseconds(200));
    EXPECT_EQ(closes(events), 1u);
  }));
}

// Without a goodbye (SIGKILL), the group's connection breaking ends the links: the
// worker is lost, not gone by choice.
TEST(ProcessGroupTransport, ARankThatDiesWithoutAGoodbyeEndsItsLinksAsLost) {
  ferry::testing::TempDir dir;
  std::vector<ferry::testing::ProcessResult> results = ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Store> store = file_store(dir.path());
    std::unique_ptr<Side> me = side(store, rank, 2);
    Recorder& events = *me->events;
    std::shared_ptr<Connection> out = call_each_other(*me, rank);
    ASSERT_NE(out, nullptr) << "no request came from the other rank";
    // Each has the other's request, so both links are open when w1 dies.
    ASSERT_OK(store->set(absl::StrCat("got/", rank), to_bytes("1")));
    wait_until_set(*store, absl::StrCat("got/", 1 - rank));
    if (rank == 1) raise(SIGKILL);
    ASSERT_TRUE(events.wait_for([&] { return events.closed_.size() >= 2; })) << "w1's death ended no link";
    std::lock_guard<std::mutex> lock(events.mu_);
    EXPECT_EQ(events.closed_.size(), 2u);
    for (const auto& [connection, why] : events.closed_) {
      EXPECT_EQ(why.code(), absl::StatusCode::kUnavailable) << why;
      EXPECT_THAT(why, Not(StatusIs(why.code(), HasSubstr("goodbye"))));
    }
  });
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[0].exited && results[0].exit_code == 0) << results[0].describe();
  EXPECT_EQ(results[1].term_signal, SIGKILL) << results[1].describe();
}

// Through the agent: a worker nobody called shuts down (its goodbye ends no link, as
// there is none), and a call to it afterwards, with no timeout, fails at once naming
// it rather than waiting on a rank whose group is gone.
TEST(ProcessGroupTransport, ACallToAWorkerThatSaidGoodbyeFailsAtOnceNamingIt) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    std::shared_ptr<Store> store = file_store(dir.path());
    auto group = ProcessGroup::create(store, rank, 2, seconds(20));
    ASSERT_OK(group.status());
    RequestHandler echo = [](const Message& m, const WorkerInfo&) {
      Message reply(MessageType::kResponse, 0);
      reply.buffer() += m.payload();
      return reply;
    };
    auto made = ProcessGroupAgent::create(std::shared_ptr<ProcessGroup>(std::move(*group)), store,
                                          absl::StrCat("w", rank), ProcessGroupAgentOptions{}, echo);
    ASSERT_OK(made.status());
    std::shared_ptr<Agent> agent = *made;
    if (rank == 1) {
      wait_until_set(*store, "up");  // w0 is past create(), its receivers long posted
      agent->shutdown();
      return;
    }
    ASSERT_OK(store->set("up", to_bytes("1")));
    // The goodbye is the only frame w0 receives.
    for (int i = 0; i < 2000 && agent->transport().debug_info().at("frames_received") != "1"; ++i) {
      std::this_thread::sleep_for(milliseconds(10));
    }
    ASSERT_EQ(agent->transport().debug_info().at("frames_received"), "1") << "w1's goodbye never came";
    auto start = std::chrono::steady_clock::now();
    Message hello(MessageType::kRequest, 0);
    hello.buffer() += "hello?";
    Future<Message> call = agent->send(1, std::move(hello), milliseconds(0));
    (void)call.wait_for(seconds(20));
    ASSERT_TRUE(call.is_ready()) << "a call to a worker that said goodbye had not ended after 20 s";
    EXPECT_THAT(call.status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("\"w1\"")));
    EXPECT_THAT(call.status(), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("said goodbye earlier")));
    EXPECT_LT(std::chrono::steady_clock::now() - start, seconds(2));
    agent->shutdown();
  }));
}

}  // namespace
}  // namespace ferry
