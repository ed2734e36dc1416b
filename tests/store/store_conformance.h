// The store conformance suite: every Store operation, parameterized over a StoreKind.
// Included by one test file per set of stores (store_test.cc: HashStore, FileStore,
// PrefixStore, TCPStore; etcd_store_test.cc: EtcdStore), which instantiates it with
//   INSTANTIATE_TEST_SUITE_P(Name, StoreTest, ::testing::ValuesIn(kinds), store_kind_name);
// STYLE.md: every store implements every op, and one suite proves it.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace conformance {

using ::ferry::testing::StatusIs;
using ::testing::AllOf;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

struct StoreKind {
  std::string name;
  // Makes a fresh, empty store; `dir` is a private temporary directory.
  std::function<absl::StatusOr<std::shared_ptr<Store>>(const std::string& dir)> make;
};

inline std::string store_kind_name(const ::testing::TestParamInfo<StoreKind>& info) { return info.param.name; }

class StoreTest : public ::testing::TestWithParam<StoreKind> {
 protected:
  void SetUp() override {
    auto store = GetParam().make(dir_.path());
    ASSERT_TRUE(store.ok()) << store.status();
    store_ = *std::move(store);
  }

  ferry::testing::TempDir dir_;
  std::shared_ptr<Store> store_;
};

TEST_P(StoreTest, SetThenGet) {
  EXPECT_OK(store_->set("a", to_bytes("1")));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, store_->get("a"));
  EXPECT_EQ(to_string(v), "1");
  EXPECT_OK(store_->set("a", to_bytes("two")));
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->get("a"));
  EXPECT_EQ(to_string(v), "two");
}

TEST_P(StoreTest, ValuesAreBytes) {
  Bytes binary = {0, 1, 255, 0, 10, 13};
  EXPECT_OK(store_->set("bin", binary));
  EXPECT_OK(store_->set("empty", Bytes()));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, store_->get("bin"));
  EXPECT_EQ(v, binary);
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->get("empty", 100ms));
  EXPECT_TRUE(v.empty());
  std::string odd_key("k\0ey/\xff", 6);
  EXPECT_OK(store_->set(odd_key, to_bytes("x")));
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->get(odd_key, 100ms));
  EXPECT_EQ(to_string(v), "x");
}

TEST_P(StoreTest, GetWaitsForALaterSet) {
  std::thread setter([store = store_] {
    std::this_thread::sleep_for(50ms);
    EXPECT_OK(store->set("late", to_bytes("here")));
  });
  auto v = store_->get("late", 10s);
  setter.join();
  ASSERT_OK(v.status());
  EXPECT_EQ(to_string(*v), "here");
}

TEST_P(StoreTest, GetTimesOutNamingKeyAndTime) {
  auto start = std::chrono::steady_clock::now();
  EXPECT_THAT(store_->get("never", 200ms),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("'never'"), HasSubstr("timed out after"), HasSubstr(" ms"))));
  EXPECT_GE(std::chrono::steady_clock::now() - start, 190ms);
}

TEST_P(StoreTest, DefaultTimeoutApplies) {
  store_->set_timeout(150ms);
  EXPECT_THAT(store_->get("never"), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'never'")));
  EXPECT_THAT(store_->wait({"never"}), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'never'")));
}

TEST_P(StoreTest, AddCounts) {
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t v, store_->add("n", 5));
  EXPECT_EQ(v, 5);
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->add("n", -7));
  EXPECT_EQ(v, -2);
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->add("n", 0));
  EXPECT_EQ(v, -2);
  // A counter reads as decimal text, and text that is a number can be added to.
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes b, store_->get("n"));
  EXPECT_EQ(to_string(b), "-2");
  EXPECT_OK(store_->set("m", to_bytes("40")));
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->add("m", 2));
  EXPECT_EQ(v, 42);
}

TEST_P(StoreTest, AddRejectsNonCounterAndOverflow) {
  EXPECT_OK(store_->set("text", to_bytes("hello")));
  EXPECT_THAT(store_->add("text", 1),
              StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("'text'"), HasSubstr("not a counter"))));
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t v, store_->add("big", INT64_MAX));
  EXPECT_EQ(v, INT64_MAX);
  EXPECT_THAT(store_->add("big", 1), StatusIs(absl::StatusCode::kOutOfRange, HasSubstr("'big'")));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes b, store_->get("big"));
  EXPECT_EQ(to_string(b), std::to_string(INT64_MAX));
}

TEST_P(StoreTest, ConcurrentAddsFromThreadsLoseNothing) {
  constexpr int kThreads = 8, kAdds = 50;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([store = store_] {
      for (int i = 0; i < kAdds; ++i) EXPECT_OK(store->add("sum", 1).status());
    });
  }
  for (auto& t : threads) t.join();
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t v, store_->add("sum", 0));
  EXPECT_EQ(v, kThreads * kAdds);
}

