// The elastic rendezvous API (seed 001): its errors, RendezvousParameters, the handler
// registry, and the store-based dynamic handler (nodes as threads over one store; the
// launcher tests in tests/tools/run_command_test.cc run it as real processes).
#include "rendezvous/elastic.h"

#include <future>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rendezvous/store_handler.h"
#include "store/hash_store.h"
#include "store/tcp_store.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

// ---- errors -----------------------------------------------------------------------------

TEST(RendezvousErrorTest, EachKindRoundTripsWithItsCode) {
  struct Case {
    absl::Status status;
    RendezvousErrorKind kind;
    absl::StatusCode code;
  };
  std::vector<Case> cases = {
      {rendezvous_closed_error("c"), RendezvousErrorKind::kClosed, absl::StatusCode::kFailedPrecondition},
      {rendezvous_timeout_error("t"), RendezvousErrorKind::kTimeout, absl::StatusCode::kDeadlineExceeded},
      {rendezvous_connection_error("n"), RendezvousErrorKind::kConnection, absl::StatusCode::kUnavailable},
      {rendezvous_state_error("s"), RendezvousErrorKind::kState, absl::StatusCode::kDataLoss},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(rendezvous_error_kind(c.status), c.kind) << c.status;
    EXPECT_EQ(c.status.code(), c.code);
    EXPECT_TRUE(is_rendezvous_error(c.status));
  }
  EXPECT_EQ(rendezvous_error_kind_name(RendezvousErrorKind::kTimeout), "timeout");
  EXPECT_EQ(rendezvous_timeout_error("took too long").message(), "took too long");
}

TEST(RendezvousErrorTest, OtherStatusesAreNotRendezvousErrors) {
  EXPECT_FALSE(is_rendezvous_error(absl::OkStatus()));
  // The same code as a Timeout, but not one: the kind is in the payload, not the code.
  EXPECT_FALSE(is_rendezvous_error(absl::DeadlineExceededError("store get timed out")));
  EXPECT_EQ(rendezvous_error_kind(absl::UnavailableError("x")), std::nullopt);
}

// ---- RendezvousParameters -------------------------------------------------------------------

TEST(RendezvousParametersTest, KeepsWhatItWasGiven) {
  auto params = RendezvousParameters::create("store", "h:1", "run", 2, 3, {{"a", int64_t{1}}});
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->backend(), "store");
  EXPECT_EQ(params->endpoint(), "h:1");
  EXPECT_EQ(params->run_id(), "run");
  EXPECT_EQ(params->min_nodes(), 2);
  EXPECT_EQ(params->max_nodes(), 3);
  EXPECT_EQ(params->config().size(), 1u);
}

TEST(RendezvousParametersTest, RejectsWhatTheSeedRejects) {
  EXPECT_THAT(RendezvousParameters::create("", "h", "r", 1, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, "The rendezvous backend name must be a non-empty string."));
  EXPECT_THAT(RendezvousParameters::create("b", "h", "r", 0, 1),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "The minimum number of rendezvous nodes (0) must be greater than zero."));
  EXPECT_THAT(RendezvousParameters::create("b", "h", "r", 3, 2),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "The maximum number of rendezvous nodes (2) must be greater than or equal to the minimum "
                       "number of rendezvous nodes (3)."));
}

TEST(RendezvousParametersTest, GetReturnsTheValueOrTheDefault) {
  auto params = *RendezvousParameters::create("b", "h", "r", 1, 1, {{"k", std::string("v")}});
  EXPECT_EQ(params.get("k"), RendezvousConfigValue(std::string("v")));
  EXPECT_EQ(params.get("missing"), std::nullopt);
  EXPECT_EQ(params.get("missing", RendezvousConfigValue(int64_t{5})), RendezvousConfigValue(int64_t{5}));
}

