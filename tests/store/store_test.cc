// One suite, every store: each Store operation (tests/store/store_conformance.h) runs
// against HashStore, FileStore, PrefixStore over HashStore and TCPStore (STYLE.md: every
// store implements every op). EtcdStore runs the same suite in etcd_store_test.cc.
#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/file_store.h"
#include "store/hash_store.h"
#include "store/prefix_store.h"
#include "store/store.h"
#include "store/tcp_store.h"
#include "tests/store/store_conformance.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::conformance::store_kind_name;
using ::ferry::conformance::StoreKind;
using ::ferry::conformance::StoreTest;
using ::ferry::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;

std::vector<StoreKind> store_kinds() {
  return {
      {"HashStore", [](const std::string&) -> absl::StatusOr<std::shared_ptr<Store>> {
         return std::make_shared<HashStore>();
       }},
      {"FileStore", [](const std::string& dir) -> absl::StatusOr<std::shared_ptr<Store>> {
         return FileStore::create(dir + "/store");
       }},
      {"PrefixStore", [](const std::string&) -> absl::StatusOr<std::shared_ptr<Store>> {
         return std::make_shared<PrefixStore>("pre", std::make_shared<HashStore>());
       }},
      {"TCPStore", [](const std::string&) -> absl::StatusOr<std::shared_ptr<Store>> {
         TCPStoreOptions options;
         options.host = "127.0.0.1";
         options.port = 0;
         options.is_server = true;
         options.timeout = 10s;
         return TCPStore::create(options);
       }},
  };
}

INSTANTIATE_TEST_SUITE_P(AllStores, StoreTest, ::testing::ValuesIn(store_kinds()), store_kind_name);

TEST(PrefixStoreTest, KeysLandUnderThePrefix) {
  auto base = std::make_shared<HashStore>();
  PrefixStore a("a", base), b("b", base);
  EXPECT_OK(a.set("k", to_bytes("from a")));
  EXPECT_OK(b.set("k", to_bytes("from b")));
  FERRY_ASSERT_OK_AND_ASSIGN(Bytes v, base->get("a/k", 10ms));
  EXPECT_EQ(to_string(v), "from a");
  FERRY_ASSERT_OK_AND_ASSIGN(v, b.get("k"));
  EXPECT_EQ(to_string(v), "from b");
  // Errors name the caller's key, not the prefixed one.
  EXPECT_THAT(a.get("missing", 50ms), StatusIs(absl::StatusCode::kDeadlineExceeded,
                                               AllOf(HasSubstr("'missing'"), Not(HasSubstr("a/missing")))));
  PrefixStore nested("outer", std::make_shared<PrefixStore>("inner", base));
  EXPECT_OK(nested.set("k", to_bytes("deep")));
  FERRY_ASSERT_OK_AND_ASSIGN(v, base->get("inner/outer/k", 10ms));
  EXPECT_EQ(to_string(v), "deep");
}

}  // namespace
}  // namespace ferry
