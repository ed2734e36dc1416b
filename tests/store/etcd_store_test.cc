// EtcdStore against real etcd clusters (tests/testing/etcd_cluster.h): the store
// conformance suite, racing adds and timed-out waits from many processes, moving to
// another member when one dies, errors naming the endpoints once a quorum is gone,
// keys tied to a lease, and authentication. The whole binary is one ctest entry, so one
// 3-member cluster serves every test that does not kill members.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/etcd/etcd_store.h"
#include "store/etcd/internal/etcd_client.h"
#include "tests/store/store_conformance.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::conformance::store_kind_name;
using ::ferry::conformance::StoreKind;
using ::ferry::conformance::StoreTest;
using ::ferry::testing::EtcdCluster;
using ::ferry::testing::EtcdClusterOptions;
using ::ferry::testing::expect_all_succeed;
using ::ferry::testing::run_processes;
using ::ferry::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ContainsRegex;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

EtcdCluster*& shared_cluster = ::ferry::testing::shared_etcd_cluster();

// A prefix no other test (or earlier run) used, so each store starts empty.
std::string fresh_prefix() {
  static std::atomic<int> counter{0};
  return "test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
}

absl::StatusOr<std::unique_ptr<EtcdStore>> store_on(const std::string& endpoints, const std::string& prefix,
                                                    std::chrono::milliseconds timeout = 10s) {
  EtcdStoreOptions options;
  options.endpoints = endpoints;
  options.prefix = prefix;
  options.timeout = timeout;
  options.request_timeout = 5s;
  options.attempt_timeout = 1s;
  options.lease_ttl = 2s;
  return EtcdStore::create(options);
}

std::vector<StoreKind> etcd_kinds() {
  return {{"EtcdStore", [](const std::string&) -> absl::StatusOr<std::shared_ptr<Store>> {
             if (shared_cluster == nullptr) return absl::FailedPreconditionError("no etcd cluster");
             auto store = store_on(shared_cluster->endpoints(), fresh_prefix());
             if (!store.ok()) return store.status();
             return std::shared_ptr<Store>(*std::move(store));
           }}};
}

INSTANTIATE_TEST_SUITE_P(Etcd, StoreTest, ::testing::ValuesIn(etcd_kinds()), store_kind_name);

TEST(EtcdClusterTest, StartsHealthyElectsALeaderAndLeavesNothingBehind) {
  std::string dir;
  std::vector<pid_t> pids;
  {
    auto cluster = EtcdCluster::start(EtcdClusterOptions{});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    dir = (*cluster)->dir();
    FERRY_ASSERT_OK_AND_ASSIGN(int leader, (*cluster)->leader());
    (*cluster)->kill(leader);
    EXPECT_FALSE((*cluster)->alive(leader));
    // The two left elect another within a few election timeouts.
    absl::StatusOr<int> next = absl::UnavailableError("not asked");
    for (auto end = std::chrono::steady_clock::now() + 10s; std::chrono::steady_clock::now() < end;) {
      next = (*cluster)->leader();
      if (next.ok() && *next != leader) break;
      std::this_thread::sleep_for(50ms);
    }
    ASSERT_OK(next.status());
    EXPECT_NE(*next, leader);
  }
  EXPECT_NE(::access(dir.c_str(), F_OK), 0) << dir << " still exists";
}

TEST(EtcdStoreTest, KeysLiveUnderTheJobPrefix) {
  auto a = store_on(shared_cluster->endpoints(), "jobA-" + fresh_prefix());
  auto b = store_on(shared_cluster->endpoints(), "jobB-" + fresh_prefix());
  ASSERT_OK(a.status());
  ASSERT_OK(b.status());
  EXPECT_OK((*a)->set("k", to_bytes("from a")));
  EXPECT_OK((*b)->set("k", to_bytes("from b")));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, (*a)->get("k", 1s));
  EXPECT_EQ(to_string(v), "from a");
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t n, (*b)->num_keys());
  EXPECT_EQ(n, 1);
  FERRY_ASSERT_OK_AND_ASSIGN(auto listed, (*a)->list(""));
  ASSERT_EQ(listed.size(), 1u);
  EXPECT_EQ(listed[0].first, "k");
  // The raw key in etcd carries the prefix.
  auto raw = ::ferry::testing::http_call(
      static_cast<uint16_t>(std::stoi(shared_cluster->endpoint(0).substr(10))), "/v3/kv/range",
      "{\"key\":\"" + internal::base64((*a)->prefix() + "/k") + "\"}", 20s);
  ASSERT_OK(raw.status());
  EXPECT_THAT(*raw, HasSubstr(internal::base64("from a")));
}

