// The module-level API (process_group/module.h, seed 004): init_process_group through
// an init_method or a store, is_initialized, destroy_process_group, get_rank /
// get_world_size of WORLD or a given group, and the seed's errors.
#include "process_group/module.h"

#include <stdlib.h>

#include <functional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/hash_store.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry::dist {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

// Options with a store (or none), rank and world size; the rest as `edit` sets them.
InitProcessGroupOptions opts(std::shared_ptr<Store> store, int world_size, int rank,
                             const std::function<void(InitProcessGroupOptions&)>& edit = {}) {
  InitProcessGroupOptions o;
  o.store = std::move(store);
  o.world_size = world_size;
  o.rank = rank;
  if (edit) edit(o);
  return o;
}

TEST(ProcessGroupModule, UseBeforeInitAndBadArguments) {
  setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  EXPECT_FALSE(is_initialized());
  EXPECT_THAT(get_rank(), StatusIs(absl::StatusCode::kFailedPrecondition,
                                   "get_rank: the default process group is not initialized; call "
                                   "init_process_group first"));
  EXPECT_THAT(get_world_size(WORLD), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("get_world_size")));
  EXPECT_THAT(default_group(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("default_group")));
  EXPECT_THAT(destroy_process_group(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("destroy_process_group")));
  auto store = std::make_shared<HashStore>();
  EXPECT_THAT(init_process_group(opts(store, 1, 0, [](auto& o) { o.backend = "nccl"; })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("Invalid distributed backend name: \"nccl\"")));
  EXPECT_THAT(init_process_group(opts(store, -1, -1)),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("with a store, rank and world_size are required (got rank -1, world_size -1)")));
  EXPECT_THAT(init_process_group(opts(store, 1, 0, [](auto& o) { o.timeout = std::chrono::milliseconds(0); })),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be positive")));
  EXPECT_THAT(init_process_group(opts(nullptr, 1, 0, [](auto& o) { o.init_method = "nope://x"; })),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_FALSE(is_initialized());
}

TEST(ProcessGroupModule, InitTwiceDestroyAndInitAgain) {
  setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  auto store = std::make_shared<HashStore>();
  ASSERT_OK(init_process_group(opts(store, 1, 0, [](auto& o) { o.backend = "GLOO"; })));
  EXPECT_TRUE(is_initialized());
  EXPECT_EQ(*get_rank(), 0);
  EXPECT_EQ(*get_world_size(), 1);
  EXPECT_THAT(init_process_group(opts(store, 1, 0)),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("trying to initialize the default process group twice")));
  std::shared_ptr<ProcessGroup> held = *default_group();
  ASSERT_OK(destroy_process_group());
  EXPECT_FALSE(is_initialized());
  // A handle kept past destroy fails instead of dangling.
  EXPECT_THAT(held->barrier(), StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("shut down")));
  ASSERT_OK(init_process_group(opts(store, 1, 0, [](auto& o) { o.group_name = "again"; })));
  EXPECT_EQ(*get_rank(), 0);
  ASSERT_OK(destroy_process_group());
}

void body(int rank, int world, const std::string& init_method) {
  setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  ASSERT_OK(init_process_group(opts(nullptr, world, rank, [&](auto& o) {
    o.init_method = init_method;
    o.group_name = "job";
  })));
  EXPECT_EQ(*get_rank(), rank);
  EXPECT_EQ(*get_world_size(WORLD), world);
  std::shared_ptr<ProcessGroup> group = *default_group();
  Tensor t = Tensor::from_vector<int64_t>({rank, 1});
  ASSERT_OK(group->all_reduce(t));
  EXPECT_EQ(*t.to_vector<int64_t>(), (std::vector<int64_t>{world * (world - 1) / 2, world}));
  // A given group: ranks 1.. form a sub-group; rank 0 is not in it.
  absl::StatusOr<std::unique_ptr<ProcessGroup>> sub = group->new_group({1, 2});
  ASSERT_OK(sub.status());
  EXPECT_EQ(*get_rank(**sub), rank == 0 ? -1 : rank - 1);
  EXPECT_EQ(*get_world_size(**sub), 2);
  // The sub-group goes only after every rank is past its rendezvous.
  ASSERT_OK(group->barrier());
  sub->reset();
  ASSERT_OK(destroy_process_group());
  EXPECT_FALSE(is_initialized());
}

TEST(ProcessGroupModule, ThreeProcessesThroughFileInit) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(
      ferry::testing::run_processes(3, [&](int rank) { body(rank, 3, "file://" + dir.path() + "/store"); }));
}

TEST(ProcessGroupModule, ThreeProcessesThroughTcpInit) {
  int port = ferry::testing::free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(
      3, [&](int rank) { body(rank, 3, "tcp://127.0.0.1:" + std::to_string(port)); }));
}

TEST(ProcessGroupModule, EnvInitReadsRankAndWorldSize) {
  int port = ferry::testing::free_port();
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_SOCKET_IFNAME", "lo", 1);
    setenv("MASTER_ADDR", "127.0.0.1", 1);
    setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
    setenv("RANK", std::to_string(rank).c_str(), 1);
    setenv("WORLD_SIZE", "2", 1);
    ASSERT_OK(init_process_group({}));
    EXPECT_EQ(*get_rank(), rank);
    EXPECT_EQ(*get_world_size(), 2);
    ASSERT_OK((*default_group())->barrier());
    ASSERT_OK(destroy_process_group());
  }));
}

}  // namespace
}  // namespace ferry::dist
