// Where a TCP store server listens: the resolver's interface by default, the store's
// own address when it is one of this host's, every interface only when asked.
#include <stdlib.h>

#include <chrono>

#include "base/net.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "store/tcp_store.h"
#include "tests/testing/status_matchers.h"

namespace ferry {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

// Whether a client reaches `port` at `host` (127.0.0.2 is on lo too, but is not
// 127.0.0.1: only a server on every interface, or on 127.0.0.2, answers there).
bool reachable(const std::string& host, uint16_t port) {
  return TCPStore::create(host, port, false, std::nullopt, 300ms).ok();
}

TEST(StoreBindTest, DefaultServerListensOnTheResolvedInterfaceNotEveryInterface) {
  setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  FERRY_ASSERT_OK_AND_ASSIGN(auto server, TCPStoreServer::create());
  unsetenv("FERRY_SOCKET_IFNAME");
  EXPECT_EQ(server->host(), "127.0.0.1");
  EXPECT_TRUE(reachable("127.0.0.1", server->port()));
  EXPECT_FALSE(reachable("127.0.0.2", server->port()));

  // Without FERRY_SOCKET_IFNAME: whatever the shared resolver picks, never a wildcard.
  FERRY_ASSERT_OK_AND_ASSIGN(auto plain, TCPStoreServer::create());
  FERRY_ASSERT_OK_AND_ASSIGN(internal::ListenAddress resolved, internal::resolve_listen_address());
  EXPECT_EQ(plain->host(), resolved.host);
  EXPECT_FALSE(internal::is_wildcard_address(plain->host()));
}

TEST(StoreBindTest, WildcardOnlyWhenAsked) {
  TCPStoreServerOptions options;
  options.host = "0.0.0.0";
  FERRY_ASSERT_OK_AND_ASSIGN(auto server, TCPStoreServer::create(options));
  EXPECT_EQ(server->host(), "0.0.0.0");
  EXPECT_TRUE(reachable("127.0.0.1", server->port()));
  EXPECT_TRUE(reachable("127.0.0.2", server->port()));
}

TEST(StoreBindTest, RankZeroListensOnTheAddressTheOthersUse) {
  FERRY_ASSERT_OK_AND_ASSIGN(auto rank0, TCPStore::create("127.0.0.1", 0, true, std::nullopt, 5s));
  EXPECT_EQ(rank0->server()->host(), "127.0.0.1");
  EXPECT_FALSE(reachable("127.0.0.2", rank0->port()));
  // A name of this host: the address it resolves to.
  FERRY_ASSERT_OK_AND_ASSIGN(auto named, TCPStore::create("localhost", 0, true, std::nullopt, 5s));
  EXPECT_TRUE(internal::is_loopback_address(named->server()->host())) << named->server()->host();
  EXPECT_OK(named->set("k", to_bytes("v")));
  // No address at all: the resolver's, which its own client then uses.
  setenv("FERRY_SOCKET_IFNAME", "lo", 1);
  absl::StatusOr<std::unique_ptr<TCPStore>> unnamed = TCPStore::create("", 0, true, std::nullopt, 5s);
  unsetenv("FERRY_SOCKET_IFNAME");
  ASSERT_OK(unnamed.status());
  EXPECT_EQ((*unnamed)->server()->host(), "127.0.0.1");
  EXPECT_OK((*unnamed)->set("k", to_bytes("v")));
  // listen_host still overrides.
  TCPStoreOptions options;
  options.host = "127.0.0.1";
  options.listen_host = "0.0.0.0";
  options.is_server = true;
  options.timeout = 5s;
  FERRY_ASSERT_OK_AND_ASSIGN(auto wide, TCPStore::create(options));
  EXPECT_TRUE(reachable("127.0.0.2", wide->port()));
}

TEST(StoreBindTest, NoUsableAddressIsAClearError) {
  setenv("FERRY_SOCKET_IFNAME", "nosuchif", 1);
  absl::StatusOr<std::unique_ptr<TCPStoreServer>> server = TCPStoreServer::create();
  unsetenv("FERRY_SOCKET_IFNAME");
  EXPECT_THAT(server, StatusIs(absl::StatusCode::kNotFound,
                               HasSubstr("store server: no address to listen on: network interface \"nosuchif\" "
                                         "(FERRY_SOCKET_IFNAME) does not exist")));
}

}  // namespace
}  // namespace ferry