TEST(EtcdStoreTest, BadOptionsAreRefusedClearly) {
  EtcdStoreOptions options;
  options.endpoints = "127.0.0.1:notaport";
  EXPECT_THAT(EtcdStore::create(options),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("notaport"), HasSubstr("host:port"))));
  options.endpoints = "";
  EXPECT_THAT(EtcdStore::create(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no endpoints")));
  options.endpoints = shared_cluster->endpoints();
  options.prefix = "";
  EXPECT_THAT(EtcdStore::create(options), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("prefix")));
}

TEST(EtcdStoreTest, ProcessesRacingAddsEndWithTheExactSumAndWaitsTimeOut) {
  constexpr int kProcs = 6, kAdds = 15;
  const std::string endpoints = shared_cluster->endpoints();
  const std::string prefix = fresh_prefix();
  expect_all_succeed(run_processes(kProcs, [&](int rank) {
    auto store = store_on(endpoints, prefix);
    ASSERT_OK(store.status());
    // Start together, so that the adds really race.
    EXPECT_OK((*store)->add("arrived", 1).status());
    std::vector<std::string> none = {"never/" + std::to_string(rank)};
    while (true) {
      FERRY_ASSERT_OK_AND_ASSIGN(int64_t arrived, (*store)->add("arrived", 0));
      if (arrived == kProcs) break;
      std::this_thread::sleep_for(5ms);
    }
    for (int i = 0; i < kAdds; ++i) EXPECT_OK((*store)->add("sum", rank + 1).status());
    EXPECT_OK((*store)->set("added/" + std::to_string(rank), to_bytes("1")));
    std::vector<std::string> all;
    for (int r = 0; r < kProcs; ++r) all.push_back("added/" + std::to_string(r));
    EXPECT_OK((*store)->wait(all, 30s));
    FERRY_ASSERT_OK_AND_ASSIGN(int64_t sum, (*store)->add("sum", 0));
    EXPECT_EQ(sum, int64_t{kAdds} * kProcs * (kProcs + 1) / 2);
    // A wait on a key nobody sets ends at its timeout, naming the key.
    auto start = std::chrono::steady_clock::now();
    EXPECT_THAT((*store)->get(none[0], 300ms),
                StatusIs(absl::StatusCode::kDeadlineExceeded,
                         AllOf(HasSubstr("'" + none[0] + "'"), ContainsRegex("after [0-9]+ ms"))));
    auto took = std::chrono::steady_clock::now() - start;
    EXPECT_GE(took, 290ms);
    EXPECT_LT(took, 5s);
  }, 90s));
}

TEST(EtcdStoreTest, AKeySetByAnotherProcessWakesAWatchNotAPoll) {
  const std::string endpoints = shared_cluster->endpoints();
  const std::string prefix = fresh_prefix();
  expect_all_succeed(run_processes(2, [&](int rank) {
    auto store = store_on(endpoints, prefix);
    ASSERT_OK(store.status());
    if (rank == 0) {
      EXPECT_OK((*store)->wait({"waiting"}, 20s));
      std::this_thread::sleep_for(200ms);
      EXPECT_OK((*store)->set("late", to_bytes("from rank 0")));
    } else {
      EXPECT_OK((*store)->set("waiting", to_bytes("1")));
      auto start = std::chrono::steady_clock::now();
      FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, (*store)->get("late", 20s));
      EXPECT_EQ(to_string(v), "from rank 0");
      EXPECT_GE(std::chrono::steady_clock::now() - start, 150ms);
    }
  }, 60s));
}

