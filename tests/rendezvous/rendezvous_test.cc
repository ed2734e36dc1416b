// Rendezvous by URL: parsing, every error the handlers give, the registry, and a
// one-rank rendezvous of each built-in scheme. Real processes: rendezvous_multiprocess_test.cc.
#include "rendezvous/rendezvous.h"

#include <cstdlib>
#include <optional>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/hash_store.h"
#include "tests/testing/free_port.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::free_port;
using ::ferry::testing::StatusIs;
using ::ferry::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

// Sets (or unsets, for nullopt) an environment variable for one scope.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value->c_str(), 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_, old_->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(RendezvousUrlTest, Parses) {
  FERRY_ASSERT_OK_AND_ASSIGN(RendezvousUrl url, parse_rendezvous_url("TCP://host.example:29500/p/a%20th?rank=1&world_size=4&&x=%41"));
  EXPECT_EQ(url.scheme, "tcp");
  EXPECT_EQ(url.authority, "host.example:29500");
  EXPECT_EQ(url.host, "host.example");
  EXPECT_EQ(url.port, 29500);
  EXPECT_EQ(url.path, "/p/a th");
  EXPECT_EQ(url.query.at("rank"), "1");
  EXPECT_EQ(url.query.at("world_size"), "4");
  EXPECT_EQ(url.query.at("x"), "A");

  FERRY_ASSERT_OK_AND_ASSIGN(url, parse_rendezvous_url("tcp://[::1]:7?rank=0"));
  EXPECT_EQ(url.host, "::1");
  EXPECT_EQ(url.port, 7);

  FERRY_ASSERT_OK_AND_ASSIGN(url, parse_rendezvous_url("file:///tmp/store"));
  EXPECT_EQ(url.authority, "");
  EXPECT_EQ(url.path, "/tmp/store");
  EXPECT_FALSE(url.port.has_value());

  FERRY_ASSERT_OK_AND_ASSIGN(url, parse_rendezvous_url("env://"));
  EXPECT_EQ(url.scheme, "env");
  EXPECT_TRUE(url.query.empty());
}