// Owned keys: without leases (TCPStore, FileStore, HashStore) they are plain keys and
// wait_gone says it cannot watch; with leases, wait_gone reports a deleted key at once
// and a present one after its timeout, or sooner when asked to stop.
TEST_P(StoreTest, OwnedKeysAndWaitGone) {
  ASSERT_OK(store_->set_owned("owned", to_bytes("mine")));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, store_->compare_set_owned("owned", to_bytes("mine"), to_bytes("still mine")));
  EXPECT_EQ(to_string(v), "still mine");
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->get("owned"));
  EXPECT_EQ(to_string(v), "still mine");
  if (!store_->has_leases()) {
    EXPECT_EQ(store_->lease_ttl().count(), 0);
    EXPECT_EQ(store_->wait_gone({"owned"}, std::chrono::milliseconds(10), [] { return false; }).status().code(),
              absl::StatusCode::kUnimplemented);
    return;
  }
  EXPECT_GT(store_->lease_ttl().count(), 0);
  ASSERT_OK(store_->set("plain", to_bytes("p")));
  FERRY_ASSERT_OK_AND_ASSIGN(std::vector<std::string> gone,
                             store_->wait_gone({"owned", "plain"}, std::chrono::milliseconds(300), [] { return false; }));
  EXPECT_TRUE(gone.empty());
  // Asked to stop: it ends at its next look, long before its timeout.
  const auto start = std::chrono::steady_clock::now();
  FERRY_ASSERT_OK_AND_ASSIGN(gone, store_->wait_gone({"owned"}, std::chrono::seconds(30), [] { return true; }));
  EXPECT_TRUE(gone.empty());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(10));
  // A deletion by another client wakes a waiting watch.
  std::thread deleter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    EXPECT_OK(store_->delete_key("plain").status());
  });
  const auto watching = std::chrono::steady_clock::now();
  FERRY_ASSERT_OK_AND_ASSIGN(gone, store_->wait_gone({"owned", "plain"}, std::chrono::seconds(20), [] { return false; }));
  deleter.join();
  EXPECT_EQ(gone, std::vector<std::string>{"plain"});
  EXPECT_LT(std::chrono::steady_clock::now() - watching, std::chrono::seconds(10));
  // A key never set is missing at once.
  FERRY_ASSERT_OK_AND_ASSIGN(gone, store_->wait_gone({"owned", "never"}, std::chrono::seconds(20), [] { return false; }));
  EXPECT_EQ(gone, std::vector<std::string>{"never"});
}

TEST_P(StoreTest, CompareSet) {
  // Missing key and empty expectation: set.
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, store_->compare_set("c", {}, to_bytes("one")));
  EXPECT_EQ(to_string(v), "one");
  // Mismatch: unchanged, returns what is there.
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->compare_set("c", to_bytes("zero"), to_bytes("two")));
  EXPECT_EQ(to_string(v), "one");
  // Match: swapped.
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->compare_set("c", to_bytes("one"), to_bytes("two")));
  EXPECT_EQ(to_string(v), "two");
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->get("c"));
  EXPECT_EQ(to_string(v), "two");
  // Missing key, non-empty expectation: nothing set, nothing returned.
  FERRY_ASSERT_OK_AND_ASSIGN(v, store_->compare_set("d", to_bytes("x"), to_bytes("y")));
  EXPECT_TRUE(v.empty());
  FERRY_ASSERT_OK_AND_ASSIGN(bool exists, store_->check({"d"}));
  EXPECT_FALSE(exists);
}

TEST_P(StoreTest, CheckDoesNotWait) {
  FERRY_ASSERT_OK_AND_ASSIGN(bool ok, store_->check({}));
  EXPECT_TRUE(ok);
  FERRY_ASSERT_OK_AND_ASSIGN(ok, store_->check({"x"}));
  EXPECT_FALSE(ok);
  EXPECT_OK(store_->set("x", to_bytes("1")));
  FERRY_ASSERT_OK_AND_ASSIGN(ok, store_->check({"x"}));
  EXPECT_TRUE(ok);
  FERRY_ASSERT_OK_AND_ASSIGN(ok, store_->check({"x", "y"}));
  EXPECT_FALSE(ok);
}