TEST(RendezvousParametersTest, GetAsBool) {
  RendezvousConfig config;
  for (const char* t : {"1", "true", "T", "Yes", "y"}) config[std::string("t_") + t] = std::string(t);
  for (const char* f : {"0", "false", "F", "NO", "n"}) config[std::string("f_") + f] = std::string(f);
  config["b"] = true;
  config["i1"] = int64_t{1};
  config["i0"] = int64_t{0};
  config["i2"] = int64_t{2};
  config["bad"] = std::string("maybe");
  auto params = *RendezvousParameters::create("b", "h", "r", 1, 1, config);
  for (const char* t : {"1", "true", "T", "Yes", "y"}) {
    EXPECT_EQ(*params.get_as_bool(std::string("t_") + t), true) << t;
  }
  for (const char* f : {"0", "false", "F", "NO", "n"}) {
    EXPECT_EQ(*params.get_as_bool(std::string("f_") + f), false) << f;
  }
  EXPECT_EQ(*params.get_as_bool("b"), true);
  EXPECT_EQ(*params.get_as_bool("i1"), true);
  EXPECT_EQ(*params.get_as_bool("i0"), false);
  EXPECT_EQ(*params.get_as_bool("missing"), std::nullopt);
  EXPECT_EQ(*params.get_as_bool("missing", false), false);
  auto message = [](const std::string& key) {
    return "The rendezvous configuration option '" + key + "' does not represent a valid boolean value.";
  };
  EXPECT_THAT(params.get_as_bool("i2"), StatusIs(absl::StatusCode::kInvalidArgument, message("i2")));
  EXPECT_THAT(params.get_as_bool("bad"), StatusIs(absl::StatusCode::kInvalidArgument, message("bad")));
}

TEST(RendezvousParametersTest, GetAsInt) {
  auto params = *RendezvousParameters::create(
      "b", "h", "r", 1, 1,
      {{"i", int64_t{-4}}, {"s", std::string(" 12 ")}, {"b", true}, {"bad", std::string("12x")}, {"neg", std::string("-3")}});
  EXPECT_EQ(*params.get_as_int("i"), -4);
  EXPECT_EQ(*params.get_as_int("s"), 12);
  EXPECT_EQ(*params.get_as_int("b"), 1);
  EXPECT_EQ(*params.get_as_int("missing"), std::nullopt);
  EXPECT_EQ(*params.get_as_int("missing", 9), 9);
  EXPECT_THAT(params.get_as_int("bad"),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "The rendezvous configuration option 'bad' does not represent a valid integer value."));
  EXPECT_EQ(*params.get_as_seconds("s", 1s), 12s);
  EXPECT_EQ(*params.get_as_seconds("missing", 7s), 7s);
  EXPECT_THAT(params.get_as_seconds("neg", 1s),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'neg' must be a number of seconds >= 0, got -3")));
}

// ---- the registry ----------------------------------------------------------------------------

// A handler that only names its backend, for the registry's checks.
class NamedHandler : public RendezvousHandler {
 public:
  explicit NamedHandler(std::string backend) : backend_(std::move(backend)) {}
  std::string get_backend() const override { return backend_; }
  absl::StatusOr<RendezvousInfo> next_rendezvous() override { return rendezvous_closed_error("test handler"); }
  absl::StatusOr<bool> is_closed() override { return true; }
  absl::Status set_closed() override { return absl::OkStatus(); }
  absl::StatusOr<int> num_nodes_waiting() override { return 0; }
  std::string get_run_id() const override { return "test"; }
  bool shutdown() override { return true; }

 private:
  std::string backend_;
};

absl::StatusOr<std::unique_ptr<RendezvousHandler>> make_named(const RendezvousParameters& params) {
  return std::make_unique<NamedHandler>(params.backend());
}
absl::StatusOr<std::unique_ptr<RendezvousHandler>> make_other(const RendezvousParameters&) {
  return std::make_unique<NamedHandler>("other");
}
absl::StatusOr<std::unique_ptr<RendezvousHandler>> make_error(const RendezvousParameters&) {
  return absl::PermissionDeniedError("no handler for you");
}

