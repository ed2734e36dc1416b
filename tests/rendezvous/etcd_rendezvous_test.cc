// etcd:// rendezvous and the "etcd" elastic backend, over a real 3-member etcd cluster
// (tests/testing/etcd_cluster.h) shared by the binary's tests (one ctest entry).
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rendezvous/elastic.h"
#include "rendezvous/rendezvous.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::EtcdCluster;
using ::ferry::testing::expect_all_succeed;
using ::ferry::testing::run_processes;
using ::ferry::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

EtcdCluster*& cluster = ::ferry::testing::shared_etcd_cluster();

std::string job(const std::string& name) { return name + "-" + std::to_string(::getpid()); }

TEST(EtcdRendezvousTest, ThreeProcessesMeetThroughTheClusterWithNoRankHostingAnything) {
  const std::string url = "etcd://" + cluster->endpoints() + "/" + job("static");
  expect_all_succeed(run_processes(3, [&](int rank) {
    auto r = rendezvous(url + "?rank=" + std::to_string(rank) + "&world_size=3", 20s);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->rank, rank);
    EXPECT_EQ(r->world_size, 3);
    EXPECT_OK(r->store->set("rank/" + std::to_string(rank), to_bytes(std::to_string(rank))));
    for (int peer = 0; peer < 3; ++peer) {
      auto v = r->store->get("rank/" + std::to_string(peer), 20s);
      ASSERT_TRUE(v.ok()) << v.status();
      EXPECT_EQ(to_string(*v), std::to_string(peer));
    }
    // Rank 0 may leave first: the store is the cluster, not rank 0.
  }, 60s));
}

TEST(EtcdRendezvousTest, DynamicGroupsAndRunIdsAreAccepted) {
  const std::string base = "etcd://" + cluster->endpoints() + "/" + job("dyn");
  FERRY_ASSERT_OK_AND_ASSIGN(RendezvousResult a, rendezvous(base + "?rank=5&world_size=dynamic", 10s));
  EXPECT_EQ(a.world_size, 0);
  EXPECT_EQ(a.rank, 5);
  FERRY_ASSERT_OK_AND_ASSIGN(RendezvousResult b, rendezvous(base + "?rank=0&world_size=1&run_id=r2", 10s));
  EXPECT_OK(a.store->set("k", to_bytes("run 1")));
  // Another run id is another key space.
  FERRY_ASSERT_OK_AND_ASSIGN(bool seen, b.store->check({"k"}));
  EXPECT_FALSE(seen);
}

TEST(EtcdRendezvousTest, BadUrlsSayWhatIsWrongAndWhatIsExpected) {
  const std::string eps = cluster->endpoints();
  EXPECT_THAT(rendezvous("etcd://" + eps + "?rank=0&world_size=1", 5s),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("job prefix missing"), HasSubstr("etcd://host1:2379,host2:2379/jobprefix"))));
  EXPECT_THAT(rendezvous("etcd:///job?rank=0&world_size=1", 5s),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("endpoints missing")));
  EXPECT_THAT(rendezvous("etcd://" + eps + "/job?rank=3&world_size=2", 5s),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 3 is out of range")));
  EXPECT_THAT(rendezvous("etcd://" + eps + "/job?world_size=2", 5s),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank parameter missing")));
  EXPECT_THAT(rendezvous("etcd://127.0.0.1:80x,127.0.0.1:2379/job?rank=0&world_size=1", 5s),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("80x")));
}

TEST(EtcdRendezvousTest, UnreachableClusterNamesTheEndpointsTried) {
  EXPECT_THAT(rendezvous("etcd://127.0.0.1:1,127.0.0.1:2/job?rank=0&world_size=1", 2s),
              StatusIs(absl::StatusCode::kUnavailable, AllOf(HasSubstr("127.0.0.1:1"), HasSubstr("127.0.0.1:2"))));
}

TEST(EtcdElasticTest, TwoNodesMeetInARoundKeptInEtcd) {
  const std::string run = job("elastic");
  std::atomic<int> ranks_sum{0};
  std::vector<std::thread> nodes;
  for (int i = 0; i < 2; ++i) {
    nodes.emplace_back([&] {
      auto params = RendezvousParameters::create("etcd", cluster->endpoints(), run, 2, 2,
                                                 {{"join_timeout", int64_t{20}}, {"last_call_timeout", int64_t{1}}});
      ASSERT_OK(params.status());
      auto handler = rendezvous_handler_registry().create_handler(*params);
      ASSERT_OK(handler.status());
      EXPECT_EQ((*handler)->get_backend(), "etcd");
      auto info = (*handler)->next_rendezvous();
      ASSERT_OK(info.status());
      EXPECT_EQ(info->world_size, 2);
      ranks_sum += info->rank;
      EXPECT_OK(info->store->set("hello/" + std::to_string(info->rank), to_bytes("1")));
      EXPECT_OK(info->store->wait({"hello/0", "hello/1"}, 20s));
      (*handler)->shutdown();
    });
  }
  for (auto& t : nodes) t.join();
  EXPECT_EQ(ranks_sum.load(), 1);
}

TEST(EtcdElasticTest, BadEndpointIsAClearError) {
  auto params = RendezvousParameters::create("etcd", "127.0.0.1:x", "r", 1, 1);
  ASSERT_OK(params.status());
  EXPECT_THAT(rendezvous_handler_registry().create_handler(*params),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("127.0.0.1:x")));
}

}  // namespace
}  // namespace ferry