TEST(RendezvousUrlTest, RejectsMalformedUrls) {
  EXPECT_THAT(parse_rendezvous_url("no-scheme-here"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("has no scheme")));
  EXPECT_THAT(parse_rendezvous_url("tcp://h:http?rank=0"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("port \"http\" is not a number in 0..65535")));
  EXPECT_THAT(parse_rendezvous_url("tcp://h:70000"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("port \"70000\"")));
  EXPECT_THAT(parse_rendezvous_url("file:///x?rank"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("malformed query parameter \"rank\"")));
  EXPECT_THAT(parse_rendezvous_url("tcp://[::1:5"), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'['")));
}

struct ErrorCase {
  std::string url;
  std::string message;
};

class RendezvousErrorTest : public ::testing::TestWithParam<ErrorCase> {};

TEST_P(RendezvousErrorTest, SaysWhatIsWrong) {
  // The environment must not fill in what the URL lacks.
  ScopedEnv rank("RANK", std::nullopt), world("WORLD_SIZE", std::nullopt), addr("MASTER_ADDR", std::nullopt),
      port("MASTER_PORT", std::nullopt);
  auto result = rendezvous(GetParam().url, 1s);
  EXPECT_THAT(result, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr(GetParam().message)));
  if (!result.ok()) {
    EXPECT_THAT(std::string(result.status().message()), HasSubstr(GetParam().url));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Urls, RendezvousErrorTest,
    ::testing::Values(
        ErrorCase{"file://?rank=0&world_size=1", "file:// rendezvous: path missing"},
        ErrorCase{"file:///tmp/x?world_size=1", "file:// rendezvous: rank parameter missing"},
        ErrorCase{"file:///tmp/x?rank=0", "file:// rendezvous: world size parameter missing"},
        ErrorCase{"file:///tmp/x", "file:// rendezvous: rank parameter missing"},
        ErrorCase{"file:///tmp/x?rank=zero&world_size=1", "rank parameter \"zero\" is not an integer"},
        ErrorCase{"file:///tmp/x?rank=0&world_size=2x", "world size parameter \"2x\" is not an integer"},
        ErrorCase{"file:///tmp/x?rank=0&world_size=99999999999", "world size parameter \"99999999999\" is not an integer"},
        ErrorCase{"file:///tmp/x?rank=2&world_size=2", "rank 2 is out of range for world size 2 (expected 0 <= rank < 2)"},
        ErrorCase{"file:///tmp/x?rank=-1&world_size=2", "rank -1 is out of range for world size 2"},
        ErrorCase{"file:///tmp/x?rank=0&world_size=0", "world size must be at least 1, got 0"},
        ErrorCase{"tcp://127.0.0.1?rank=0&world_size=1", "tcp:// rendezvous: port number missing"},
        ErrorCase{"tcp://127.0.0.1:?rank=0&world_size=1", "tcp:// rendezvous: port number missing"},
        ErrorCase{"tcp://127.0.0.1:29500?world_size=1", "tcp:// rendezvous: rank parameter missing"},
        ErrorCase{"tcp://127.0.0.1:29500?rank=0", "tcp:// rendezvous: world size parameter missing"},
        ErrorCase{"tcp://127.0.0.1:29500?rank=1&world_size=1", "rank 1 is out of range for world size 1"},
        ErrorCase{"tcp://127.0.0.1:29500?rank=a&world_size=1", "rank parameter \"a\" is not an integer"},
        ErrorCase{"tcp://:29500?rank=0&world_size=1", "tcp:// rendezvous: host missing"},
        ErrorCase{"tcp://127.0.0.1:0?rank=0&world_size=1", "port 0 is not allowed"},
        ErrorCase{"ENV://", "env:// rendezvous: url must be equal to `env://`"},
        ErrorCase{"env://", "env:// rendezvous: environment variable RANK expected, but not set"},
        ErrorCase{"env://?rank=0", "env:// rendezvous: environment variable WORLD_SIZE expected, but not set"},
        ErrorCase{"env://?rank=0&world_size=1", "env:// rendezvous: environment variable MASTER_ADDR expected, but not set"}));

TEST(RendezvousTest, EnvErrorsNameTheVariable) {
  ScopedEnv rank("RANK", "1"), world("WORLD_SIZE", "2"), addr("MASTER_ADDR", "127.0.0.1"),
      port("MASTER_PORT", std::nullopt);
  EXPECT_THAT(rendezvous("env://", 1s), StatusIs(absl::StatusCode::kInvalidArgument,
                                                 HasSubstr("environment variable MASTER_PORT expected, but not set")));
  {
    ScopedEnv bad_port("MASTER_PORT", "http");
    EXPECT_THAT(rendezvous("env://", 1s),
                StatusIs(absl::StatusCode::kInvalidArgument,
                         HasSubstr("environment variable MASTER_PORT \"http\" is not an integer")));
  }
  {
    ScopedEnv big_port("MASTER_PORT", "70000");
    EXPECT_THAT(rendezvous("env://", 1s),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("port 70000 is out of range (expected 1..65535)")));
  }
  ScopedEnv ok_port("MASTER_PORT", "29500");
  {
    ScopedEnv bad_rank("RANK", "one");
    EXPECT_THAT(rendezvous("env://", 1s), StatusIs(absl::StatusCode::kInvalidArgument,
                                                   HasSubstr("environment variable RANK \"one\" is not an integer")));
    // A query parameter wins over the environment, so its value is the one judged.
    EXPECT_THAT(rendezvous("env://?rank=5", 1s),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank 5 is out of range for world size 2")));
  }
  {
    ScopedEnv bad_world("WORLD_SIZE", "0");
    EXPECT_THAT(rendezvous("env://", 1s),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("world size must be at least 1, got 0")));
  }
  {
    ScopedEnv empty_addr("MASTER_ADDR", "");
    EXPECT_THAT(rendezvous("env://", 1s),
                StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("environment variable MASTER_ADDR is empty")));
  }
}

TEST(RendezvousTest, UnknownSchemeHasNoHandler) {
  EXPECT_THAT(rendezvous("nosuch://x", 1s),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("no rendezvous handler for nosuch://")));
  EXPECT_THAT(rendezvous("missing-scheme", 1s), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no scheme")));
}

// etcd:// always has a handler: with EtcdStore it reaches for the cluster (none here),
// without it (FERRY_WITH_ETCD=OFF) it says how to build it.
TEST(RendezvousTest, EtcdUrlWithoutAClusterOrWithoutEtcdStoreIsAClearError) {
  EXPECT_TRUE(rendezvous_handler_registered("etcd"));
  absl::StatusOr<RendezvousResult> r = rendezvous("etcd://127.0.0.1:1/job?rank=0&world_size=1", 1s);
#ifdef FERRY_HAVE_ETCD
  EXPECT_THAT(r, StatusIs(absl::StatusCode::kUnavailable, HasSubstr("tried 127.0.0.1:1")));
#else
  EXPECT_THAT(r, StatusIs(absl::StatusCode::kFailedPrecondition,
                          AllOf(HasSubstr("no EtcdStore"), HasSubstr("-DFERRY_WITH_ETCD=ON"))));
#endif
}

