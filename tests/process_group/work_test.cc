// Work's completion callbacks and Future: on a completed Work, on collectives run by
// the group's worker, and on receives (whose future carries the sender's rank).
#include "process_group/work.h"

#include <stdlib.h>

#include <dirent.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "process_group/process_group.h"
#include "store/file_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;
using std::chrono::seconds;

TEST(WorkCallbacks, ACompletedWorkRunsCallbacksAtOnce) {
  Work ok = Work::completed("noop", absl::OkStatus());
  absl::Status seen = absl::UnknownError("not called");
  ok.add_callback([&](const absl::Status& s) { seen = s; });
  EXPECT_OK(seen);
  EXPECT_EQ(*ok.future().result(), -1);
  Work bad = Work::completed("bad", absl::InvalidArgumentError("no"));
  bad.add_callback([&](const absl::Status& s) { seen = s; });
  EXPECT_THAT(seen, StatusIs(absl::StatusCode::kInvalidArgument, "no"));
  EXPECT_THAT(bad.future().result(), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(WorkCallbacks, CollectivesAndReceivesCompleteTheirFutures) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_SOCKET_IFNAME", "lo", 1);
    auto store = FileStore::create(dir.path() + "/store", {});
    ASSERT_OK(store.status());
    auto group = ProcessGroup::create(std::shared_ptr<Store>(*std::move(store)), rank, 2, seconds(30));
    ASSERT_OK(group.status());
    ProcessGroup& g = **group;
    std::atomic<int> calls{0};
    Tensor t = Tensor::from_vector<int64_t>({rank + 1});
    Work w = g.all_reduce_async(t);
    w.add_callback([&](const absl::Status& s) {
      EXPECT_OK(s);
      calls.fetch_add(1);
    });
    // A Future continuation sees the same completion.
    Future<int64_t> sum = w.future().then([t](const absl::StatusOr<int>& r) -> absl::StatusOr<int64_t> {
      if (!r.ok()) return r.status();
      return (*t.to_vector<int64_t>())[0];
    });
    EXPECT_EQ(sum.wait(seconds(20)), 3);
    ASSERT_OK(w.wait());
    EXPECT_EQ(calls.load(), 1);
    // A receive's future carries the sender's rank; a failed one its error.
    if (rank == 0) {
      Tensor in = *Tensor::empty({1}, DType::kInt64);
      Work r = g.irecv(in);
      EXPECT_EQ(*r.future().result(), 1);
      Tensor wrong = *Tensor::empty({2}, DType::kInt64);
      EXPECT_THAT(g.irecv(wrong).future().result(), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 1")));
    } else {
      ASSERT_OK(g.send(Tensor::from_vector<int64_t>({7}), 0));
      ASSERT_OK(g.send(Tensor::from_vector<int64_t>({8}), 0));
    }
    ASSERT_OK(g.barrier());
  }, seconds(60)));
}

// This process's threads, from /proc/self/task.
int thread_count() {
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int n = 0;
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  return n;
}

// Issue 27, finding 14: every pending isend/irecv had a thread of its own, so 2,000
// outstanding receives were 2,000 threads. They now wait on a bounded pool, and all
// still complete, each with its own message.
TEST(WorkCallbacks, ManyOutstandingReceivesCompleteOnABoundedPool) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    setenv("FERRY_SOCKET_IFNAME", "lo", 1);
    auto store = FileStore::create(dir.path() + "/store", {});
    ASSERT_OK(store.status());
    auto group = ProcessGroup::create(std::shared_ptr<Store>(*std::move(store)), rank, 2, seconds(60));
    ASSERT_OK(group.status());
    ProcessGroup& g = **group;
    constexpr int kOps = 2000;
    const int before = thread_count();
    int most = before;
    std::vector<Tensor> tensors;
    std::vector<Work> works;
    std::atomic<int> done{0};
    for (int i = 0; i < kOps; ++i) {
      // Tags 0..6: receives of one tag take that tag's messages in order.
      tensors.push_back(Tensor::from_vector<int64_t>({rank == 0 ? -1 : i}));
      works.push_back(rank == 0 ? g.irecv(tensors.back(), 1, static_cast<uint32_t>(i % 7))
                                : g.isend(tensors.back(), 0, static_cast<uint32_t>(i % 7)));
      works.back().add_callback([&](const absl::Status& s) {
        EXPECT_OK(s);
        done.fetch_add(1);
      });
      if (i % 100 == 0) most = std::max(most, thread_count());
    }
    for (int i = 0; i < kOps; ++i) {
      ASSERT_OK(works[static_cast<size_t>(i)].wait(seconds(60)));
      if (i % 100 == 0) most = std::max(most, thread_count());
      if (rank == 0) {
        EXPECT_EQ((*tensors[static_cast<size_t>(i)].to_vector<int64_t>())[0], i);
      }
    }
    // A wait ends when the operation completes; its callbacks run just after, on the
    // pool thread that completed it.
    const auto deadline = std::chrono::steady_clock::now() + seconds(30);
    while (done.load() < kOps && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    EXPECT_EQ(done.load(), kOps);
    EXPECT_LE(most, before + 100) << "threads before: " << before;
    ASSERT_OK(g.barrier());
  }, seconds(120)));
}

}  // namespace
}  // namespace ferry
