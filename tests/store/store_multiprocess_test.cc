// Stores under real processes (forked by run_processes, loopback only, port 0).
// Rank 0 hosts the TCPStore server and publishes its port through a FileStore in a
// temporary directory, which doubles as a test of the FileStore across processes.
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/file_store.h"
#include "store/tcp_store.h"
#include "tests/store/raw_socket.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::expect_all_succeed;
using ::ferry::testing::frame;
using ::ferry::testing::hello;
using ::ferry::testing::put_str;
using ::ferry::testing::put_u32;
using ::ferry::testing::RawSocket;
using ::ferry::testing::run_processes;
using ::ferry::testing::StatusIs;
using ::ferry::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

FileStoreOptions file_options(std::chrono::milliseconds timeout) {
  FileStoreOptions options;
  options.timeout = timeout;
  return options;
}

// Rank 0: a TCPStore hosting the server; other ranks: a client. The port travels
// through a FileStore at dir/port.
std::unique_ptr<TCPStore> join_tcp_store(const std::string& dir, int rank, std::chrono::milliseconds timeout = 20s) {
  auto file = FileStore::create(dir + "/port", file_options(20s));
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return nullptr;
  if (rank == 0) {
    auto store = TCPStore::create("127.0.0.1", 0, true, std::nullopt, timeout);
    EXPECT_TRUE(store.ok()) << store.status();
    if (!store.ok()) return nullptr;
    EXPECT_OK((*file)->set("port", to_bytes(std::to_string((*store)->port()))));
    return *std::move(store);
  }
  auto port = (*file)->get("port");
  EXPECT_TRUE(port.ok()) << port.status();
  if (!port.ok()) return nullptr;
  auto store = TCPStore::create("127.0.0.1", static_cast<uint16_t>(std::stoi(to_string(*port))), false, std::nullopt,
                                timeout);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

// Rank 0 keeps the server up until every other rank said it is done.
void finish(Store& store, int rank, int n) {
  EXPECT_OK(store.set("done/" + std::to_string(rank), to_bytes("1")));
  if (rank == 0) {
    std::vector<std::string> all;
    for (int r = 1; r < n; ++r) all.push_back("done/" + std::to_string(r));
    EXPECT_OK(store.wait(all, 30s));
  }
}

TEST(StoreMultiProcessTest, SixteenProcessesRacingAddEndWithTheExactSum) {
  constexpr int kProcs = 16, kAdds = 50;
  TempDir dir;
  expect_all_succeed(run_processes(kProcs, [&](int rank) {
    auto store = join_tcp_store(dir.path(), rank);
    ASSERT_NE(store, nullptr);
    EXPECT_OK(store->add("arrived", 1).status());
    // Start together, so the adds really race.
    while (true) {
      auto arrived = store->add("arrived", 0);
      ASSERT_OK(arrived.status());
      if (*arrived == kProcs) break;
      std::this_thread::sleep_for(1ms);
    }
    for (int i = 0; i < kAdds; ++i) EXPECT_OK(store->add("sum", rank + 1).status());
    EXPECT_OK(store->set("added/" + std::to_string(rank), to_bytes("1")));
    std::vector<std::string> all;
    for (int r = 0; r < kProcs; ++r) all.push_back("added/" + std::to_string(r));
    EXPECT_OK(store->wait(all, 30s));
    FERRY_ASSERT_OK_AND_ASSIGN(int64_t sum, store->add("sum", 0));
    EXPECT_EQ(sum, int64_t{kAdds} * kProcs * (kProcs + 1) / 2);
    finish(*store, rank, kProcs);
  }, 60s));
}

TEST(StoreMultiProcessTest, GetWaitsForAKeyAnotherProcessSetsLater) {
  TempDir dir;
  expect_all_succeed(run_processes(3, [&](int rank) {
    auto store = join_tcp_store(dir.path(), rank);
    ASSERT_NE(store, nullptr);
    if (rank == 2) {
      EXPECT_OK(store->wait({"waiting/1"}, 20s));
      std::this_thread::sleep_for(100ms);
      EXPECT_OK(store->set("late", to_bytes("from rank 2")));
    } else if (rank == 1) {
      EXPECT_OK(store->set("waiting/1", to_bytes("1")));
      // "late" cannot exist before rank 2 saw "waiting/1", so this get had to wait.
      FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, store->get("late", 20s));
      EXPECT_EQ(to_string(v), "from rank 2");
    }
    finish(*store, rank, 3);
  }));
}

TEST(StoreMultiProcessTest, TimeoutsNameTheKeyAndTheTimeWaited) {
  TempDir dir;
  expect_all_succeed(run_processes(2, [&](int rank) {
    auto store = join_tcp_store(dir.path(), rank);
    ASSERT_NE(store, nullptr);
    if (rank == 1) {
      auto start = std::chrono::steady_clock::now();
      EXPECT_THAT(store->get("nobody/sets/this", 300ms),
                  StatusIs(absl::StatusCode::kDeadlineExceeded,
                           AllOf(HasSubstr("'nobody/sets/this'"), ::testing::ContainsRegex("after [0-9]+ ms"))));
      EXPECT_GE(std::chrono::steady_clock::now() - start, 290ms);
      EXPECT_THAT(store->wait({"done/0", "also/missing"}, 200ms),
                  StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("'also/missing'")));
    }
    finish(*store, rank, 2);
  }));
}

