// Init fails fast everywhere (backends/init_failures.h): the published failure ends
// watched waits, the first one published wins, and with real processes a bad
// FERRY_SOCKET_IFNAME on one of 4 ranks fails all 4 init_rpc calls (TENSORPIPE and
// PROCESS_GROUP) long before the init timeout, each with rank 2's error.
#include "backends/init_failures.h"

#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "gtest/gtest.h"
#include "backends/process_group/process_group_backend.h"
#include "rpc/rpc.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

TEST(InitFailuresTest, APublishedFailureEndsWatchedWaits) {
  auto store = std::make_shared<HashStore>();
  internal::InitFailures failures(store, "ferry/rpc/init/1/");
  std::shared_ptr<Store> watched = failures.watching_store();
  absl::Status seen;
  // Waits far longer than the test may run: only the published failure can end them.
  std::thread waiter([&] { seen = watched->get("never", 10min).status(); });
  absl::Status mine = failures.conclude(2, "worker2", absl::NotFoundError("no such interface"));
  waiter.join();
  EXPECT_THAT(mine, StatusIs(absl::StatusCode::kNotFound,
                             "init_rpc failed on rank 2 (worker \"worker2\"): no such interface"));
  EXPECT_EQ(seen, mine);
  // wait() and multi_get() too.
  EXPECT_EQ(watched->wait({"never"}, 10min), mine);
  EXPECT_EQ(watched->multi_get({"never"}, 10min).status(), mine);
  // Keys that are there are read as usual.
  ASSERT_OK(watched->set("k", to_bytes("v")));
  EXPECT_THAT(watched->get("k", 10min), ::testing::Eq(absl::StatusOr<Bytes>(to_bytes("v"))));
}

TEST(InitFailuresTest, TheStoresHostStaysUntilEveryRankCountedOut) {
  absl::StatusOr<std::unique_ptr<TCPStore>> host = TCPStore::create("127.0.0.1", 0, true, std::nullopt, 10s);
  ASSERT_OK(host.status());
  std::shared_ptr<Store> hosted = *std::move(host);
  uint16_t port = static_cast<TCPStore&>(*hosted).port();
  absl::StatusOr<std::unique_ptr<TCPStore>> client = TCPStore::create("127.0.0.1", port, false, std::nullopt, 10s);
  ASSERT_OK(client.status());
  std::shared_ptr<Store> remote = *std::move(client);

  internal::InitFailures on_host(hosted, "p/");
  internal::InitFailures on_client(remote, "p/");
  std::atomic<bool> host_left{false};
  // Far longer than the test may run: only the other rank counting out ends it.
  std::thread lingering([&] {
    on_host.linger(2, 10min);
    host_left = true;
  });
  ASSERT_OK(hosted->wait({"p/out"}, 10s));  // the host counted itself out
  EXPECT_FALSE(host_left.load()) << "the store's host left before the other rank read the failure";
  Clock::time_point t0 = Clock::now();
  on_client.linger(2, 10min);  // not the host: returns once counted out
  EXPECT_LT(Clock::now() - t0, 5s);
  lingering.join();
  EXPECT_TRUE(host_left.load());

  // A rank that never counts out (it crashed) holds the host up for the grace only.
  internal::InitFailures alone(hosted, "q/");
  t0 = Clock::now();
  alone.linger(3, 300ms);
  EXPECT_GE(Clock::now() - t0, 300ms);
}