TEST(RendezvousHandlerRegistryTest, RegistersAndCreates) {
  RendezvousHandlerRegistry registry;
  EXPECT_FALSE(registry.is_registered("mine"));
  ASSERT_TRUE(registry.register_handler("mine", &make_named).ok());
  EXPECT_TRUE(registry.is_registered("mine"));
  // The same creator again is fine, as in the seed.
  EXPECT_TRUE(registry.register_handler("mine", &make_named).ok());
  auto handler = registry.create_handler(*RendezvousParameters::create("mine", "", "r", 1, 1));
  ASSERT_TRUE(handler.ok()) << handler.status();
  EXPECT_EQ((*handler)->get_backend(), "mine");
}

TEST(RendezvousHandlerRegistryTest, RejectsWhatTheSeedRejects) {
  RendezvousHandlerRegistry registry;
  EXPECT_THAT(registry.register_handler("", &make_named),
              StatusIs(absl::StatusCode::kInvalidArgument, "The rendezvous backend name must be a non-empty string."));
  EXPECT_THAT(registry.register_handler("x", nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("cannot be registered with a null creator")));
  ASSERT_TRUE(registry.register_handler("mine", &make_named).ok());
  EXPECT_THAT(registry.register_handler("mine", &make_other),
              StatusIs(absl::StatusCode::kAlreadyExists,
                       HasSubstr("The rendezvous backend 'mine' cannot be registered with creator ")));
  EXPECT_THAT(registry.create_handler(*RendezvousParameters::create("nope", "", "r", 1, 1)),
              StatusIs(absl::StatusCode::kNotFound, "The rendezvous backend 'nope' is not registered. Did you "
                                                    "forget to call `register_handler`?"));
  ASSERT_TRUE(registry.register_handler("liar", &make_other).ok());
  EXPECT_THAT(registry.create_handler(*RendezvousParameters::create("liar", "", "r", 1, 1)),
              StatusIs(absl::StatusCode::kInternal,
                       "The rendezvous backend 'other' does not match the requested backend 'liar'."));
  ASSERT_TRUE(registry.register_handler("failing", &make_error).ok());
  EXPECT_THAT(registry.create_handler(*RendezvousParameters::create("failing", "", "r", 1, 1)),
              StatusIs(absl::StatusCode::kPermissionDenied, "no handler for you"));
}

TEST(RendezvousHandlerRegistryTest, TheGlobalRegistryHasTheStoreBackend) {
  EXPECT_TRUE(rendezvous_handler_registry().is_registered("store"));
  EXPECT_THAT(rendezvous_handler_registry().register_handler("store", &make_named),
              StatusIs(absl::StatusCode::kAlreadyExists));
}

// ---- the store handler ------------------------------------------------------------------------

StoreRendezvousOptions options(std::string run_id, int min_nodes, int max_nodes,
                               std::chrono::milliseconds last_call = 100ms,
                               std::chrono::milliseconds join_timeout = 20s) {
  StoreRendezvousOptions o;
  o.run_id = std::move(run_id);
  o.min_nodes = min_nodes;
  o.max_nodes = max_nodes;
  o.last_call_timeout = last_call;
  o.join_timeout = join_timeout;
  o.shutdown_timeout = 5s;
  return o;
}

std::vector<std::unique_ptr<StoreRendezvousHandler>> make_nodes(const std::shared_ptr<Store>& store, int n,
                                                                 const StoreRendezvousOptions& o) {
  std::vector<std::unique_ptr<StoreRendezvousHandler>> nodes;
  for (int i = 0; i < n; ++i) nodes.push_back(*StoreRendezvousHandler::create(store, o));
  return nodes;
}

// next_rendezvous() of each node on its own thread; the results in node order.
std::vector<absl::StatusOr<RendezvousInfo>> rendezvous_all(
    const std::vector<StoreRendezvousHandler*>& nodes) {
  std::vector<std::future<absl::StatusOr<RendezvousInfo>>> futures;
  for (StoreRendezvousHandler* node : nodes) {
    futures.push_back(std::async(std::launch::async, [node] { return node->next_rendezvous(); }));
  }
  std::vector<absl::StatusOr<RendezvousInfo>> results;
  for (auto& f : futures) {
    if (f.wait_for(30s) != std::future_status::ready) {
      ADD_FAILURE() << "next_rendezvous did not return";
      std::abort();  // a thread stuck in it cannot be joined
    }
    results.push_back(f.get());
  }
  return results;
}