TEST(RendezvousTest, RegistryRejectsDuplicatesAndEmptyHandlers) {
  EXPECT_TRUE(rendezvous_handler_registered("file"));
  EXPECT_TRUE(rendezvous_handler_registered("tcp"));
  EXPECT_TRUE(rendezvous_handler_registered("env"));
  auto handler = [](const RendezvousUrl&, std::chrono::milliseconds) -> absl::StatusOr<RendezvousResult> {
    return RendezvousResult{std::make_shared<HashStore>(), 0, 1};
  };
  EXPECT_THAT(register_rendezvous_handler("file", handler),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("rendezvous handler for file:// already registered")));
  EXPECT_THAT(register_rendezvous_handler("", handler),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("scheme is empty")));
  EXPECT_THAT(register_rendezvous_handler("nullhandler", nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("handler for nullhandler:// is empty")));
  EXPECT_FALSE(rendezvous_handler_registered("nullhandler"));
}

TEST(RendezvousTest, UserHandlerGetsTheParsedUrlAndTimeout) {
  std::string seen_path;
  std::chrono::milliseconds seen_timeout{0};
  auto store = std::make_shared<HashStore>();
  ASSERT_OK(register_rendezvous_handler(
      "Mem", [&](const RendezvousUrl& url, std::chrono::milliseconds timeout) -> absl::StatusOr<RendezvousResult> {
        seen_path = url.path;
        seen_timeout = timeout;
        return RendezvousResult{store, std::stoi(url.query.at("rank")), 3};
      }));
  EXPECT_THAT(register_rendezvous_handler("mem", nullptr), StatusIs(absl::StatusCode::kInvalidArgument, ::testing::_));
  EXPECT_THAT(register_rendezvous_handler("MEM", [](const RendezvousUrl&, std::chrono::milliseconds)
                                                     -> absl::StatusOr<RendezvousResult> { return RendezvousResult{}; }),
              StatusIs(absl::StatusCode::kAlreadyExists, HasSubstr("mem:// already registered")));
  FERRY_ASSERT_OK_AND_ASSIGN(RendezvousResult r, rendezvous("mem://host/job?rank=2", 123ms));
  EXPECT_EQ(r.store, store);
  EXPECT_EQ(r.rank, 2);
  EXPECT_EQ(r.world_size, 3);
  EXPECT_EQ(seen_path, "/job");
  EXPECT_EQ(seen_timeout, 123ms);
}

TEST(RendezvousTest, SingleRankFileAndTcpAndEnv) {
  TempDir dir;
  {
    FERRY_ASSERT_OK_AND_ASSIGN(RendezvousResult r,
                               rendezvous("file://" + dir.path() + "/store?rank=0&world_size=1", 5s));
    EXPECT_EQ(r.rank, 0);
    EXPECT_EQ(r.world_size, 1);
    EXPECT_EQ(r.store->timeout(), 5s);
    EXPECT_OK(r.store->set("k", to_bytes("v")));
  }
  {
    uint16_t port = free_port();
    FERRY_ASSERT_OK_AND_ASSIGN(RendezvousResult r,
                               rendezvous("tcp://127.0.0.1:" + std::to_string(port) + "?rank=0&world_size=1", 5s));
    EXPECT_EQ(r.world_size, 1);
    EXPECT_OK(r.store->set("k", to_bytes("v")));
  }
  {
    ScopedEnv rank("RANK", "0"), world("WORLD_SIZE", "1"), addr("MASTER_ADDR", "127.0.0.1"),
        port("MASTER_PORT", std::to_string(free_port()));
    FERRY_ASSERT_OK_AND_ASSIGN(RendezvousResult r, rendezvous("env://", 5s));
    EXPECT_EQ(r.rank, 0);
    EXPECT_EQ(r.world_size, 1);
    EXPECT_OK(r.store->set("k", to_bytes("v")));
  }
}

TEST(RendezvousTest, FileRunIdKeepsRunsApart) {
  ferry::testing::TempDir dir;
  std::string path = dir.path() + "/store";
  FERRY_ASSERT_OK_AND_ASSIGN(RendezvousResult first,
                             rendezvous("file://" + path + "?rank=0&world_size=1&run_id=run1", 5s));
  EXPECT_OK(first.store->set("addr/0", to_bytes("run1")));
  FERRY_ASSERT_OK_AND_ASSIGN(RendezvousResult second,
                             rendezvous("file://" + path + "?rank=0&world_size=1&run_id=run2", 5s));
  FERRY_ASSERT_OK_AND_ASSIGN(bool stale, second.store->check({"addr/0"}));
  EXPECT_FALSE(stale) << "run2 must not read run1's address";
  EXPECT_THAT(rendezvous("file://" + path + "?rank=0&world_size=1&run_id=", 5s),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("run_id must be 1 to 255 characters")));
}

}  // namespace
}  // namespace ferry
