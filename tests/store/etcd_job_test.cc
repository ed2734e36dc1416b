// Jobs whose store is etcd (init_method etcd://), with real worker processes and the
// binary's one real 3-member cluster: what a worker keeps under its store lease (its
// address record, its metrics record, the dynamic group's lock) vanishes within the
// lease TTL of its death, the other members are told through the store's watch, and
// `ferry top` shows it gone. The dead worker is SIGSTOPped, not killed, so that its
// connections stay open and its endpoint accepts: only the lease can tell.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "agents/core/membership_lock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "rpc/rpc.h"
#include "store/etcd/etcd_store.h"
#include "store/file_store.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/sanitizers.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/subprocess.h"
#include "nlohmann/json.hpp"

namespace ferry {
namespace {

using ::ferry::testing::EtcdCluster;
using ::ferry::testing::run_processes;
using ::testing::AllOf;
using ::testing::HasSubstr;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

EtcdCluster*& cluster = ::ferry::testing::shared_etcd_cluster();

std::string job(const std::string& name) { return absl::StrCat(name, "-", ::getpid()); }

std::unique_ptr<EtcdStore> open_store(const std::string& prefix) {
  EtcdStoreOptions options;
  options.endpoints = cluster->endpoints();
  options.prefix = prefix;
  options.timeout = 60s;
  auto store = EtcdStore::create(options);
  EXPECT_TRUE(store.ok()) << store.status();
  return store.ok() ? *std::move(store) : nullptr;
}

// Whether any key of the job's store ends with `suffix`.
bool has_key_ending(EtcdStore& store, const std::string& suffix) {
  auto keys = store.list("");
  EXPECT_TRUE(keys.ok()) << keys.status();
  if (!keys.ok()) return false;
  for (const auto& [key, value] : *keys) {
    if (absl::EndsWith(key, suffix)) return true;
  }
  return false;
}

// `ferry top --once --json` on the job's store.
nlohmann::json top(const std::string& prefix) {
  ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(
      FERRY_BINARY,
      {"top", "--store", absl::StrCat("etcd://", cluster->endpoints(), "/", prefix), "--once", "--json",
       "--interval-ms", "300", "--timeout-ms", "500"},
      30s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return r.exit_code == 0 ? nlohmann::json::parse(r.out) : nlohmann::json::object({{"workers", nlohmann::json::array()}});
}

TensorPipeRpcBackendOptions job_options(const std::string& prefix) {
  TensorPipeRpcBackendOptions options;
  options.init_method = absl::StrCat("etcd://", cluster->endpoints(), "/", prefix);
  options.rpc_timeout = 30s;
  // No heartbeat: nothing but the store's lease can find the stopped worker.
  options.heartbeat = 0ms;
  return options;
}

TEST(EtcdJob, AStoppedWorkersRecordsVanishWithinTheLeaseTtlAndTheOthersAreToldAndTopShowsItGone) {
  const std::string prefix = job("static");
  const std::string coord_prefix = prefix + "-coord";
  auto results = run_processes(3, [&](int rank) {
    (void)register_function("ferry_etcd_job_add", [](int64_t a, int64_t b) { return a + b; });
    setenv("FERRY_METRICS_PORT", "0", 1);
    setenv("FERRY_METRICS_HOST", "127.0.0.1", 1);
    auto coord = open_store(coord_prefix);
    ASSERT_NE(coord, nullptr);
    std::atomic<bool> lost{false};
    std::atomic<int> others_told{0};
    ASSERT_OK(init_rpc(absl::StrCat("w", rank), BackendType::TENSORPIPE, rank, 3, job_options(prefix)));
    add_membership_listener([&](const WorkerInfo& w, MembershipChange c) {
      if (w.name == "w2" && c == MembershipChange::kLost) lost.store(true);
      if (w.name != "w2") others_told.fetch_add(1);
    });
    if (rank == 2) {
      ASSERT_OK(coord->set("pid", to_bytes(std::to_string(::getpid()))));
      std::this_thread::sleep_for(120s);  // stopped, then killed, by rank 0
      return;
    }
    auto job_store = open_store(prefix);
    ASSERT_NE(job_store, nullptr);
    if (rank == 0) {
      EXPECT_EQ(top(prefix)["workers"].size(), 3u);
      EXPECT_TRUE(has_key_ending(*job_store, "alive/2"));
      auto pid = coord->get("pid", 30s);
      ASSERT_TRUE(pid.ok()) << pid.status();
      const pid_t p = static_cast<pid_t>(std::stol(to_string(*pid)));
      ASSERT_EQ(::kill(p, SIGSTOP), 0);
      ASSERT_OK(coord->set("stopped", {}));
      const Clock::time_point stopped = Clock::now();
      // The lease TTL (5 s by default) plus etcd's expiry sweep and a loaded machine.
      const auto bound = job_store->lease_ttl() + 8s;
      while (!lost.load() && Clock::now() - stopped < bound) std::this_thread::sleep_for(20ms);
      EXPECT_TRUE(lost.load()) << "w2 not reported lost within " << bound.count() << " ms";
      std::printf("w2 reported lost %.1f s after it was stopped\n",
                  std::chrono::duration<double>(Clock::now() - stopped).count());
      EXPECT_FALSE(has_key_ending(*job_store, "alive/2"));
      // Its endpoint still accepts connections (it is stopped, not dead): only the
      // lease tells `ferry top` that it is gone.
      const nlohmann::json seen = top(prefix);
      bool shown_gone = false;
      for (const nlohmann::json& w : seen["workers"]) {
        if (w["worker"] == "w2") shown_gone = w["gone"].get<bool>() && w["lease_expired"].get<bool>();
        if (w["worker"] != "w2") {
          EXPECT_FALSE(w["gone"].get<bool>()) << w.dump();
        }
      }
      EXPECT_TRUE(shown_gone) << seen.dump(2);
      ASSERT_EQ(::kill(p, SIGKILL), 0);
    } else {
      ASSERT_OK(coord->wait({"stopped"}, 30s));
      const Clock::time_point stopped = Clock::now();
      while (!lost.load() && Clock::now() - stopped < job_store->lease_ttl() + 8s) std::this_thread::sleep_for(20ms);
      EXPECT_TRUE(lost.load());
    }
    // Calls between the living go on.
    EXPECT_EQ(rpc_sync<int64_t>(rank == 0 ? "w1" : "w0", "ferry_etcd_job_add", int64_t{2}, int64_t{3}), 5);
    EXPECT_EQ(others_told.load(), 0);
    ASSERT_OK(coord->add("checked", 1).status());
    ASSERT_OK(coord->wait({"checked"}, 30s));
    // w2 never arrives: the shutdown says so, within its timeout.
    const Clock::time_point leaving = Clock::now();
    (void)shutdown();
    EXPECT_LT(Clock::now() - leaving, 40s);
  }, 120s);
  ASSERT_EQ(results.size(), 3u);
  for (int r : {0, 1}) EXPECT_TRUE(results[r].exited && results[r].exit_code == 0) << results[r].describe();
  EXPECT_EQ(results[2].term_signal, SIGKILL) << results[2].describe();
}

TEST(EtcdJob, ALockWhoseHolderIsStoppedIsFreedWithinTheLeaseTtl) {
  const std::string prefix = job("lock");
  auto results = run_processes(2, [&](int rank) {
    std::shared_ptr<Store> store(open_store(prefix));
    ASSERT_NE(store, nullptr);
    if (rank == 0) {
      auto lock = internal::MembershipLock::acquire(store, "lock", "holder", 10s);
      ASSERT_TRUE(lock.ok()) << lock.status();
      ASSERT_OK(store->set("held", to_bytes(std::to_string(::getpid()))));
      std::this_thread::sleep_for(120s);  // stopped, then killed, by rank 1
      return;
    }
    auto pid = store->get("held", 30s);
    ASSERT_TRUE(pid.ok()) << pid.status();
    const pid_t p = static_cast<pid_t>(std::stol(to_string(*pid)));
    ASSERT_EQ(::kill(p, SIGSTOP), 0);
    const Clock::time_point stopped = Clock::now();
    // A lease of this waiter's own measure so long that only the store's expiry frees it.
    auto lock = internal::MembershipLock::acquire(store, "lock", "waiter", store->lease_ttl() + 8s, 10min);
    EXPECT_TRUE(lock.ok()) << lock.status();
    std::printf("the lock was taken %.1f s after its holder was stopped\n",
                std::chrono::duration<double>(Clock::now() - stopped).count());
    ::kill(p, SIGKILL);
  }, 60s);
  ASSERT_EQ(results.size(), 2u);
  EXPECT_TRUE(results[1].exited && results[1].exit_code == 0) << results[1].describe();
  EXPECT_EQ(results[0].term_signal, SIGKILL) << results[0].describe();
}

// Calls every current member but this worker; how many answered.
int call_everyone(int rank) {
  int answered = 0;
  for (const WorkerInfo& w : get_worker_infos()) {
    if (w.id == rank) continue;
    auto r = rpc_async<int64_t>(w.name, "ferry_etcd_job_add", int64_t{rank}, int64_t{1000}).result();
    EXPECT_TRUE(r.ok()) << w.name << ": " << r.status();
    if (r.ok() && *r == rank + 1000) ++answered;
  }
  return answered;
}

// The proof, with a cluster of its own (it kills two of its three members): a
// 4-worker dynamic group over etcd:// goes on when the cluster's leader is SIGKILLed, a
// fifth worker joins, one leaves gracefully; with a second member killed (no quorum)
// calls between workers still succeed, the store fails naming every endpoint, and
// nothing waits past its timeout. Plain builds only: it takes about 30 s.
TEST(EtcdJob, ADynamicGroupOutlivesTheClustersLeaderAndItsCallsOutliveTheCluster) {
#ifdef FERRY_TEST_SANITIZED
  GTEST_SKIP() << "about 30 s of real time; the plain build runs it";
#endif
  auto own = EtcdCluster::start({});
  ASSERT_TRUE(own.ok()) << own.status();
  EtcdCluster& etcd = **own;
  ::ferry::testing::TempDir dir;
  const std::string url = absl::StrCat("etcd://", etcd.endpoints(), "/", job("dyn"));
  auto results = run_processes(5, [&](int rank) {
    (void)register_function("ferry_etcd_job_add", [](int64_t a, int64_t b) { return a + b; });
    FileStoreOptions coord_options;
    coord_options.timeout = 60s;
    auto coord = *FileStore::create(dir.path() + "/coordination", coord_options);
    auto wait = [&](const std::string& key) { ASSERT_OK(coord->wait({key}, 60s)); };
    TensorPipeRpcBackendOptions options;
    options.init_method = url;
    // Also the store's request timeout: how long an operation tries members.
    options.rpc_timeout = 8s;
    if (rank == 4) wait("leader_killed");
    ASSERT_OK(init_rpc(absl::StrCat("w", rank), BackendType::TENSORPIPE, rank, std::nullopt, options));
    ASSERT_OK(coord->add("joined", 1).status());
    if (rank < 4) {
      for (auto deadline = Clock::now() + 60s; *coord->add("joined", 0) < 4 && Clock::now() < deadline;) {
        std::this_thread::sleep_for(20ms);
      }
      if (rank == 0) {
        absl::StatusOr<int> leader = etcd.leader();
        ASSERT_TRUE(leader.ok()) << leader.status();
        etcd.kill(*leader);
        ASSERT_OK(coord->set("leader_killed", to_bytes(std::to_string(*leader))));
      }
      wait("leader_killed");
      // The job goes on: calls, and a fifth member joining through the new leader.
      EXPECT_EQ(call_everyone(rank), 3);
      for (auto deadline = Clock::now() + 60s; *coord->add("joined", 0) < 5 && Clock::now() < deadline;) {
        std::this_thread::sleep_for(20ms);
      }
    }
    // Every member knows the fifth.
    for (auto deadline = Clock::now() + 20s; get_worker_infos().size() < 5 && Clock::now() < deadline;) {
      std::this_thread::sleep_for(20ms);
    }
    EXPECT_EQ(get_worker_infos().size(), 5u);
    EXPECT_EQ(call_everyone(rank), 4);
    ASSERT_OK(coord->add("called", 1).status());
    for (auto deadline = Clock::now() + 60s; *coord->add("called", 0) < 5 && Clock::now() < deadline;) {
      std::this_thread::sleep_for(20ms);
    }
    if (rank == 3) {
      // A graceful leave with one member of the cluster down.
      ASSERT_OK(shutdown(true, 30s));
      ASSERT_OK(coord->set("left", {}));
      return;
    }
    wait("left");
    for (auto deadline = Clock::now() + 20s; get_worker_infos().size() > 4 && Clock::now() < deadline;) {
      std::this_thread::sleep_for(20ms);
    }
    EXPECT_EQ(get_worker_infos().size(), 4u);
    if (rank == 0) {
      const int first = std::stoi(to_string(*coord->get("leader_killed")));
      etcd.kill(first == 0 ? 1 : 0);
      ASSERT_OK(coord->set("second_killed", {}));
    }
    wait("second_killed");
    // Only the store is down: calls between workers still succeed.
    EXPECT_EQ(call_everyone(rank), 3);
    if (rank == 0) {
      // The store fails within its request timeout, naming every endpoint it tried.
      EtcdStoreOptions store_options;
      store_options.endpoints = etcd.endpoints();
      store_options.prefix = job("dyn");
      store_options.request_timeout = 2s;
      store_options.attempt_timeout = 1s;
      const Clock::time_point start = Clock::now();
      auto store = EtcdStore::create(store_options);
      EXPECT_LT(Clock::now() - start, 8s);
      EXPECT_FALSE(store.ok());
      EXPECT_EQ(store.status().code(), absl::StatusCode::kUnavailable) << store.status();
      for (int i = 0; i < 3; ++i) EXPECT_THAT(store.status().message(), HasSubstr(etcd.endpoint(i)));
    }
    ASSERT_OK(coord->add("checked", 1).status());
    for (auto deadline = Clock::now() + 60s; *coord->add("checked", 0) < 4 && Clock::now() < deadline;) {
      std::this_thread::sleep_for(20ms);
    }
    // Leaving needs the group's lock in the store: it fails within the store's request
    // timeout, naming the endpoints, and the worker still shuts down.
    const Clock::time_point leaving = Clock::now();
    absl::Status left = shutdown(true, 30s);
    EXPECT_LT(Clock::now() - leaving, 25s);
    EXPECT_FALSE(left.ok());
    EXPECT_THAT(left.message(), AllOf(HasSubstr(etcd.endpoint(0)), HasSubstr(etcd.endpoint(2))));
  }, 150s);
  ASSERT_EQ(results.size(), 5u);
  for (const auto& r : results) EXPECT_TRUE(r.exited && r.exit_code == 0) << r.describe();
}

}  // namespace
}  // namespace ferry
