// The transport registry (agents/core/registry.h) with the built-in transports
// registered (backends/builtin.cc): its refusals, the defaults (the ring for this
// host's peers, TensorPipe beyond), `transports` and FERRY_TRANSPORTS, and a transport
// defined here, registered by one line, that init_rpc then uses between two processes.
#include "agents/core/registry.h"

#include <atomic>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "agents/core/agent.h"
#include "agents/ring/factory.h"
#include "backends/backend_registry.h"
#include "backends/tensorpipe/tensorpipe_backend.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "store/hash_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;
using namespace std::chrono_literals;

// A test-only transport: the ring underneath, under a name of its own, counting the
// connections it opens and accepts (in debug_info, so that a test can tell its calls
// went through it; the ring carries calls both ways on one connection, so a worker may
// only accept one).
class CountedTransport final : public Transport {
 public:
  explicit CountedTransport(const std::string& worker) : inner_(make_ring_transport(worker)) {}

  absl::StatusOr<std::string> listen(std::weak_ptr<TransportEvents> events) override {
    events_ = std::make_shared<CountingEvents>(std::move(events), connections_);
    return inner_->listen(events_);
  }
  std::shared_ptr<Connection> connect(std::shared_ptr<internal::Session> session, const std::string& peer_name,
                                      const std::string& address) override {
    connections_->fetch_add(1);
    return inner_->connect(std::move(session), peer_name, address);
  }
  bool reaches(const std::string& address) const override { return inner_->reaches(address); }
  void close() override { inner_->close(); }
  std::map<std::string, std::string> debug_info() const override {
    std::map<std::string, std::string> info = inner_->debug_info();
    info["transports"] = "counted";
    info["counted_connections"] = std::to_string(connections_->load());
    return info;
  }

 private:
  // The core's events, passed on; accepted connections counted.
  class CountingEvents final : public TransportEvents {
   public:
    CountingEvents(std::weak_ptr<TransportEvents> core, std::shared_ptr<std::atomic<int>> count)
        : core_(std::move(core)), count_(std::move(count)) {}
    void on_accepted(const std::shared_ptr<Connection>& connection) override {
      count_->fetch_add(1);
      if (auto core = core_.lock()) core->on_accepted(connection);
    }
    absl::Status on_header(Connection& connection, uint64_t metadata_bytes,
                           std::span<const uint64_t> tensor_bytes) override {
      auto core = core_.lock();
      return core ? core->on_header(connection, metadata_bytes, tensor_bytes) : absl::CancelledError("gone");
    }
    void on_message(const std::shared_ptr<Connection>& connection, Wire wire) override {
      if (auto core = core_.lock()) core->on_message(connection, std::move(wire));
    }
    void on_closed(const std::shared_ptr<Connection>& connection, absl::Status why) override {
      if (auto core = core_.lock()) core->on_closed(connection, std::move(why));
    }

   private:
    std::weak_ptr<TransportEvents> core_;
    std::shared_ptr<std::atomic<int>> count_;
  };

  std::unique_ptr<Transport> inner_;
  std::shared_ptr<std::atomic<int>> connections_ = std::make_shared<std::atomic<int>>(0);
  std::shared_ptr<CountingEvents> events_;
};

TransportEntry counted_entry() {
  return TransportEntry{
      .names = {"counted"},
      .rank = 50,
      .reaches = &ring_reaches,
      .make = [](const TransportArgs& args) -> absl::StatusOr<std::unique_ptr<Transport>> {
        return std::make_unique<CountedTransport>(args.worker_name);
      }};
}

// A transport whose maker is never meant to run.
TransportEntry unused_entry(std::vector<std::string> names) {
  return TransportEntry{
      .names = std::move(names),
      .rank = 1000,  // after the built-ins
      .reaches = [](const std::string&) { return false; },
      .make = [](const TransportArgs&) -> absl::StatusOr<std::unique_ptr<Transport>> {
        return absl::InternalError("not made in these tests");
      }};
}

// The names chosen for `listed`; none (and a failure) on an error.
std::vector<std::string> chosen(const std::optional<std::vector<std::string>>& listed) {
  absl::StatusOr<std::vector<std::string>> names = chosen_transports(listed);
  EXPECT_OK(names.status());
  return names.ok() ? *names : std::vector<std::string>();
}

Message hi(const Message& m, const WorkerInfo&) {
  Message reply(MessageType::kResponse, m.id());
  reply.buffer() += "hi";
  return reply;
}

// An agent over what the registry makes for `transports`.
absl::StatusOr<std::shared_ptr<Agent>> start_agent(std::shared_ptr<Store> store, const std::string& name, int rank,
                                                   std::optional<std::vector<std::string>> transports) {
  TransportArgs args;
  args.worker_name = name;
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<Transport> transport, make_transport(transports, args));
  return Agent::start(WorkerInfo{name, rank}, std::move(store), AgentOptions{}, hi, std::move(transport));
}