TEST(InitFailuresTest, TheFirstFailureWinsEverywhere) {
  auto store = std::make_shared<HashStore>();
  internal::InitFailures a(store, "p/");
  internal::InitFailures b(store, "p/");
  absl::Status first = a.conclude(3, "w3", absl::InvalidArgumentError("bad map"));
  absl::Status second = b.conclude(1, "w1", absl::UnavailableError("listen failed"));
  EXPECT_EQ(first, second);
  EXPECT_THAT(second, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 3 (worker \"w3\"): bad map")));
  // A rank whose own wait ended with the published failure returns it unchanged.
  EXPECT_EQ(b.conclude(0, "w0", first), first);
  EXPECT_OK(b.conclude(0, "w0", absl::OkStatus()));
  // A timeout is nobody's in particular: returned as is, not published.
  internal::InitFailures c(store, "t/");
  absl::Status late = absl::DeadlineExceededError("after 10 ms, rank(s) 3 of 4 had not arrived");
  EXPECT_EQ(c.conclude(0, "w0", late), late);
  EXPECT_EQ(c.published(), std::nullopt);
  // A verdict every rank reaches alike: as is, unpublished.
  absl::Status dup = absl::InvalidArgumentError("worker name \"w\" is used by both rank 0 and rank 1");
  EXPECT_EQ(c.conclude(1, "w", internal::group_verdict(dup)), dup);
  EXPECT_EQ(c.published(), std::nullopt);
  // A failure read from rank 5's record is published as rank 5's, by whichever rank
  // gets there first.
  absl::Status theirs = c.conclude(0, "w0", internal::init_failure(5, "w5", absl::StatusCode::kUnavailable, "down"));
  EXPECT_THAT(theirs, StatusIs(absl::StatusCode::kUnavailable, "init_rpc failed on rank 5 (worker \"w5\"): down"));
  EXPECT_EQ(c.published(), theirs);
  // Other generations are not affected.
  internal::InitFailures other(store, "q/");
  EXPECT_EQ(other.published(), std::nullopt);
}

TEST(InitFailuresTest, WithoutFailureWaitsTimeOutAsUsual) {
  auto store = std::make_shared<HashStore>();
  internal::InitFailures failures(store, "p/");
  EXPECT_THAT(failures.watching_store()->get("never", 500ms),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("(500 ms in all)")));
  failures.disarm();
  EXPECT_THAT(failures.watching_store()->wait({"never"}, 50ms), StatusIs(absl::StatusCode::kDeadlineExceeded));
}

TEST(StoreHostTest, TcpStoresUnderPrefixesAreFound) {
  FERRY_ASSERT_OK_AND_ASSIGN(std::unique_ptr<TCPStore> tcp, TCPStore::create("127.0.0.1", 0, true, std::nullopt, 5s));
  std::shared_ptr<Store> shared(std::move(tcp));
  EXPECT_EQ(internal::store_host_of(*shared), "127.0.0.1");
  auto prefixed = std::make_shared<PrefixStore>("a", std::make_shared<PrefixStore>("b", shared));
  EXPECT_EQ(internal::store_host_of(*prefixed), "127.0.0.1");
  EXPECT_EQ(internal::store_host_of(HashStore()), "");
}

// 4 ranks; rank 2's FERRY_SOCKET_IFNAME names no interface. The init timeout is 5
// minutes, the processes' deadline 60 s: only failing fast passes.
template <typename Options>
void one_bad_rank_fails_all(const BackendType& backend) {
  const int port = ferry::testing::free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(
      4,
      [&](int rank) {
        setenv("FERRY_SOCKET_IFNAME", rank == 2 ? "nosuchif" : "lo", 1);
        Options options;
        options.init_method = "tcp://127.0.0.1:" + std::to_string(port);
        options.rpc_timeout = 5min;
        Clock::time_point start = Clock::now();
        absl::Status s = init_rpc("worker" + std::to_string(rank), backend, rank, 4, options);
        // The transport that could not listen may be named in between.
        EXPECT_THAT(s, StatusIs(absl::StatusCode::kNotFound,
                                ::testing::AllOf(HasSubstr("init_rpc failed on rank 2 (worker \"worker2\"): "),
                                                 HasSubstr("network interface \"nosuchif\" (FERRY_SOCKET_IFNAME) "
                                                           "does not exist"))));
        std::printf("rank %d: init failed after %lld ms\n", rank,
                    static_cast<long long>(
                        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - start).count()));
      },
      60s));
}

TEST(InitFailsFastTest, TensorPipeBadIfnameOnOneOfFourRanks) {
  one_bad_rank_fails_all<TensorPipeRpcBackendOptions>(BackendType::TENSORPIPE);
}

TEST(InitFailsFastTest, ProcessGroupBadIfnameOnOneOfFourRanks) {
  one_bad_rank_fails_all<ProcessGroupRpcBackendOptions>(BackendType::PROCESS_GROUP);
}

}  // namespace
}  // namespace ferry