std::vector<StoreRendezvousHandler*> raw(const std::vector<std::unique_ptr<StoreRendezvousHandler>>& nodes) {
  std::vector<StoreRendezvousHandler*> out;
  for (const auto& n : nodes) out.push_back(n.get());
  return out;
}

// Waits (bounded) until `predicate` holds; the handler's state changes on other threads.
template <typename Predicate>
bool eventually(Predicate predicate) {
  auto deadline = std::chrono::steady_clock::now() + 20s;
  while (std::chrono::steady_clock::now() < deadline) {
    if (predicate()) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

TEST(StoreRendezvousHandlerTest, MaxNodesCompleteARoundWithDistinctRanks) {
  auto store = std::make_shared<HashStore>();
  auto nodes = make_nodes(store, 3, options("full", 2, 3, 60s));  // max reached: no last call
  auto results = rendezvous_all(raw(nodes));
  std::set<int> ranks;
  for (auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->world_size, 3);
    ranks.insert(r->rank);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  // The round's store is shared by its members.
  ASSERT_TRUE(results[0]->store->set("hello", to_bytes("world")).ok());
  EXPECT_EQ(to_string(*results[2]->store->get("hello", 1s)), "world");
  EXPECT_EQ(nodes[0]->round(), 0);
  EXPECT_EQ(nodes[0]->get_backend(), "store");
  EXPECT_EQ(nodes[0]->get_run_id(), "full");
}

TEST(StoreRendezvousHandlerTest, MinNodesCompleteARoundAfterTheLastCall) {
  auto store = std::make_shared<HashStore>();
  auto nodes = make_nodes(store, 2, options("min", 2, 4, 100ms));
  auto results = rendezvous_all(raw(nodes));
  for (auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->world_size, 2);
  }
}

TEST(StoreRendezvousHandlerTest, ALateNodeWaitsAndIsAdmittedAtTheNextRound) {
  auto store = std::make_shared<HashStore>();
  // min 1: the late node could form a round of its own if the handler let it.
  auto o = options("late", 1, 3, 50ms);
  auto nodes = make_nodes(store, 3, o);
  auto first = rendezvous_all({nodes[0].get(), nodes[1].get()});
  for (auto& r : first) ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(*nodes[0]->num_nodes_waiting(), 0);

  auto late = std::async(std::launch::async, [&] { return nodes[2]->next_rendezvous(); });
  ASSERT_TRUE(eventually([&] { return *nodes[0]->num_nodes_waiting() == 1; }));
  EXPECT_EQ(*nodes[1]->num_nodes_waiting(), 1);
  // Well past its last call, the late node is still waiting: only members open a round.
  EXPECT_EQ(late.wait_for(300ms), std::future_status::timeout);

  auto second = rendezvous_all({nodes[0].get(), nodes[1].get()});
  ASSERT_EQ(late.wait_for(20s), std::future_status::ready);
  auto late_result = late.get();
  ASSERT_TRUE(late_result.ok()) << late_result.status();
  std::set<int> ranks{late_result->rank};
  EXPECT_EQ(late_result->world_size, 3);
  for (auto& r : second) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->world_size, 3);
    ranks.insert(r->rank);
  }
  EXPECT_EQ(ranks, (std::set<int>{0, 1, 2}));
  EXPECT_EQ(nodes[0]->round(), 1);
  // A new round's store is not the old one's.
  ASSERT_TRUE(first[0]->store->set("k", to_bytes("old")).ok());
  EXPECT_FALSE(*second[0]->store->check({"k"}));
}

