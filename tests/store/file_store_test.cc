// FileStore specifics: several objects on one file, cleanup by world size, recovery
// from a writer that died mid-record. Cross-process behaviour is in
// store_multiprocess_test.cc.
#include <fcntl.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/file_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

bool exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

TEST(FileStoreTest, TwoObjectsOnOneFileShareKeys) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  FERRY_ASSERT_OK_AND_ASSIGN(auto a, FileStore::create(path));
  FERRY_ASSERT_OK_AND_ASSIGN(auto b, FileStore::create(path));
  EXPECT_OK(a->set("k", to_bytes("v")));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, b->get("k", 100ms));
  EXPECT_EQ(to_string(v), "v");
  EXPECT_OK(b->add("n", 2).status());
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t n, a->add("n", 3));
  EXPECT_EQ(n, 5);
  EXPECT_OK(a->delete_key("k").status());
  FERRY_ASSERT_OK_AND_ASSIGN(bool present, b->check({"k"}));
  EXPECT_FALSE(present);
}

TEST(FileStoreTest, LastOfWorldSizeRemovesTheFile) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  {
    FERRY_ASSERT_OK_AND_ASSIGN(auto a, FileStore::create(path, {.world_size = 2}));
    {
      FERRY_ASSERT_OK_AND_ASSIGN(auto b, FileStore::create(path, {.world_size = 2}));
      EXPECT_OK(b->set("k", to_bytes("v")));
    }
    EXPECT_TRUE(exists(path));
    // The close record is not a key.
    FERRY_ASSERT_OK_AND_ASSIGN(int64_t n, a->num_keys());
    EXPECT_EQ(n, 1);
  }
  EXPECT_FALSE(exists(path));
  {
    FERRY_ASSERT_OK_AND_ASSIGN(auto c, FileStore::create(path));
    EXPECT_OK(c->set("k", to_bytes("v")));
  }
  EXPECT_TRUE(exists(path)) << "without world_size the file stays";
}

TEST(FileStoreTest, PartialTrailingRecordIsIgnoredThenDropped) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  FERRY_ASSERT_OK_AND_ASSIGN(auto a, FileStore::create(path));
  EXPECT_OK(a->set("k", to_bytes("v")));
  {
    // A writer that died after writing half a record.
    std::ofstream f(path, std::ios::binary | std::ios::app);
    const char partial[] = {1, 5, 0, 0, 0, 1, 0, 0, 0, 'a', 'b'};
    f.write(partial, sizeof(partial));
  }
  FERRY_ASSERT_OK_AND_ASSIGN(auto b, FileStore::create(path));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, b->get("k", 100ms));
  EXPECT_EQ(to_string(v), "v");
  EXPECT_OK(b->set("k2", to_bytes("w")));
  FERRY_ASSERT_OK_AND_ASSIGN(v, a->get("k2", 100ms));
  EXPECT_EQ(to_string(v), "w");
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t n, a->num_keys());
  EXPECT_EQ(n, 2);
}

TEST(FileStoreTest, TheFileIsPrivateToItsUser) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  ASSERT_OK(FileStore::create(path).status());
  struct stat st;
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST(FileStoreTest, ASymbolicLinkIsNotFollowed) {
  ferry::testing::TempDir dir;
  std::string target = dir.path() + "/elsewhere";
  std::string path = dir.path() + "/s";
  ASSERT_EQ(::symlink(target.c_str(), path.c_str()), 0);
  EXPECT_THAT(FileStore::create(path), StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("symbolic link")));
  EXPECT_FALSE(exists(target));  // nothing was created through it
}

TEST(FileStoreTest, AFileOthersMayWriteIsRefused) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  ASSERT_OK(FileStore::create(path).status());
  ASSERT_EQ(::chmod(path.c_str(), 0666), 0);
  EXPECT_THAT(FileStore::create(path),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("writable by everyone (mode 666)")));
  ASSERT_EQ(::chmod(path.c_str(), 0620), 0);
  EXPECT_THAT(FileStore::create(path), StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("by its group")));
}

TEST(FileStoreTest, AnotherUsersFileIsRefused) {
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to give a file to another user";
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  ASSERT_OK(FileStore::create(path).status());
  ASSERT_EQ(::chown(path.c_str(), 65534, 65534), 0);  // nobody
  EXPECT_THAT(FileStore::create(path),
              StatusIs(absl::StatusCode::kPermissionDenied, HasSubstr("belongs to uid 65534, not to this user")));
}

TEST(FileStoreTest, ForeignFileIsDataLoss) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  {
    std::ofstream f(path, std::ios::binary);
    f << "this is not a store file at all";
  }
  EXPECT_THAT(FileStore::create(path), StatusIs(absl::StatusCode::kDataLoss, HasSubstr("not a ferry store file")));
}