TEST(TransportRegistry, TheBuiltInsAreRegisteredInRankOrder) {
  register_builtin_transports();
  std::vector<std::string> names = registered_transports();
  ASSERT_GE(names.size(), 4u);
  EXPECT_TRUE(transport_registered("ring"));
  EXPECT_TRUE(transport_registered("uv"));
  EXPECT_FALSE(transport_registered("carrier-pigeon"));
  const auto at = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) - names.begin(); };
  EXPECT_LT(at("ring"), at("tcp"));
  EXPECT_LT(at("tcp"), at("shm"));
  EXPECT_LT(at("shm"), at("ibv"));
  EXPECT_LT(at("ibv"), at("uv"));
}

TEST(TransportRegistry, ADuplicateNameIsRefusedAndNothingOfTheEntryIsRegistered) {
  register_builtin_transports();
  EXPECT_THAT(register_transport(ring_transport_entry()),
              StatusIs(absl::StatusCode::kAlreadyExists, "transport \"ring\": already registered"));
  // "dup-a" is new, "uv" is not: the whole entry is refused.
  EXPECT_THAT(register_transport(unused_entry({"dup-a", "uv"})),
              StatusIs(absl::StatusCode::kAlreadyExists, "transport \"uv\": already registered"));
  EXPECT_FALSE(transport_registered("dup-a"));
  // A name of its own per run, so that the test also passes with --gtest_repeat.
  static int run = 0;
  const std::string mine = "dup-b" + std::to_string(run++);
  ASSERT_OK(register_transport(unused_entry({mine})));
  EXPECT_THAT(register_transport(unused_entry({mine})),
              StatusIs(absl::StatusCode::kAlreadyExists, "transport \"" + mine + "\": already registered"));
}

TEST(TransportRegistry, AnIllFormedEntryIsRefusedSayingWhy) {
  EXPECT_THAT(register_transport(unused_entry({})),
              StatusIs(absl::StatusCode::kInvalidArgument, "a transport must have at least one name"));
  EXPECT_THAT(register_transport(unused_entry({"a b"})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "transport name \"a b\" is not valid (expected letters, digits, '_' or '-')"));
  EXPECT_THAT(register_transport(unused_entry({"twice", "twice"})),
              StatusIs(absl::StatusCode::kInvalidArgument, "transport \"twice\" is named twice in one entry"));
  TransportEntry no_maker = unused_entry({"no-maker"});
  no_maker.make = nullptr;
  EXPECT_THAT(register_transport(no_maker),
              StatusIs(absl::StatusCode::kInvalidArgument, "transport \"no-maker\": no maker"));
  TransportEntry no_reaches = unused_entry({"no-reaches"});
  no_reaches.reaches = nullptr;
  EXPECT_THAT(register_transport(no_reaches),
              StatusIs(absl::StatusCode::kInvalidArgument, "transport \"no-reaches\": no reaches function"));
  TransportEntry stray = unused_entry({"stray"});
  stray.same_host_names = {"elsewhere"};
  EXPECT_THAT(register_transport(stray),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       "transport \"stray\": same-host name \"elsewhere\" is not one of its names"));
}

TEST(TransportRegistry, AnUnknownNameIsRefusedNamingTheRegisteredOnes) {
  register_builtin_transports();
  EXPECT_THAT(chosen_transports(std::vector<std::string>{"ring", "carrier-pigeon"}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("transports: unknown transport \"carrier-pigeon\" (registered: ring, "),
                             HasSubstr("shm, ibv, uv"))));
  EXPECT_THAT(chosen_transports(std::vector<std::string>{}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("transports names no transport (expected some of: ")));
  EXPECT_THAT(chosen_transports(std::vector<std::string>{"uv", "uv"}),
              StatusIs(absl::StatusCode::kInvalidArgument, "transports lists transport \"uv\" twice"));
  // Through the backend's options: at construction, before anything starts.
  register_builtin_backends();
  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout, "env://",
                                            {{"transports", std::vector<std::string>{"carrier-pigeon"}}}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown transport \"carrier-pigeon\" (registered: ring, ")));
  EXPECT_THAT(construct_rpc_backend_options(BackendType::TENSORPIPE, kDefaultRpcTimeout, "env://",
                                            {{"channels", std::vector<std::string>{"telepathy"}}}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("unknown channel \"telepathy\"")));
}

// The defaults: the ring for this host's peers and tcp for the rest, without
// TensorPipe's shm (the ring serves its peers) or its network transports (tcp serves
// theirs); the list given, in rank order.
TEST(TransportRegistry, TheDefaultsAreTheRingThenTcp) {
  register_builtin_transports();
  unsetenv("FERRY_TRANSPORTS");
  EXPECT_THAT(chosen(std::nullopt), ElementsAre("ring", "tcp"));
  EXPECT_THAT(chosen(std::vector<std::string>{"uv", "ring", "shm"}), ElementsAre("ring", "shm", "uv"));
  EXPECT_THAT(chosen(std::vector<std::string>{"uv", "tcp"}), ElementsAre("tcp", "uv"));
}