TEST(StoreRendezvousHandlerTest, ANewcomerToAFullJobWaitsForRoomWithoutDisturbingIt) {
  auto store = std::make_shared<HashStore>();
  auto nodes = make_nodes(store, 2, options("full-job", 1, 2, 50ms));
  for (auto& r : rendezvous_all(raw(nodes))) ASSERT_TRUE(r.ok()) << r.status();
  auto newcomer = *StoreRendezvousHandler::create(store, options("full-job", 1, 2, 50ms, 300ms));
  auto result = newcomer->next_rendezvous();
  EXPECT_EQ(rendezvous_error_kind(result.status()), RendezvousErrorKind::kTimeout) << result.status();
  EXPECT_THAT(result.status().message(),
              HasSubstr("timed out after 300ms: the job is full (2 running node(s), 0 waiting, max 2)"));
  // The running members were never asked to make room.
  EXPECT_EQ(*nodes[0]->num_nodes_waiting(), 0);
  EXPECT_FALSE(*store->check({"ferry/rdzv/full-job/r1/joined"}));
}

TEST(StoreRendezvousHandlerTest, ANewcomerFindsRoomBesideAMemberThatAlreadyRejoined) {
  auto store = std::make_shared<HashStore>();
  // A last call long enough that only max_nodes completes round 1, whoever comes when.
  auto o = options("room", 2, 3, 60s);
  auto nodes = make_nodes(store, 3, o);
  // Round 0 with two nodes: completed here by hand, as the last call would, but now.
  auto first = std::async(std::launch::async, [&] { return rendezvous_all({nodes[0].get(), nodes[1].get()}); });
  ASSERT_TRUE(eventually([&] { return *store->add("ferry/rdzv/room/r0/joined", 0) == 2; }));
  ASSERT_TRUE(store->compare_set("ferry/rdzv/room/r0/sealed", {}, to_bytes("2")).ok());
  for (int e = 1; e <= 4; ++e) ASSERT_TRUE(store->set("ferry/rdzv/room/r0/event/" + std::to_string(e), {}).ok());
  ASSERT_EQ(first.wait_for(20s), std::future_status::ready);
  for (auto& r : first.get()) ASSERT_TRUE(r.ok()) << r.status();
  // Member 0 leaves for round 1 first; the newcomer then counts the running round's two
  // members, not member 0 twice, and joins.
  auto member0 = std::async(std::launch::async, [&] { return nodes[0]->next_rendezvous(); });
  ASSERT_TRUE(eventually([&] { return *store->check({"ferry/rdzv/room/r1/opened"}); }));
  auto newcomer = std::async(std::launch::async, [&] { return nodes[2]->next_rendezvous(); });
  ASSERT_TRUE(eventually([&] { return *store->check({"ferry/rdzv/room/r1/newcomers"}); }));
  EXPECT_EQ(*nodes[1]->num_nodes_waiting(), 2);
  auto member1 = nodes[1]->next_rendezvous();
  ASSERT_EQ(member0.wait_for(20s), std::future_status::ready);
  ASSERT_EQ(newcomer.wait_for(20s), std::future_status::ready);
  for (auto r : {member0.get(), newcomer.get(), member1}) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->world_size, 3);
  }
}

TEST(StoreRendezvousHandlerTest, AMemberRejoiningStartsANewRoundTheOthersSee) {
  auto store = std::make_shared<HashStore>();
  auto nodes = make_nodes(store, 2, options("rejoin", 2, 2));
  for (auto& r : rendezvous_all(raw(nodes))) ASSERT_TRUE(r.ok()) << r.status();
  // Node 0's workers failed: it re-rendezvous; node 1 sees it waiting, and follows.
  auto again = std::async(std::launch::async, [&] { return nodes[0]->next_rendezvous(); });
  ASSERT_TRUE(eventually([&] { return *nodes[1]->num_nodes_waiting() == 1; }));
  auto follow = nodes[1]->next_rendezvous();
  ASSERT_EQ(again.wait_for(20s), std::future_status::ready);
  auto first = again.get();
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_TRUE(follow.ok()) << follow.status();
  EXPECT_EQ(first->world_size, 2);
  EXPECT_NE(first->rank, follow->rank);
  EXPECT_EQ(nodes[1]->round(), 1);
}