// A cluster of its own: these tests kill members.
TEST(EtcdStoreFailoverTest, MovesToAnotherMemberAndNamesEveryEndpointWhenQuorumIsGone) {
  auto cluster = EtcdCluster::start(EtcdClusterOptions{});
  ASSERT_OK(cluster.status());
  auto store = store_on((*cluster)->endpoints(), "failover");
  ASSERT_OK(store.status());
  EXPECT_OK((*store)->set("before", to_bytes("1")));
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t n, (*store)->add("n", 1));
  EXPECT_EQ(n, 1);
  // The store talks to member 0 first; kill it, and the leader too if it is another.
  FERRY_ASSERT_OK_AND_ASSIGN(int leader, (*cluster)->leader());
  (*cluster)->kill(0);
  EXPECT_OK((*store)->set("after", to_bytes("2")));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, (*store)->get("before", 5s));
  EXPECT_EQ(to_string(v), "1");
  FERRY_ASSERT_OK_AND_ASSIGN(n, (*store)->add("n", 1));
  EXPECT_EQ(n, 2);
  // A waiter parked on a key wakes when it is set, though the member it first asked died.
  std::thread setter([&] {
    std::this_thread::sleep_for(300ms);
    EXPECT_OK((*store)->set("woken", to_bytes("yes")));
  });
  FERRY_ASSERT_OK_AND_ASSIGN(v, (*store)->get("woken", 10s));
  setter.join();
  EXPECT_EQ(to_string(v), "yes");
  // A second member down: no quorum. Operations fail, naming every endpoint, within the
  // request timeout (2 s here) plus one attempt (1 s), with room for a loaded machine.
  EtcdStoreOptions quick;
  quick.endpoints = (*cluster)->endpoints();
  quick.prefix = "failover";
  quick.request_timeout = 2s;
  quick.attempt_timeout = 1s;
  auto short_store = EtcdStore::create(quick);
  ASSERT_OK(short_store.status());
  int second = leader != 0 ? leader : 1;
  (*cluster)->kill(second);
  auto start = std::chrono::steady_clock::now();
  absl::Status set = (*short_store)->set("lost", to_bytes("x"));
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_THAT(set, StatusIs(absl::StatusCode::kUnavailable,
                            AllOf(HasSubstr("'lost'"), HasSubstr((*cluster)->endpoint(0)),
                                  HasSubstr((*cluster)->endpoint(1)), HasSubstr((*cluster)->endpoint(2)))));
  EXPECT_LT(took, 5s);
  start = std::chrono::steady_clock::now();
  EXPECT_THAT((*short_store)->add("n", 1), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("'n'")));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
  start = std::chrono::steady_clock::now();
  EXPECT_THAT((*short_store)->get("never", 1s), Not(::ferry::testing::IsOk()));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

// Members that answer nothing (SIGSTOPped): a short wait still ends at its own timeout,
// as a timeout, and a request fails within its request timeout naming every endpoint.
TEST(EtcdStoreFailoverTest, UnresponsiveMembersCostAWaitNoMoreThanItsTimeout) {
  auto cluster = EtcdCluster::start(EtcdClusterOptions{});
  ASSERT_OK(cluster.status());
  EtcdStoreOptions options;
  options.endpoints = (*cluster)->endpoints();
  options.prefix = "stopped";
  options.request_timeout = 1500ms;
  options.attempt_timeout = 400ms;
  auto store = EtcdStore::create(options);
  ASSERT_OK(store.status());
  for (int i = 0; i < (*cluster)->size(); ++i) (*cluster)->pause(i);
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT((*store)->wait({"k"}, 300ms),
              StatusIs(absl::StatusCode::kDeadlineExceeded, AllOf(HasSubstr("'k'"), HasSubstr("timed out after"))));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  start = std::chrono::steady_clock::now();
  EXPECT_THAT((*store)->set("k", to_bytes("v")),
              StatusIs(absl::StatusCode::kUnavailable,
                       AllOf(HasSubstr((*cluster)->endpoint(0)), HasSubstr((*cluster)->endpoint(1)),
                             HasSubstr((*cluster)->endpoint(2)))));
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s);
  for (int i = 0; i < (*cluster)->size(); ++i) (*cluster)->resume(i);
}