TEST(FileStoreTest, BadArguments) {
  EXPECT_THAT(FileStore::create(""), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("path is empty")));
  EXPECT_THAT(FileStore::create("/tmp/x", {.world_size = 0}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world_size must be at least 1, got 0")));
  EXPECT_THAT(FileStore::create("/nonexistent-dir/sub/s"),
              StatusIs(absl::StatusCode::kUnavailable, HasSubstr("cannot open /nonexistent-dir/sub/s")));
}

off_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

TEST(FileStoreTest, MultiSetIsAllOrNothingAcrossACrash) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  FERRY_ASSERT_OK_AND_ASSIGN(auto a, FileStore::create(path));
  EXPECT_OK(a->set("before", to_bytes("b")));
  off_t size_before = file_size(path);
  EXPECT_OK(a->multi_set({"x", "y", "z"}, {to_bytes("1"), to_bytes("2"), to_bytes("3")}));
  off_t size_after = file_size(path);
  ASSERT_GT(size_after, size_before);
  // The writer died before the last byte of the multi_set reached the file: none of
  // its keys exist, whichever byte it was.
  for (off_t cut : {size_before + 1, (size_before + size_after) / 2, size_after - 1}) {
    ASSERT_EQ(::truncate(path.c_str(), cut), 0);
    FERRY_ASSERT_OK_AND_ASSIGN(auto b, FileStore::create(path));
    FERRY_ASSERT_OK_AND_ASSIGN(bool any, b->check({"x"}));
    EXPECT_FALSE(any) << "cut at " << cut;
    FERRY_ASSERT_OK_AND_ASSIGN(bool z, b->check({"z"}));
    EXPECT_FALSE(z) << "cut at " << cut;
    FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, b->get("before", 100ms));
    EXPECT_EQ(to_string(v), "b");
  }
  // Whole, it applies whole.
  FERRY_ASSERT_OK_AND_ASSIGN(auto c, FileStore::create(path));
  EXPECT_OK(c->multi_set({"x", "y"}, {to_bytes("1"), to_bytes("2")}));
  FERRY_ASSERT_OK_AND_ASSIGN(auto both, a->multi_get({"x", "y"}, 100ms));
  EXPECT_EQ(to_string(both[1]), "2");
}

TEST(FileStoreTest, ZeroFilledTailCountsAsTorn) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  FERRY_ASSERT_OK_AND_ASSIGN(auto a, FileStore::create(path));
  EXPECT_OK(a->set("k", to_bytes("v")));
  off_t good = file_size(path);
  {
    // A crash after the file grew but before its data reached the disk.
    std::ofstream f(path, std::ios::binary | std::ios::app);
    std::string zeros(4096, '\0');
    f.write(zeros.data(), static_cast<std::streamsize>(zeros.size()));
  }
  FERRY_ASSERT_OK_AND_ASSIGN(auto b, FileStore::create(path));
  FERRY_ASSERT_OK_AND_ASSIGN(int64_t n, b->num_keys());
  EXPECT_EQ(n, 1);
  EXPECT_OK(b->set("k2", to_bytes("w")));
  EXPECT_LT(file_size(path), good + 4096) << "the zeros were cut away";
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, a->get("k2", 100ms));
  EXPECT_EQ(to_string(v), "w");
}

TEST(FileStoreTest, AnotherRunIdStartsAFreshFile) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  FileStoreOptions run1;
  run1.run_id = "run-1";
  FileStoreOptions run2;
  run2.run_id = "run-2";
  FERRY_ASSERT_OK_AND_ASSIGN(auto old, FileStore::create(path, run1));
  EXPECT_EQ(old->run_id(), "run-1");
  EXPECT_OK(old->set("addr/0", to_bytes("stale")));
  FERRY_ASSERT_OK_AND_ASSIGN(auto fresh, FileStore::create(path, run2));
  FERRY_ASSERT_OK_AND_ASSIGN(bool stale, fresh->check({"addr/0"}));
  EXPECT_FALSE(stale) << "the last run's keys are gone";
  EXPECT_OK(fresh->set("addr/0", to_bytes("new")));
  FERRY_ASSERT_OK_AND_ASSIGN(auto peer, FileStore::create(path, run2));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, peer->get("addr/0", 100ms));
  EXPECT_EQ(to_string(v), "new");
  // A store without a run id joins whatever run the file has.
  FERRY_ASSERT_OK_AND_ASSIGN(auto any, FileStore::create(path));
  EXPECT_EQ(any->run_id(), "run-2");
  // The straggler of run 1 keeps its own file.
  FERRY_ASSERT_OK_AND_ASSIGN(v, old->get("addr/0", 100ms));
  EXPECT_EQ(to_string(v), "stale");
  EXPECT_THAT(FileStore::create(path, {.run_id = std::string(300, 'r')}),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("run_id must be 1 to 255 bytes, got 300")));
}