TEST(StoreMultiProcessTest, ClientOfADeadServerGetsAnErrorNotAHang) {
  TempDir dir;
  expect_all_succeed(run_processes(2, [&](int rank) {
    auto store = join_tcp_store(dir.path(), rank, 30s);
    ASSERT_NE(store, nullptr);
    if (rank == 0) {
      EXPECT_OK(store->wait({"parked/1"}, 20s));
      std::this_thread::sleep_for(100ms);
      // Die without any cleanup: the kernel closes the sockets, as for a crash.
      std::fflush(stderr);
      _exit(::testing::Test::HasFailure() ? 1 : 0);
    }
    EXPECT_OK(store->set("parked/1", to_bytes("1")));
    auto start = std::chrono::steady_clock::now();
    EXPECT_THAT(store->get("never", 30s), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("store server")));
    EXPECT_THAT(store->add("k", 1), StatusIs(absl::StatusCode::kUnavailable, HasSubstr("store server")));
    EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  }));
}

TEST(StoreMultiProcessTest, MalformedRequestsDoNotDisturbOtherClients) {
  TempDir dir;
  expect_all_succeed(run_processes(3, [&](int rank) {
    auto store = join_tcp_store(dir.path(), rank);
    ASSERT_NE(store, nullptr);
    if (rank == 1) {
      // The well-behaved client: keys set before, during and after the abuse.
      EXPECT_OK(store->set("good/before", to_bytes("1")));
      EXPECT_OK(store->set("good/ready", to_bytes("1")));
      FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, store->get("abuse/done", 20s));
      FERRY_ASSERT_OK_AND_ASSIGN(v, store->get("good/before", 1s));
      EXPECT_EQ(to_string(v), "1");
      EXPECT_OK(store->set("good/after", to_bytes("1")));
      FERRY_ASSERT_OK_AND_ASSIGN(int64_t n, store->add("good/count", 5));
      EXPECT_EQ(n, 5);
    } else if (rank == 2) {
      EXPECT_OK(store->wait({"good/ready"}, 20s));
      uint16_t port = store->port();
      auto abuse = [port](const std::vector<uint8_t>& bytes, bool greet) {
        RawSocket raw(port);
        EXPECT_TRUE(raw.connected());
        if (greet) {
          raw.send(hello());
          EXPECT_EQ(raw.receive(9, 5s).size(), 9u);
        }
        raw.send(bytes);
        EXPECT_TRUE(raw.closed_by_peer(5s));
      };
      abuse({'g', 'a', 'r', 'b', 'a', 'g', 'e', '!', '!', '!', '!', '!'}, false);
      abuse({0xff, 0xff, 0xff, 0x7f}, true);  // 2 GiB claimed
      std::vector<uint8_t> truncated{2};     // set, value length beyond the frame
      put_str(truncated, "good/before");
      put_u32(truncated, 1 << 20);
      abuse(frame(truncated), true);
      abuse(frame({77}), true);
      EXPECT_OK(store->set("abuse/done", to_bytes("1")));
    }
    finish(*store, rank, 3);
    if (rank == 0) {
      FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, store->get("good/after", 1s));
      EXPECT_EQ(to_string(v), "1");
    }
  }));
}

TEST(StoreMultiProcessTest, FileStoreUnderConcurrentProcessesLosesNoUpdate) {
  constexpr int kProcs = 8, kAdds = 40;
  TempDir dir;
  std::string path = dir.path() + "/store";
  expect_all_succeed(run_processes(kProcs, [&](int rank) {
    auto store = FileStore::create(path, file_options(30s));
    ASSERT_TRUE(store.ok()) << store.status();
    for (int i = 0; i < kAdds; ++i) {
      EXPECT_OK((*store)->add("sum", 1).status());
      EXPECT_OK((*store)->set("rank" + std::to_string(rank) + "/" + std::to_string(i), to_bytes("x")));
    }
    EXPECT_OK((*store)->set("done/" + std::to_string(rank), to_bytes("1")));
    std::vector<std::string> all;
    for (int r = 0; r < kProcs; ++r) all.push_back("done/" + std::to_string(r));
    EXPECT_OK((*store)->wait(all, 30s));
    FERRY_ASSERT_OK_AND_ASSIGN(int64_t sum, (*store)->add("sum", 0));
    EXPECT_EQ(sum, kProcs * kAdds);
    FERRY_ASSERT_OK_AND_ASSIGN(int64_t keys, (*store)->num_keys());
    EXPECT_EQ(keys, 1 + kProcs * kAdds + kProcs);
  }, 60s));
}

}  // namespace
}  // namespace ferry