TEST(StoreRendezvousHandlerTest, TooFewNodesTimeOutWithAClearMessage) {
  auto store = std::make_shared<HashStore>();
  auto node = *StoreRendezvousHandler::create(store, options("few", 2, 3, 50ms, 300ms));
  auto result = node->next_rendezvous();
  EXPECT_EQ(rendezvous_error_kind(result.status()), RendezvousErrorKind::kTimeout) << result.status();
  EXPECT_THAT(result.status().message(),
              HasSubstr("rendezvous of run 'few' timed out after 300ms in round 0: 1 node(s) joined, at least 2 "
                        "needed (min 2, max 3)"));
}

TEST(StoreRendezvousHandlerTest, ClosingEndsEveryWaitAndEveryLaterRound) {
  auto store = std::make_shared<HashStore>();
  auto nodes = make_nodes(store, 2, options("closing", 2, 2, 50ms, 60s));
  auto waiting = std::async(std::launch::async, [&] { return nodes[0]->next_rendezvous(); });
  EXPECT_FALSE(*nodes[1]->is_closed());
  ASSERT_TRUE(nodes[1]->set_closed().ok());
  // The waiter wakes long before its 60 s join timeout.
  ASSERT_EQ(waiting.wait_for(20s), std::future_status::ready);
  auto result = waiting.get();
  EXPECT_EQ(rendezvous_error_kind(result.status()), RendezvousErrorKind::kClosed) << result.status();
  EXPECT_THAT(result.status().message(), HasSubstr("rendezvous of run 'closing' is closed"));
  EXPECT_TRUE(*nodes[0]->is_closed());
  EXPECT_EQ(rendezvous_error_kind(nodes[1]->next_rendezvous().status()), RendezvousErrorKind::kClosed);
}

TEST(StoreRendezvousHandlerTest, TheRunIdScopesEveryKey) {
  auto store = std::make_shared<HashStore>();
  // Two runs of one node each on one store, each needing two: they must not combine.
  auto a = *StoreRendezvousHandler::create(store, options("run-a", 2, 2, 50ms, 300ms));
  auto b = *StoreRendezvousHandler::create(store, options("run-b", 2, 2, 50ms, 300ms));
  auto results = rendezvous_all({a.get(), b.get()});
  for (auto& r : results) EXPECT_EQ(rendezvous_error_kind(r.status()), RendezvousErrorKind::kTimeout) << r.status();
  EXPECT_TRUE(*store->check({"ferry/rdzv/run-a/r0/joined", "ferry/rdzv/run-b/r0/joined"}));
  ASSERT_TRUE(a->set_closed().ok());
  EXPECT_TRUE(*a->is_closed());
  EXPECT_FALSE(*b->is_closed());
}

TEST(StoreRendezvousHandlerTest, ACorruptRoundIsAStateError) {
  auto store = std::make_shared<HashStore>();
  auto node = *StoreRendezvousHandler::create(store, options("bad", 2, 2, 50ms, 60s));
  auto result = std::async(std::launch::async, [&] { return node->next_rendezvous(); });
  // Once the node is in round 0, something writes junk as the round's member count and
  // announces it.
  ASSERT_TRUE(eventually([&] { return *store->check({"ferry/rdzv/bad/r0/joined"}); }));
  ASSERT_TRUE(store->compare_set("ferry/rdzv/bad/r0/sealed", {}, to_bytes("many")).ok());
  for (int e = 1; e <= 3; ++e) ASSERT_TRUE(store->set("ferry/rdzv/bad/r0/event/" + std::to_string(e), {}).ok());
  ASSERT_EQ(result.wait_for(20s), std::future_status::ready);
  auto r = result.get();
  EXPECT_EQ(rendezvous_error_kind(r.status()), RendezvousErrorKind::kState) << r.status();
  EXPECT_THAT(r.status().message(), HasSubstr("round 0 holds a member count of \"many\" (expected 1..2)"));
}