TEST(FileStoreTest, PathReusedAfterACrashNeverCountsTheLastRunsCloses) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  // Run 1: two ranks join, one closes, the other crashes (no close record).
  {
    FERRY_ASSERT_OK_AND_ASSIGN(auto a, FileStore::create(path, {.world_size = 2}));
    EXPECT_OK(a->set("addr/0", to_bytes("run1")));
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      auto b = FileStore::create(path, {.world_size = 2});
      if (!b.ok() || !(*b)->set("addr/1", to_bytes("run1")).ok()) ::_exit(1);
      ::_exit(0);  // crashes: no destructor, no close record
    }
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  EXPECT_TRUE(exists(path)) << "one close of two: the file stays";
  // Run 2 on the same path: its first close must not remove the file under its peer.
  FERRY_ASSERT_OK_AND_ASSIGN(auto c, FileStore::create(path, {.world_size = 2}));
  FERRY_ASSERT_OK_AND_ASSIGN(bool stale, c->check({"addr/0"}));
  EXPECT_FALSE(stale) << "run 1's keys are not run 2's";
  EXPECT_OK(c->set("addr/0", to_bytes("run2")));
  {
    FERRY_ASSERT_OK_AND_ASSIGN(auto d, FileStore::create(path, {.world_size = 2}));
    FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, d->get("addr/0", 100ms));
    EXPECT_EQ(to_string(v), "run2");
  }
  EXPECT_TRUE(exists(path)) << "one close of run 2";
  c.reset();
  EXPECT_FALSE(exists(path)) << "both of run 2 closed";
}

TEST(FileStoreTest, NextRunWhileTheLastOneIsStillClosingGetsItsOwnFile) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  FERRY_ASSERT_OK_AND_ASSIGN(auto a1, FileStore::create(path, {.world_size = 2}));
  FERRY_ASSERT_OK_AND_ASSIGN(auto b1, FileStore::create(path, {.world_size = 2}));
  EXPECT_OK(a1->set("addr", to_bytes("run1")));
  a1.reset();
  // Rank 0 of run 2 starts while rank 1 of run 1 has not closed yet.
  FERRY_ASSERT_OK_AND_ASSIGN(auto a2, FileStore::create(path, {.world_size = 2}));
  FERRY_ASSERT_OK_AND_ASSIGN(bool stale, a2->check({"addr"}));
  EXPECT_FALSE(stale);
  b1.reset();  // run 1's last close: must not remove run 2's file
  EXPECT_TRUE(exists(path));
  EXPECT_OK(a2->set("addr", to_bytes("run2")));
  FERRY_ASSERT_OK_AND_ASSIGN(auto b2, FileStore::create(path, {.world_size = 2}));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, b2->get("addr", 100ms));
  EXPECT_EQ(to_string(v), "run2");
}

TEST(FileStoreTest, LockHeldElsewhereFailsAtTheTimeoutInsteadOfBlocking) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  FERRY_ASSERT_OK_AND_ASSIGN(auto a, FileStore::create(path, {.timeout = 200ms}));
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX), 0);  // a hung process holding the lock
  EXPECT_THAT(a->set("k", to_bytes("v")),
              StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("waiting for the file lock")));
  EXPECT_THAT(a->get("k", 100ms), StatusIs(absl::StatusCode::kDeadlineExceeded, HasSubstr("file lock")));
  ::flock(fd, LOCK_UN);
  ::close(fd);
  EXPECT_OK(a->set("k", to_bytes("v")));
}

TEST(FileStoreTest, FsyncOptionWritesThrough) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  FERRY_ASSERT_OK_AND_ASSIGN(auto a, FileStore::create(path, {.fsync = true}));
  EXPECT_OK(a->set("k", to_bytes("v")));
  EXPECT_OK(a->multi_set({"x"}, {to_bytes("y")}));
  FERRY_ASSERT_OK_AND_ASSIGN(auto b, FileStore::create(path));
  FERRY_ASSERT_OK_AND_ASSIGN(auto vs, b->multi_get({"k", "x"}, 100ms));
  EXPECT_EQ(to_string(vs[1]), "y");
}

TEST(FileStoreTest, FileOfAnEarlierFormatIsRefusedByName) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/s";
  {
    std::ofstream f(path, std::ios::binary);
    f << "FERRYFS1";
  }
  EXPECT_THAT(FileStore::create(path),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("written by another ferry version")));
}

}  // namespace
}  // namespace ferry