// The owning process dies without a word: its keys go when the lease expires; a
// normal end revokes the lease, and they go at once.
TEST(EtcdStoreLeaseTest, OwnedKeysVanishWithinTheTtlOfTheirOwnersDeath) {
  const std::string endpoints = shared_cluster->endpoints();
  const std::string prefix = fresh_prefix();
  auto observer = store_on(endpoints, prefix);
  ASSERT_OK(observer.status());
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t child = ::fork();
  if (child == 0) {
    ::close(ready[0]);
    auto store = store_on(endpoints, prefix);
    bool ok = store.ok() && (*store)->set_owned("workers/7", to_bytes("alive")).ok() &&
              (*store)->compare_set_owned("lock", {}, to_bytes("7")).ok();
    char byte = ok ? 1 : 0;
    (void)!::write(ready[1], &byte, 1);
    ::pause();
    _exit(0);
  }
  ::close(ready[1]);
  char byte = 0;
  ASSERT_EQ(::read(ready[0], &byte, 1), 1);
  ::close(ready[0]);
  ASSERT_EQ(byte, 1);
  FERRY_ASSERT_OK_AND_ASSIGN(bool present, (*observer)->check({"workers/7", "lock"}));
  EXPECT_TRUE(present);
  // Renewed while it lives: still there after more than one TTL (2 s).
  std::this_thread::sleep_for(2500ms);
  FERRY_ASSERT_OK_AND_ASSIGN(present, (*observer)->check({"workers/7"}));
  EXPECT_TRUE(present) << "a live owner's key expired";
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  auto killed = std::chrono::steady_clock::now();
  // Watched, not polled: wait_gone reports each key as its lease expires.
  std::vector<std::string> owned = {"lock", "workers/7"};
  while (!owned.empty()) {
    FERRY_ASSERT_OK_AND_ASSIGN(std::vector<std::string> gone,
                               (*observer)->wait_gone(owned, 2s + 2s, [] { return false; }));
    ASSERT_FALSE(gone.empty()) << "owned keys outlived the lease TTL";
    for (const std::string& k : gone) std::erase(owned, k);
  }
  ASSERT_LT(std::chrono::steady_clock::now() - killed, 2s + 2s) << "owned keys outlived the lease TTL";
  // The lock is free for the next one.
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes holder, (*observer)->compare_set("lock", {}, to_bytes("8")));
  EXPECT_EQ(to_string(holder), "8");

  {
    auto owner = store_on(endpoints, prefix);
    ASSERT_OK(owner.status());
    EXPECT_OK((*owner)->set_owned("workers/9", to_bytes("alive")));
  }
  FERRY_ASSERT_OK_AND_ASSIGN(present, (*observer)->check({"workers/9"}));
  EXPECT_FALSE(present) << "a store that ended normally left its owned key";
}

TEST(EtcdStoreAuthTest, UserAndPasswordFromOptionsOrEnvironmentNeverInErrors) {
  EtcdClusterOptions one;
  one.members = 1;
  auto cluster = EtcdCluster::start(one);
  ASSERT_OK(cluster.status());
  uint16_t port = static_cast<uint16_t>(std::stoi((*cluster)->endpoint(0).substr(10)));
  auto call = [&](const std::string& path, const std::string& body) {
    auto answer = ::ferry::testing::http_call(port, path, body, 20s);
    EXPECT_TRUE(answer.ok()) << path << ": " << answer.status();
  };
  call("/v3/auth/user/add", R"({"name":"root","password":"s3cret-root"})");
  call("/v3/auth/user/grant", R"({"user":"root","role":"root"})");
  call("/v3/auth/enable", "{}");

  EtcdStoreOptions options;
  options.endpoints = (*cluster)->endpoints();
  options.prefix = "auth";
  options.request_timeout = 3s;
  options.user = "root";
  options.password = "s3cret-root";
  auto store = EtcdStore::create(options);
  ASSERT_OK(store.status());
  EXPECT_OK((*store)->set("k", to_bytes("v")));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, (*store)->get("k", 2s));
  EXPECT_EQ(to_string(v), "v");

  options.password = "wrong-password-xyz";
  auto refused = EtcdStore::create(options);
  EXPECT_THAT(refused, StatusIs(absl::StatusCode::kUnauthenticated,
                                AllOf(HasSubstr("root"), Not(HasSubstr("wrong-password-xyz")))));
  options.user.reset();
  options.password.reset();
  ::setenv("FERRY_ETCD_USER", "root", 1);
  ::setenv("FERRY_ETCD_PASSWORD", "s3cret-root", 1);
  auto from_env = EtcdStore::create(options);
  ::unsetenv("FERRY_ETCD_USER");
  ::unsetenv("FERRY_ETCD_PASSWORD");
  ASSERT_OK(from_env.status());
  FERRY_ASSERT_OK_AND_ASSIGN(v, (*from_env)->get("k", 2s));
  EXPECT_EQ(to_string(v), "v");
  // Without credentials the cluster refuses, and says so.
  EXPECT_THAT(EtcdStore::create(options), Not(::ferry::testing::IsOk()));
}

}  // namespace
}  // namespace ferry
