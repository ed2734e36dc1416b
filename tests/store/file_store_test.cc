// FileStore specifics: several objects on one file, cleanup by world size, recovery
// from a writer that died mid-record. Cross-process behaviour is in
// store_multiprocess_test.cc.
#include <fcntl.h>
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

}  // namespace
}  // namespace ferry