TEST_P(StoreTest, WaitForSeveralKeys) {
  EXPECT_OK(store_->set("w1", to_bytes("1")));
  std::thread setter([store = store_] {
    std::this_thread::sleep_for(30ms);
    EXPECT_OK(store->set("w2", to_bytes("2")));
    std::this_thread::sleep_for(30ms);
    EXPECT_OK(store->set("w3", to_bytes("3")));
  });
  EXPECT_OK(store_->wait({"w1", "w2", "w3"}, 10s));
  setter.join();
  EXPECT_OK(store_->wait({}, 10ms));
}

TEST_P(StoreTest, WaitTimeoutNamesOnlyMissingKeys) {
  EXPECT_OK(store_->set("have", to_bytes("1")));
  EXPECT_THAT(store_->wait({"have", "lack1", "lack2"}, 200ms),
              StatusIs(absl::StatusCode::kDeadlineExceeded,
                       AllOf(HasSubstr("'lack1'"), HasSubstr("'lack2'"), Not(HasSubstr("'have'")),
                             HasSubstr("timed out after"))));
}

TEST_P(StoreTest, DeleteKey) {
  EXPECT_OK(store_->set("gone", to_bytes("1")));
  FERRY_ASSERT_OK_AND_ASSIGN(bool existed, store_->delete_key("gone"));
  EXPECT_TRUE(existed);
  FERRY_ASSERT_OK_AND_ASSIGN(existed, store_->delete_key("gone"));
  EXPECT_FALSE(existed);
  FERRY_ASSERT_OK_AND_ASSIGN(bool present, store_->check({"gone"}));
  EXPECT_FALSE(present);
  // A deleted counter starts again from zero.
  EXPECT_OK(store_->add("cnt", 3).status());
  EXPECT_OK(store_->delete_key("cnt").status());
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t v, store_->add("cnt", 1));
  EXPECT_EQ(v, 1);
}

TEST_P(StoreTest, NumKeys) {
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t n, store_->num_keys());
  EXPECT_EQ(n, 0);
  EXPECT_OK(store_->set("a", to_bytes("1")));
  EXPECT_OK(store_->set("b", to_bytes("1")));
  EXPECT_OK(store_->add("c", 1).status());
  EXPECT_OK(store_->set("a", to_bytes("2")));
  FERRY_ASSERT_OK_AND_ASSIGN(n, store_->num_keys());
  EXPECT_EQ(n, 3);
  EXPECT_OK(store_->delete_key("b").status());
  FERRY_ASSERT_OK_AND_ASSIGN(n, store_->num_keys());
  EXPECT_EQ(n, 2);
}

TEST_P(StoreTest, MultiSetAndMultiGet) {
  EXPECT_OK(store_->multi_set({"m1", "m2", "m3"}, {to_bytes("a"), to_bytes(""), to_bytes("c")}));
  FERRY_ASSERT_OK_AND_ASSIGN(std::vector<Bytes> values, store_->multi_get({"m3", "m1", "m2"}));
  EXPECT_THAT(values, ElementsAre(to_bytes("c"), to_bytes("a"), Bytes()));
  FERRY_ASSERT_OK_AND_ASSIGN(values, store_->multi_get({}));
  EXPECT_TRUE(values.empty());
  EXPECT_OK(store_->multi_set({}, {}));
}

TEST_P(StoreTest, MultiGetWaitsAndTimesOut) {
  EXPECT_OK(store_->set("mg1", to_bytes("1")));
  std::thread setter([store = store_] {
    std::this_thread::sleep_for(30ms);
    EXPECT_OK(store->set("mg2", to_bytes("2")));
  });
  auto values = store_->multi_get({"mg1", "mg2"}, 10s);
  setter.join();
  ASSERT_OK(values.status());
  EXPECT_THAT(*values, ElementsAre(to_bytes("1"), to_bytes("2")));
  EXPECT_THAT(store_->multi_get({"mg1", "mg9"}, 200ms),
              StatusIs(absl::StatusCode::kDeadlineExceeded, AllOf(HasSubstr("'mg9'"), Not(HasSubstr("'mg1'")))));
}

TEST_P(StoreTest, MultiSetRejectsSizeMismatch) {
  EXPECT_THAT(store_->multi_set({"a", "b"}, {to_bytes("1")}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("2 keys and 1 values")));
}

TEST_P(StoreTest, ManyWaitersWakeOnOneSet) {
  constexpr int kWaiters = 6;
  std::atomic<int> woke{0};
  std::vector<std::thread> waiters;
  for (int i = 0; i < kWaiters; ++i) {
    waiters.emplace_back([&, store = store_] {
      if (store->get("go", 10s).ok()) ++woke;
    });
  }
  std::this_thread::sleep_for(30ms);
  EXPECT_OK(store_->set("go", to_bytes("1")));
  for (auto& t : waiters) t.join();
  EXPECT_EQ(woke.load(), kWaiters);
}

}  // namespace conformance
}  // namespace ferry
