// The listen-address resolver (base/net.h) over made-up interfaces, routes and host
// names, plus one check against this machine's real view.
#include "base/net.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace ferry::internal {
namespace {

using ::ferry::testing::StatusIs;
using ::testing::HasSubstr;

// A cloud VM: lo, eth0 on 10.1.0.0/16 with a default route, docker0 on 172.17.0.0/16,
// eth1 (IPv6 only) on 2001:db8:5::/64, and a host name that resolves to 127.0.0.1.
NetworkView vm() {
  NetworkView v;
  v.interfaces = {
      {"lo", "127.0.0.1"},         {"lo", "::1"},
      {"eth0", "10.1.2.3"},        {"eth0", "fe80::a"},
      {"docker0", "172.17.0.1"},   {"eth1", "fe80::b"},
      {"eth1", "2001:db8:5::7"},   {"tun0", ""},
      {"ll0", "fe80::c"},
  };
  v.routes = {
      {"eth0", "0.0.0.0", 0, 100},        {"eth0", "10.1.0.0", 16, 100},  {"docker0", "172.17.0.0", 16, 0},
      {"eth1", "2001:db8:5::", 64, 256},  {"eth1", "::", 0, 1024},        {"lo", "127.0.0.0", 8, 0},
  };
  v.hostname = "vm";
  v.hostname_addresses = {"127.0.0.1"};
  return v;
}

ListenRequest store_at(std::string host, std::vector<std::string> addresses) {
  ListenRequest r;
  r.store_host = std::move(host);
  r.store_addresses = std::move(addresses);
  return r;
}

TEST(ChooseListenAddressTest, IfnameWinsOverEverything) {
  ListenRequest r = store_at("10.1.9.9", {"10.1.9.9"});
  r.ifname = "docker0";
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_listen_address(vm(), r));
  EXPECT_EQ(a.host, "172.17.0.1");
  EXPECT_EQ(a.source, "interface docker0 (FERRY_SOCKET_IFNAME)");
  // Even over a host name that resolves to a routable address.
  NetworkView named = vm();
  named.hostname_addresses = {"10.1.2.3"};
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(named, r));
  EXPECT_EQ(a.host, "172.17.0.1");
}

TEST(ChooseListenAddressTest, BadIfnameIsAClearErrorNeverAFallBack) {
  ListenRequest r = store_at("10.1.9.9", {"10.1.9.9"});
  r.ifname = "nosuchif";
  EXPECT_THAT(choose_listen_address(vm(), r),
              StatusIs(absl::StatusCode::kNotFound,
                       "network interface \"nosuchif\" (FERRY_SOCKET_IFNAME) does not exist; interfaces on this "
                       "host: docker0, eth0, eth1, ll0, lo, tun0"));
  r.ifname = "tun0";
  EXPECT_THAT(choose_listen_address(vm(), r),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       "network interface \"tun0\" (FERRY_SOCKET_IFNAME) has no IPv4 or IPv6 address"));
}

TEST(ChooseListenAddressTest, RoutableHostNameIsUsed) {
  NetworkView v = vm();
  v.hostname_addresses = {"2001:db8:5::7", "10.1.2.3"};  // IPv4 preferred
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_listen_address(v, store_at("172.17.0.9", {"172.17.0.9"})));
  EXPECT_EQ(a.host, "10.1.2.3");
  EXPECT_EQ(a.source, "host name vm");
}

TEST(ChooseListenAddressTest, LoopbackHostNameWithRemoteStorePicksTheRoutedInterface) {
  // 10.1.9.9 matches both the default route and 10.1.0.0/16: the longer prefix wins.
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_listen_address(vm(), store_at("store1", {"10.1.9.9"})));
  EXPECT_EQ(a.host, "10.1.2.3");
  EXPECT_THAT(a.source, HasSubstr("interface eth0, which routes to the store host store1"));
  EXPECT_THAT(a.source, HasSubstr("the host name vm resolves to loopback"));
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(vm(), store_at("172.17.5.5", {"172.17.5.5"})));
  EXPECT_EQ(a.host, "172.17.0.1");
  // Only the default route reaches it.
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(vm(), store_at("8.8.8.8", {"8.8.8.8"})));
  EXPECT_EQ(a.host, "10.1.2.3");
}

TEST(ChooseListenAddressTest, LowerMetricWinsAmongEqualPrefixes) {
  NetworkView v = vm();
  v.routes.push_back({"docker0", "10.1.0.0", 16, 50});
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_listen_address(v, store_at("10.1.9.9", {"10.1.9.9"})));
  EXPECT_EQ(a.host, "172.17.0.1");
}

TEST(ChooseListenAddressTest, LoopbackHostNameWithLocalStoreStaysLoopback) {
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_listen_address(vm(), store_at("localhost", {"127.0.0.1"})));
  EXPECT_EQ(a.host, "127.0.0.1");
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(vm(), store_at("::1", {"::1"})));
  EXPECT_EQ(a.host, "127.0.0.1");
  // No store known (a file store): the host name's address, as before.
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(vm(), ListenRequest{}));
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_EQ(a.source, "host name vm");
}

TEST(ChooseListenAddressTest, StoreOnOneOfOurAddressesPicksThatInterface) {
  // Rank 0 of a multi-host job, hosting the store at its own eth0 address.
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_listen_address(vm(), store_at("10.1.2.3", {"10.1.2.3"})));
  EXPECT_EQ(a.host, "10.1.2.3");
  EXPECT_THAT(a.source, HasSubstr("interface eth0, which holds the store's address 10.1.2.3"));
}

TEST(ChooseListenAddressTest, UnroutableStoreFallsBackToTheHostName) {
  NetworkView v = vm();
  v.routes.erase(v.routes.begin());  // no default route
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_listen_address(v, store_at("8.8.8.8", {"8.8.8.8"})));
  EXPECT_EQ(a.host, "127.0.0.1");
}

