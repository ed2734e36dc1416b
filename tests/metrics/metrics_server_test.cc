// The metrics endpoint: scraped by a raw-socket HTTP client while two worker processes
// call each other; bad, oversized, slow and surplus requests answered or cut off while
// the server keeps serving; endpoints found through the store.
#include "metrics/metrics_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "agents/tensorpipe/factory.h"
#include "gtest/gtest.h"
#include "rpc/call.h"
#include "rpc/rpc.h"
#include "stats/prometheus.h"
#include "store/file_store.h"
#include "store/hash_store.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/sanitizers.h"

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;

// Connects to 127.0.0.1:port; -1 on failure.
int connect_to(int port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

// Sends `request` as is and reads the whole answer (the server closes), at most 10 s.
std::string http_exchange(int port, const std::string& request) {
  int fd = connect_to(port);
  if (fd < 0) return "connect failed";
  (void)!send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string answer;
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(10);
  while (Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, 100) <= 0) continue;
    char buf[4096];
    ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    answer.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return answer;
}

std::string status_line(const std::string& answer) { return answer.substr(0, answer.find("\r\n")); }

TEST(MetricsServer, AnswersOnlyGetMetricsAndSurvivesBadClients) {
  MetricsServer::Options options;
  options.timeout = std::chrono::milliseconds(300);
  options.max_connections = 4;
  options.max_request_bytes = 1024;
  std::atomic<int> served{0};
  auto server = MetricsServer::start(options, [&] { return "x_total " + std::to_string(++served) + "\n"; });
  ASSERT_TRUE(server.ok()) << server.status();
  const int port = (*server)->port();
  EXPECT_EQ((*server)->address(), "127.0.0.1:" + std::to_string(port));

  std::string ok = http_exchange(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n");
  EXPECT_EQ(status_line(ok), "HTTP/1.1 200 OK");
  EXPECT_NE(ok.find("\r\n\r\nx_total 1\n"), std::string::npos) << ok;
  EXPECT_EQ(status_line(http_exchange(port, "GET /other HTTP/1.1\r\n\r\n")), "HTTP/1.1 404 Not Found");
  std::string post = http_exchange(port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  EXPECT_EQ(status_line(post), "HTTP/1.1 405 Method Not Allowed");
  EXPECT_NE(post.find("Allow: GET"), std::string::npos);
  EXPECT_EQ(status_line(http_exchange(port, "garbage\r\n\r\n")), "HTTP/1.1 400 Bad Request");
  EXPECT_EQ(status_line(http_exchange(port, "GET /metrics HTTP/1.1\r\nX: " + std::string(4096, 'a'))),
            "HTTP/1.1 431 Request Header Fields Too Large");
  // A client that never finishes its request is cut off at the timeout.
  EXPECT_EQ(status_line(http_exchange(port, "GET /metr")), "HTTP/1.1 408 Request Timeout");

  // More idle connections than the server takes at once: it still serves once they
  // time out, well within the does-not-hang bound.
  std::vector<int> idle;
  for (int i = 0; i < 8; ++i) idle.push_back(connect_to(port));
  std::string after = http_exchange(port, "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_EQ(status_line(after), "HTTP/1.1 200 OK");
  for (int fd : idle) close(fd);

  absl::StatusOr<std::string> body = scrape_metrics((*server)->address(), std::chrono::seconds(5));
  ASSERT_TRUE(body.ok()) << body.status();
  EXPECT_EQ(body->substr(0, 8), "x_total ");
  (*server)->shutdown();
  EXPECT_FALSE(scrape_metrics((*server)->address(), std::chrono::seconds(2)).ok());
}

// Clients that connect and say nothing, as many as the server takes, do not keep a
// scraper out: the newcomer takes the oldest silent one's place, long before the
// silent ones time out.
TEST(MetricsServer, SilentClientsAtTheCapMakeRoomForAScraper) {
  MetricsServer::Options options;
  options.timeout = std::chrono::seconds(30);
  options.max_connections = 4;
  auto server = MetricsServer::start(options, [] { return std::string("x_total 1\n"); });
  ASSERT_TRUE(server.ok()) << server.status();
  std::vector<int> silent;
  for (int i = 0; i < 6; ++i) silent.push_back(connect_to((*server)->port()));
  for (int round = 0; round < 3; ++round) {
    absl::StatusOr<std::string> body = scrape_metrics((*server)->address(), std::chrono::seconds(5));
    ASSERT_TRUE(body.ok()) << body.status();
    EXPECT_EQ(*body, "x_total 1\n");
  }
  EXPECT_GE((*server)->evicted(), 3u);
  for (int fd : silent) close(fd);
}

// A worker out of descriptors cannot accept: the listener stays readable, and the
// server must not poll it in a busy loop meanwhile.
TEST(MetricsServer, AcceptFailingForWantOfDescriptorsDoesNotSpin) {
#ifdef FERRY_TEST_SANITIZED
  // Their runtimes open files inside their own checks, which this test starves.
  GTEST_SKIP() << "a sanitizer's runtime needs the descriptors this test takes away";
#endif
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(1, [](int) {
    auto server = MetricsServer::start(MetricsServer::Options{}, [] { return std::string("x 1\n"); });
    ASSERT_TRUE(server.ok()) << server.status();
    // The server thread's CPU time (clock ticks), from its /proc stat file, opened now:
    // there will be no descriptor left to open it later.
    // The thread names itself once it runs, which on a busy host is not at once.
    std::ifstream stat;
    for (const auto until = Clock::now() + std::chrono::seconds(10); !stat.is_open() && Clock::now() < until;) {
      for (const auto& task : std::filesystem::directory_iterator("/proc/self/task")) {
        std::ifstream comm(task.path() / "comm");
        std::string name;
        std::getline(comm, name);
        if (name == "ferry-metrics") stat.open(task.path() / "stat");
      }
      if (!stat.is_open()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_TRUE(stat.is_open()) << "no ferry-metrics thread";
    auto server_ticks = [&stat] {
      stat.clear();
      stat.seekg(0);
      std::string line;
      std::getline(stat, line);
      std::istringstream fields(line.substr(line.rfind(')') + 2));
      std::string f;
      long ticks = 0;
      for (int i = 3; fields >> f; ++i) {
        if (i == 14 || i == 15) ticks += std::stol(f);  // utime, stime
      }
      return ticks;
    };
    // Every descriptor taken but one, which the client's socket then takes.
    rlimit few{256, 256};
    ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &few), 0);
    std::vector<int> held;
    for (int fd; (fd = dup(2)) >= 0;) held.push_back(fd);
    ASSERT_FALSE(held.empty());
    close(held.back());
    held.pop_back();
    const int client = connect_to((*server)->port());
    ASSERT_GE(client, 0);
    const auto deadline = Clock::now() + std::chrono::seconds(10);
    while ((*server)->accept_failures() == 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ASSERT_GE((*server)->accept_failures(), 1u) << "accept() never failed";
    const long before = server_ticks();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    const long spent = server_ticks() - before;
    EXPECT_LT(spent, 10) << "the server thread spent " << spent << " ticks of 50 polling a listener it cannot accept on";
    for (int fd : held) close(fd);
    // With descriptors back, the waiting client is served.
    const std::string request = "GET /metrics HTTP/1.1\r\n\r\n";
    ASSERT_EQ(send(client, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
    std::string answer;
    char buf[256];
    for (ssize_t n; (n = recv(client, buf, sizeof(buf), 0)) > 0;) answer.append(buf, static_cast<size_t>(n));
    EXPECT_EQ(status_line(answer), "HTTP/1.1 200 OK");
    close(client);
  }));
}

// A scrape reads at most kMaxScrapeBytes back, whatever the other end sends.
TEST(MetricsServer, AScrapeOfAnEndlessAnswerIsRefused) {
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(listener, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(listen(listener, 1), 0);
  socklen_t len = sizeof(a);
  ASSERT_EQ(getsockname(listener, reinterpret_cast<sockaddr*>(&a), &len), 0);
  const int port = ntohs(a.sin_port);
  std::thread flood([listener] {
    int fd = accept(listener, nullptr, nullptr);
    const std::string head = "HTTP/1.1 200 OK\r\n\r\n";
    (void)!send(fd, head.data(), head.size(), MSG_NOSIGNAL);
    const std::string chunk(1 << 20, 'x');
    while (send(fd, chunk.data(), chunk.size(), MSG_NOSIGNAL) > 0) {
    }
    close(fd);
  });
  absl::StatusOr<std::string> body = scrape_metrics("127.0.0.1:" + std::to_string(port), std::chrono::seconds(20));
  EXPECT_EQ(body.status().code(), absl::StatusCode::kResourceExhausted) << body.status();
  flood.join();
  close(listener);
}

TEST(MetricsServer, RefusesWhatItCannotBind) {
  MetricsServer::Options options;
  options.host = "not-an-address";
  EXPECT_EQ(MetricsServer::start(options, [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.host = "127.0.0.1";
  options.port = 70000;
  EXPECT_EQ(MetricsServer::start(options, [] { return std::string(); }).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsEndpoints, PublishedAndFoundThroughTheStore) {
  HashStore store;
  auto none = find_metrics_endpoints(store, "job/");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_TRUE(none->empty());
  ASSERT_TRUE(publish_metrics_endpoint(store, "job/", "w0", "127.0.0.1:1").ok());
  ASSERT_TRUE(publish_metrics_endpoint(store, "job/", "w1", "[::1]:2").ok());
  ASSERT_TRUE(publish_metrics_endpoint(store, "job/", "w0", "127.0.0.1:3").ok());  // w0 restarted
  auto all = find_metrics_endpoints(store, "job/");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].worker, "w0");
  EXPECT_EQ((*all)[0].address, "127.0.0.1:3");
  EXPECT_EQ((*all)[1].address, "[::1]:2");
  auto v6 = split_host_port("[::1]:2");
  ASSERT_TRUE(v6.ok());
  EXPECT_EQ(v6->first, "::1");
  EXPECT_FALSE(split_host_port("nocolon").ok());
}

TEST(MetricsEndpoints, ARetiredRecordSaysItsWorkerLeftUntilItComesBack) {
  HashStore store;
  auto w0 = publish_metrics_endpoint(store, "job/", "w0", "127.0.0.1:1");
  auto spaced = publish_metrics_endpoint(store, "job/", "a worker 7", "127.0.0.1:2");
  ASSERT_TRUE(w0.ok() && spaced.ok());
  EXPECT_EQ(*spaced, *w0 + 1);
  const double before = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  ASSERT_TRUE(retire_metrics_endpoint(store, "job/", *w0, "w0", "127.0.0.1:1").ok());
  ASSERT_TRUE(retire_metrics_endpoint(store, "job/", *spaced, "a worker 7", "127.0.0.1:2").ok());
  auto all = find_metrics_endpoints(store, "job/");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 2u);
  EXPECT_EQ((*all)[0].worker, "w0");
  EXPECT_EQ((*all)[0].address, "127.0.0.1:1");
  ASSERT_TRUE((*all)[0].departed.has_value());
  EXPECT_GE(*(*all)[0].departed, before - 1);
  EXPECT_EQ((*all)[1].worker, "a worker 7") << "a name with spaces survives the mark";
  EXPECT_EQ((*all)[1].address, "127.0.0.1:2");
  EXPECT_TRUE((*all)[1].departed.has_value());
  // w0 comes back under its name: the newer record wins, live.
  ASSERT_TRUE(publish_metrics_endpoint(store, "job/", "w0", "127.0.0.1:3").ok());
  all = find_metrics_endpoints(store, "job/");
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ((*all)[0].address, "127.0.0.1:3");
  EXPECT_FALSE((*all)[0].departed.has_value());
  // A worker named like a departed record is still live: its record ends with an address.
  ASSERT_TRUE(publish_metrics_endpoint(store, "job/", "x departed 5", "127.0.0.1:4").ok());
  all = find_metrics_endpoints(store, "job/");
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), 3u);
  EXPECT_EQ((*all)[2].worker, "x departed 5");
  EXPECT_FALSE((*all)[2].departed.has_value());
}

double sample(const std::vector<PrometheusSample>& samples, const std::string& name,
              const std::map<std::string, std::string>& labels = {}) {
  double sum = 0;
  for (const PrometheusSample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) match = match && s.labels.count(k) && s.labels.at(k) == v;
    if (match) sum += s.value;
  }
  return sum;
}

// Checks what the exposition format promises of one histogram: buckets cumulative,
// the +Inf bucket equal to _count.
void expect_histogram(const std::vector<PrometheusSample>& samples, const std::string& name) {
  double before = 0;
  double last = -1;
  int buckets = 0;
  for (const PrometheusSample& s : samples) {
    if (s.name != name + "_bucket") continue;
    EXPECT_GE(s.value, before) << name << " le=" << s.labels.at("le");
    before = s.value;
    last = s.value;
    ++buckets;
    if (s.labels.at("le") == "+Inf") {
      EXPECT_EQ(s.value, sample(samples, name + "_count")) << name;
    }
  }
  EXPECT_EQ(buckets, HistogramSnapshot::kBuckets) << name;
  EXPECT_EQ(last, sample(samples, name + "_count")) << name;
}

TEST(MetricsEndpoints, ScrapedFromRealWorkersDuringCalls) {
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(2, [&](int rank) {
    (void)register_function("add", [](int64_t a, int64_t b) { return a + b; });
    setenv("FERRY_METRICS_PORT", "0", 1);
    setenv("FERRY_METRICS_HOST", "127.0.0.1", 1);
    auto store = FileStore::create(dir.path() + "/store", {});
    ASSERT_TRUE(store.ok());
    std::shared_ptr<Store> shared(std::move(*store));
    std::string name = "worker" + std::to_string(rank);
    TensorPipeAgentOptions options;
    options.init_timeout = std::chrono::seconds(20);
    auto agent = TensorPipeAgent::create(shared, name, rank, 2, options, [name](const Message& m, const WorkerInfo&) {
      return dispatch_request(FunctionRegistry::global(), name, m);
    });
    ASSERT_TRUE(agent.ok()) << agent.status();
    if (rank == 0) {
      // Calls until worker1 has seen enough (at most 30 s).
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(30);
      int64_t i = 0;
      while (Clock::now() < deadline && !shared->check({"test/done"}).value_or(false)) {
        EXPECT_EQ(call_sync<int64_t>(**agent, "worker1", "add", std::nullopt, i, int64_t{1}), i + 1);
        ++i;
      }
      EXPECT_LT(Clock::now(), deadline);
    } else {
      auto endpoints = find_metrics_endpoints(*shared, kMetricsStorePrefix);
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(20);
      while ((!endpoints.ok() || endpoints->size() < 2) && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        endpoints = find_metrics_endpoints(*shared, kMetricsStorePrefix);
      }
      ASSERT_TRUE(endpoints.ok()) << endpoints.status();
      ASSERT_EQ(endpoints->size(), 2u);
      std::string worker0;
      for (const MetricsEndpoint& e : *endpoints) {
        if (e.worker == "worker0") worker0 = e.address;
        EXPECT_EQ(e.address.substr(0, 10), "127.0.0.1:");
      }
      ASSERT_FALSE(worker0.empty());
      const int port = split_host_port(worker0)->second;
      double previous = -1;
      for (int round = 0; round < 3; ++round) {
        // Scraped until worker0 made another call since the last scrape: on a loaded
        // machine (a sanitizer build beside other tests) one may take longer than a tick.
        std::string answer;
        double made = previous;
        const Clock::time_point give_up = Clock::now() + std::chrono::seconds(10);
        while (made <= previous && Clock::now() < give_up) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
          answer = http_exchange(port, "GET /metrics HTTP/1.1\r\nHost: t\r\n\r\n");
          ASSERT_EQ(status_line(answer), "HTTP/1.1 200 OK");
          auto scraped = parse_prometheus(answer.substr(answer.find("\r\n\r\n") + 4));
          ASSERT_TRUE(scraped.ok()) << scraped.status();
          made = sample(*scraped, "ferry_calls_made_total", {{"peer", "worker1"}, {"function", "add"}});
        }
        auto samples = parse_prometheus(answer.substr(answer.find("\r\n\r\n") + 4));
        ASSERT_TRUE(samples.ok()) << samples.status();
        EXPECT_EQ(sample(*samples, "ferry_worker_info", {{"worker", "worker0"}}), 1);
        EXPECT_GT(made, previous);
        previous = made;
        expect_histogram(*samples, "ferry_made_call_seconds");
        // Every call counted, one in 8 (per thread) timed.
        const double all_made = sample(*samples, "ferry_calls_made_total");
        const double timed = sample(*samples, "ferry_made_call_seconds_count");
        EXPECT_GE(timed, std::floor(all_made / AgentStats::kDefaultTimeOneIn)) << all_made;
        EXPECT_LE(timed, std::ceil(all_made / AgentStats::kDefaultTimeOneIn) + 4) << all_made;
        expect_histogram(*samples, "ferry_served_call_seconds");
        expect_histogram(*samples, "ferry_queue_seconds");
        // A bad request in between changes nothing for the next scrape.
        EXPECT_EQ(status_line(http_exchange(port, "DELETE /metrics HTTP/1.1\r\n\r\n")), "HTTP/1.1 405 Method Not Allowed");
      }
      // Its own endpoint sees the calls it served.
      for (const MetricsEndpoint& e : *endpoints) {
        if (e.worker != "worker1") continue;
        auto text = scrape_metrics(e.address, std::chrono::seconds(5));
        ASSERT_TRUE(text.ok()) << text.status();
        auto snapshot = from_prometheus(*text);
        ASSERT_TRUE(snapshot.ok()) << snapshot.status();
        EXPECT_GT(snapshot->by_function["add"].served, 0u);
      }
      ASSERT_TRUE(shared->set("test/done", to_bytes("1")).ok());
    }
    EXPECT_TRUE((*agent)->join(std::chrono::seconds(20)).ok());
    (*agent)->shutdown();
  }));
  // Both left with a graceful join: their records say so, and still say where they were.
  auto store = FileStore::create(dir.path() + "/store", {});
  ASSERT_TRUE(store.ok()) << store.status();
  auto endpoints = find_metrics_endpoints(**store, kMetricsStorePrefix);
  ASSERT_TRUE(endpoints.ok()) << endpoints.status();
  ASSERT_EQ(endpoints->size(), 2u);
  for (const MetricsEndpoint& e : *endpoints) {
    EXPECT_TRUE(e.departed.has_value()) << e.worker;
    EXPECT_EQ(e.address.substr(0, 10), "127.0.0.1:");
  }
}

TEST(MetricsEndpoints, AWorkerLeavingADynamicGroupMarksItsRecordAndTheOthersStayLive) {
  // w2 leaves while w0 and w1 run on; then they shut down too. A SIGKILLed worker's
  // record is the other case: it stays live, and `ferry top` shows it not answering
  // (tests/tools/top_command_test.cc).
  ferry::testing::TempDir dir;
  ferry::testing::expect_all_succeed(ferry::testing::run_processes(3, [&](int rank) {
    setenv("FERRY_METRICS_PORT", "0", 1);
    setenv("FERRY_METRICS_HOST", "127.0.0.1", 1);
    FileStoreOptions coord_options;
    coord_options.timeout = std::chrono::seconds(60);
    auto coord = FileStore::create(dir.path() + "/coordination", coord_options);
    ASSERT_TRUE(coord.ok()) << coord.status();
    if (rank > 0) {
      ASSERT_TRUE((*coord)->wait({"joined/" + std::to_string(rank - 1)}, std::chrono::seconds(60)).ok());
    }
    TensorPipeRpcBackendOptions options;
    options.init_method = "file://" + dir.path() + "/store";
    options.rpc_timeout = std::chrono::seconds(30);
    ASSERT_TRUE(init_rpc("w" + std::to_string(rank), BackendType::TENSORPIPE, rank, std::nullopt, options).ok());
    ASSERT_TRUE((*coord)->set("joined/" + std::to_string(rank), to_bytes("1")).ok());
    if (rank == 2) {
      ASSERT_TRUE((*coord)->wait({"joined/2"}, std::chrono::seconds(60)).ok());
      ASSERT_TRUE(shutdown().ok());
      ASSERT_TRUE((*coord)->set("left/2", to_bytes("1")).ok());
      return;
    }
    ASSERT_TRUE((*coord)->wait({"left/2"}, std::chrono::seconds(60)).ok());
    auto store = FileStore::create(dir.path() + "/store", {});
    ASSERT_TRUE(store.ok()) << store.status();
    auto endpoints = find_metrics_endpoints(**store, kMetricsStorePrefix);
    ASSERT_TRUE(endpoints.ok()) << endpoints.status();
    ASSERT_EQ(endpoints->size(), 3u);
    for (const MetricsEndpoint& e : *endpoints) {
      EXPECT_EQ(e.departed.has_value(), e.worker == "w2") << e.worker;
      // The members' endpoints answer.
      if (e.worker != "w2") {
        EXPECT_TRUE(scrape_metrics(e.address, std::chrono::seconds(5)).ok()) << e.worker;
      }
    }
    ASSERT_TRUE((*coord)->add("checked", 1).ok());
    // w1 leaves first (w0 stays until it has), so that both leaves are on their own.
    if (rank == 0) {
      ASSERT_TRUE((*coord)->wait({"left/1"}, std::chrono::seconds(60)).ok());
    } else {
      const Clock::time_point deadline = Clock::now() + std::chrono::seconds(60);
      while (*(*coord)->add("checked", 0) < 2 && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    }
    ASSERT_TRUE(shutdown().ok());
    if (rank == 1) {
      ASSERT_TRUE((*coord)->set("left/1", to_bytes("1")).ok());
    }
  }));
  auto store = FileStore::create(dir.path() + "/store", {});
  ASSERT_TRUE(store.ok()) << store.status();
  auto endpoints = find_metrics_endpoints(**store, kMetricsStorePrefix);
  ASSERT_TRUE(endpoints.ok()) << endpoints.status();
  ASSERT_EQ(endpoints->size(), 3u);
  for (const MetricsEndpoint& e : *endpoints) EXPECT_TRUE(e.departed.has_value()) << e.worker;
}

}  // namespace
}  // namespace ferry
