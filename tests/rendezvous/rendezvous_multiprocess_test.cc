// file://, tcp:// and env:// rendezvous across real processes (loopback only).
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rendezvous/rendezvous.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::expect_all_succeed;
using ::ferry::testing::free_port;
using ::ferry::testing::run_processes;
using ::ferry::testing::TempDir;
using namespace std::chrono_literals;

// Every rank writes its rank and reads everyone else's through the rendezvous store.
void exchange(const RendezvousResult& r, int expected_rank, int world_size) {
  EXPECT_EQ(r.rank, expected_rank);
  EXPECT_EQ(r.world_size, world_size);
  EXPECT_OK(r.store->set("rank/" + std::to_string(r.rank), to_bytes(std::to_string(r.rank))));
  for (int peer = 0; peer < world_size; ++peer) {
    auto v = r.store->get("rank/" + std::to_string(peer), 20s);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(to_string(*v), std::to_string(peer));
  }
  // Rank 0 hosts a TCPStore: it leaves last.
  EXPECT_OK(r.store->add("left", 1).status());
  if (r.rank == 0) {
    for (int i = 0; i < 4000; ++i) {
      auto left = r.store->add("left", 0);
      if (!left.ok() || *left == world_size) break;
      usleep(5000);
    }
  }
}

TEST(RendezvousMultiProcessTest, TcpUrl) {
  uint16_t port = free_port();
  expect_all_succeed(run_processes(3, [&](int rank) {
    auto r = rendezvous("tcp://127.0.0.1:" + std::to_string(port) + "?rank=" + std::to_string(rank) +
                            "&world_size=3",
                        20s);
    ASSERT_TRUE(r.ok()) << r.status();
    exchange(*r, rank, 3);
  }));
}

TEST(RendezvousMultiProcessTest, FileUrl) {
  TempDir dir;
  std::string path = dir.path() + "/store";
  expect_all_succeed(run_processes(3, [&](int rank) {
    auto r = rendezvous("file://" + path + "?rank=" + std::to_string(rank) + "&world_size=3", 20s);
    ASSERT_TRUE(r.ok()) << r.status();
    exchange(*r, rank, 3);
  }));
}

TEST(RendezvousMultiProcessTest, EnvUrlWithQueryOverridingRank) {
  uint16_t port = free_port();
  expect_all_succeed(run_processes(2, [&](int rank) {
    // Each child sets its own environment; RANK is deliberately wrong and the query fixes it.
    ::setenv("RANK", "7", 1);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    auto r = rendezvous("env://?rank=" + std::to_string(rank), 20s);
    ASSERT_TRUE(r.ok()) << r.status();
    exchange(*r, rank, 2);
  }));
}

}  // namespace
}  // namespace ferry