TEST(StoreRendezvousHandlerTest, ALostStoreIsAConnectionError) {
  auto server = *TCPStoreServer::create({"127.0.0.1", 0});
  std::shared_ptr<Store> store = *TCPStore::create("127.0.0.1", server->port(), false, std::nullopt, 5s);
  auto node = *StoreRendezvousHandler::create(store, options("lost", 1, 1));
  server->shutdown();
  auto result = node->next_rendezvous();
  EXPECT_EQ(rendezvous_error_kind(result.status()), RendezvousErrorKind::kConnection) << result.status();
  EXPECT_EQ(result.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(rendezvous_error_kind(node->is_closed().status()), RendezvousErrorKind::kConnection);
}

TEST(StoreRendezvousHandlerTest, RejectsBadOptions) {
  auto store = std::make_shared<HashStore>();
  EXPECT_THAT(StoreRendezvousHandler::create(store, options("", 1, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("run id must not be empty")));
  EXPECT_THAT(StoreRendezvousHandler::create(store, options("r", 0, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be greater than zero")));
  EXPECT_THAT(StoreRendezvousHandler::create(store, options("r", 2, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("greater than or equal to the minimum")));
  EXPECT_THAT(StoreRendezvousHandler::create(store, options("r", 1, 1, -1ms)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("last_call_timeout must not be negative")));
  EXPECT_THAT(StoreRendezvousHandler::create(nullptr, options("r", 1, 1)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no store given")));
}

TEST(StoreRendezvousHandlerTest, FromParametersHostsTheStoreOrJoinsIt) {
  RendezvousConfig config{{"join_timeout", int64_t{20}}, {"last_call_timeout", std::string("0")}};
  // Port 0: host on a free port; the second node joins at the port the first bound.
  auto host = rendezvous_handler_registry().create_handler(
      *RendezvousParameters::create("store", "127.0.0.1:0", "params", 2, 2, config));
  ASSERT_TRUE(host.ok()) << host.status();
  auto* hosting = dynamic_cast<StoreRendezvousHandler*>(host->get());
  ASSERT_NE(hosting, nullptr);
  EXPECT_TRUE(hosting->hosts_store());
  auto guest = rendezvous_handler_registry().create_handler(
      *RendezvousParameters::create("store", hosting->endpoint(), "params", 2, 2, config));
  ASSERT_TRUE(guest.ok()) << guest.status();
  auto* joining = dynamic_cast<StoreRendezvousHandler*>(guest->get());
  EXPECT_FALSE(joining->hosts_store());  // the port is taken: it is a client
  auto results = rendezvous_all({hosting, joining});
  for (auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->world_size, 2);
  }
  // Shutting down: the last node out closes the run; the host waits for the guest.
  auto host_done = std::async(std::launch::async, [&] { return hosting->shutdown(); });
  EXPECT_TRUE(joining->shutdown());
  ASSERT_EQ(host_done.wait_for(20s), std::future_status::ready);
  EXPECT_TRUE(host_done.get());
}

TEST(StoreRendezvousHandlerTest, FromParametersRejectsBadEndpointsAndConfig) {
  auto make = [](std::string endpoint, RendezvousConfig config = {}) {
    return rendezvous_handler_registry().create_handler(
        *RendezvousParameters::create("store", std::move(endpoint), "r", 1, 1, std::move(config)));
  };
  EXPECT_THAT(make(":1"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has no host (expected HOST[:PORT])")));
  EXPECT_THAT(make("h:x"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("port \"x\" is not a number")));
  EXPECT_THAT(make("::1:5"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("in brackets")));
  EXPECT_THAT(make("127.0.0.1:0", {{"is_host", false}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("but is_host is false")));
  EXPECT_THAT(make("127.0.0.1:0", {{"join_timeout", std::string("x")}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'join_timeout' does not represent")));
  // Nothing listens there and hosting is forbidden: a Connection error naming the endpoint.
  auto unreachable = make("127.0.0.1:1", {{"is_host", false}, {"join_timeout", int64_t{0}}});
  EXPECT_EQ(rendezvous_error_kind(unreachable.status()), RendezvousErrorKind::kConnection) << unreachable.status();
  EXPECT_THAT(unreachable.status().message(), HasSubstr("cannot reach the store at 127.0.0.1:1"));
}

}  // namespace
}  // namespace ferry