TEST(TransportRegistry, AnOtherHostNameMustBeOneOfTheEntrysNames) {
  TransportEntry bad = unused_entry({"odd-net"});
  bad.other_host_names = {"not-its-name"};
  EXPECT_THAT(register_transport(std::move(bad)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("other-host name \"not-its-name\"")));
}

TEST(TransportRegistry, FerryTransportsForcesTheChoice) {
  register_builtin_transports();
  setenv("FERRY_TRANSPORTS", "shm, uv", 1);
  EXPECT_THAT(chosen(std::nullopt), ElementsAre("shm", "uv"));
  // The option wins over the environment.
  EXPECT_THAT(chosen(std::vector<std::string>{"ring"}), ElementsAre("ring"));
  setenv("FERRY_TRANSPORTS", "ring,carrier-pigeon", 1);
  EXPECT_THAT(chosen_transports(std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("FERRY_TRANSPORTS=\"ring,carrier-pigeon\": unknown transport \"carrier-pigeon\" "
                                 "(registered: ")));
  auto store = std::make_shared<HashStore>();
  EXPECT_THAT(start_agent(store, "bogus", 0, std::nullopt),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("carrier-pigeon")));
  setenv("FERRY_TRANSPORTS", "ring", 1);
  auto ring_only = start_agent(store, "a", 0, std::nullopt);
  unsetenv("FERRY_TRANSPORTS");
  ASSERT_OK(ring_only.status());
  EXPECT_EQ((*ring_only)->debug_info().at("transports"), "ring");
  (*ring_only)->shutdown();
}

// By default a worker reaches a peer on its host by the ring, and one that listens
// only on TCP by tcp: the first transport whose entry reaches its record.
TEST(TransportRegistry, EachPeerIsReachedByTheFirstTransportThatReachesIt) {
  register_builtin_transports();
  unsetenv("FERRY_TRANSPORTS");
  auto store = std::make_shared<HashStore>();
  auto a = start_agent(store, "a", 0, std::nullopt);
  auto b = start_agent(store, "b", 1, std::nullopt);
  auto c = start_agent(store, "c", 2, std::vector<std::string>{"tcp"});
  ASSERT_OK(a.status());
  ASSERT_OK(b.status());
  ASSERT_OK(c.status());
  EXPECT_THAT((*a)->debug_info().at("transports"), StartsWith("ring,"));
  EXPECT_THAT((*a)->debug_info().at("transports"), ::testing::Not(HasSubstr("shm")));
  EXPECT_EQ((*c)->debug_info().at("transports"), "tcp");
  std::vector<PeerAddress> members;
  for (auto* agent : {&*a, &*b, &*c}) members.push_back(PeerAddress{(*agent)->self(), (*agent)->address()});
  for (auto* agent : {&*a, &*b, &*c}) ASSERT_OK((*agent)->set_members(members));
  ASSERT_OK((*a)->send(1, Message(MessageType::kRequest, 0), 20s).result().status());
  ASSERT_OK((*a)->send(2, Message(MessageType::kRequest, 0), 20s).result().status());
  EXPECT_EQ((*a)->debug_info().at("ring_opened"), "1");  // to b; c is reached over TCP
  EXPECT_EQ((*a)->debug_info().at("tcp_opened"), "1");
  // And it says which: in debug_info (and the metrics, and one info line per peer).
  EXPECT_EQ((*a)->debug_info().at("transports_by_peer"), "b:ring,c:tcp");
  for (auto* agent : {&*a, &*b, &*c}) (*agent)->shutdown();
}

// A transport defined in this file, registered by one line, is what init_rpc builds
// when `transports` names it: the calls between two processes go through it.
TEST(TransportRegistry, InitRpcUsesATransportRegisteredByOneLine) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    ASSERT_OK(register_transport(counted_entry()));
    (void)register_function("twice", [](int64_t x) { return 2 * x; });
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.num_worker_threads = 2;
    options.transports = std::vector<std::string>{"counted"};
    ASSERT_OK(init_rpc("worker" + std::to_string(rank), rank, 2, options));
    EXPECT_EQ(rpc_sync<int64_t>("worker" + std::to_string(1 - rank), "twice", int64_t{21}), 42);
    std::map<std::string, std::string> info = current_agent()->debug_info();
    EXPECT_EQ(info.at("transports"), "counted");
    EXPECT_GE(std::stoi(info.at("counted_connections")), 1);
    ASSERT_OK(shutdown());
  }, 60s));
}

// Unknown names fail init_rpc on every worker with the same clear error.
TEST(TransportRegistry, InitRpcRefusesAnUnknownTransport) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(1, [&](int) {
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.transports = std::vector<std::string>{"carrier-pigeon"};
    EXPECT_THAT(init_rpc("worker0", 0, 1, options),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("unknown transport \"carrier-pigeon\" (registered: ring, tcp, shm, ibv, uv")));
  }));
}

}  // namespace
}  // namespace ferry