TEST(ChooseListenAddressTest, Ipv6) {
  // An IPv6 store routes to eth1's global address, not its link-local one.
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a,
                             choose_listen_address(vm(), store_at("2001:db8:5::1", {"2001:db8:5::1"})));
  EXPECT_EQ(a.host, "2001:db8:5::7");
  // Through the IPv6 default route too.
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(vm(), store_at("2001:db8:9::1", {"2001:db8:9::1"})));
  EXPECT_EQ(a.host, "2001:db8:5::7");
  // A host name resolving to ::1 only is loopback as well.
  NetworkView v6 = vm();
  v6.hostname_addresses = {"::1"};
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(v6, store_at("10.1.9.9", {"10.1.9.9"})));
  EXPECT_EQ(a.host, "10.1.2.3");
  // An interface with only a link-local IPv6 address gives it with its scope.
  ListenRequest r;
  r.ifname = "ll0";
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(vm(), r));
  EXPECT_EQ(a.host, "fe80::c%ll0");
  // IPv4 first, then global IPv6, on an interface with both.
  r.ifname = "eth0";
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(vm(), r));
  EXPECT_EQ(a.host, "10.1.2.3");
  r.ifname = "eth1";
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(vm(), r));
  EXPECT_EQ(a.host, "2001:db8:5::7");
}

TEST(ChooseListenAddressTest, UnresolvableHostName) {
  NetworkView v = vm();
  v.hostname_addresses.clear();
  v.hostname_error = "Name or service not known";
  // With a remote store the route still answers.
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_listen_address(v, store_at("10.1.9.9", {"10.1.9.9"})));
  EXPECT_EQ(a.host, "10.1.2.3");
  EXPECT_THAT(a.source, HasSubstr("the host name vm does not resolve"));
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_listen_address(v, store_at("localhost", {"127.0.0.1"})));
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_THAT(choose_listen_address(v, ListenRequest{}),
              StatusIs(absl::StatusCode::kUnavailable,
                       "host name \"vm\" does not resolve to an address (Name or service not known); set "
                       "FERRY_SOCKET_IFNAME to the interface to use (\"lo\" when every rank runs on this host)"));
}

TEST(ChooseBindAddressTest, StoreServerBindsWhereItIsReached) {
  // An address we hold, or a loopback one: exactly that.
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, choose_bind_address(vm(), "10.1.2.3", {"10.1.2.3"}, ""));
  EXPECT_EQ(a.host, "10.1.2.3");
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_bind_address(vm(), "localhost", {"127.0.0.1", "::1"}, ""));
  EXPECT_EQ(a.host, "127.0.0.1");
  // A wildcard only when asked, and it says so.
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_bind_address(vm(), "0.0.0.0", {"0.0.0.0"}, ""));
  EXPECT_EQ(a.host, "0.0.0.0");
  EXPECT_EQ(a.source, "every interface, as asked");
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_bind_address(vm(), "::", {"::"}, ""));
  EXPECT_EQ(a.host, "::");
  // No address given: the resolver's interface (here the host name's loopback).
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_bind_address(vm(), "", {}, ""));
  EXPECT_EQ(a.host, "127.0.0.1");
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_bind_address(vm(), "", {}, "eth0"));
  EXPECT_EQ(a.host, "10.1.2.3");
  // An address this host does not hold (NAT, a service address): the interface routing there.
  FERRY_ASSERT_OK_AND_ASSIGN(a, choose_bind_address(vm(), "store.example", {"172.17.9.9"}, ""));
  EXPECT_EQ(a.host, "172.17.0.1");
}

TEST(AddressClassesTest, LoopbackAndWildcard) {
  EXPECT_TRUE(is_loopback_address("127.0.0.1"));
  EXPECT_TRUE(is_loopback_address("127.1.2.3"));
  EXPECT_TRUE(is_loopback_address("::1"));
  EXPECT_TRUE(is_loopback_address("::ffff:127.0.0.1"));
  EXPECT_FALSE(is_loopback_address("10.0.0.1"));
  EXPECT_FALSE(is_loopback_address("::"));
  EXPECT_FALSE(is_loopback_address("localhost"));  // numeric only
  EXPECT_TRUE(is_wildcard_address("0.0.0.0"));
  EXPECT_TRUE(is_wildcard_address("::"));
  EXPECT_FALSE(is_wildcard_address("127.0.0.1"));
}

TEST(SystemViewTest, ReadsThisMachine) {
  FERRY_ASSERT_OK_AND_ASSIGN(NetworkView v, read_network_view());
  bool has_lo = false;
  for (const NetInterface& i : v.interfaces) has_lo |= i.name == "lo" && i.address == "127.0.0.1";
  EXPECT_TRUE(has_lo);
  EXPECT_FALSE(v.hostname.empty());
  // Every interface with a route has an entry; every route's destination parses.
  for (const NetRoute& r : v.routes) {
    EXPECT_GE(r.prefix_length, 0);
    EXPECT_LE(r.prefix_length, 128);
  }
  EXPECT_THAT(resolve_host_addresses("127.0.0.1"), ::testing::ElementsAre("127.0.0.1"));
  EXPECT_TRUE(resolve_host_addresses("").empty());
  FERRY_ASSERT_OK_AND_ASSIGN(ListenAddress a, resolve_listen_address(std::string("lo"), "10.213.99.1"));
  EXPECT_EQ(a.host, "127.0.0.1");
  EXPECT_THAT(resolve_listen_address(std::string("ferry-nosuch0")),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("\"ferry-nosuch0\" (FERRY_SOCKET_IFNAME)")));
}

}  // namespace
}  // namespace ferry::internal
