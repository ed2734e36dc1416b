// The ferry tool over etcd (one ctest entry; its tests share a 3-member cluster):
// `ferry run --rdzv-backend etcd` (two nodes meet, a worker dies, both restart together,
// the job completes, as run_command_test's TCPStore rendezvous does) and `ferry store`
// reading, writing and listing the keys of an etcd:// job prefix.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/etcd_cluster.h"
#include "tests/testing/multi_process.h"
#include "tests/testing/subprocess.h"

namespace {

using ::ferry::testing::EtcdCluster;
using ::ferry::testing::run_program;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

EtcdCluster*& cluster = ::ferry::testing::shared_etcd_cluster();

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// One `ferry run` node, its output in files (no pipe to fill), killed if still running
// when the test ends.
class Node {
 public:
  Node(const std::string& dir, const std::string& name, const std::vector<std::string>& args)
      : out_(dir + "/" + name + ".out"), err_(dir + "/" + name + ".err") {
    pid_ = ::fork();
    if (pid_ == 0) {
      std::FILE* o = std::freopen(out_.c_str(), "w", stdout);
      std::FILE* e = std::freopen(err_.c_str(), "w", stderr);
      (void)o;
      (void)e;
      std::vector<std::string> copy = args;
      std::vector<char*> argv;
      std::string binary = FERRY_BINARY;
      argv.push_back(binary.data());
      for (std::string& a : copy) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(binary.c_str(), argv.data());
      _exit(127);
    }
  }
  ~Node() {
    if (pid_ > 0 && code_ < 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  int finish(std::chrono::milliseconds timeout = 90s) {
    code_ = ::ferry::testing::wait_exit(pid_, timeout);
    return code_;
  }
  std::string out() const { return slurp(out_); }
  std::string err() const { return slurp(err_); }

 private:
  std::string out_, err_;
  pid_t pid_ = -1;
  int code_ = -1;
};

TEST(EtcdRunTest, TwoNodesMeetThroughEtcdAndRestartTogetherWhenAWorkerDies) {
  ::ferry::testing::TempDir dir;
  const std::string id = "restart-" + std::to_string(::getpid());
  std::vector<std::string> args{"run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "etcd",
                                "--rdzv-endpoint", cluster->endpoints(), "--rdzv-id", id, "--monitor-interval",
                                "0.05", "--max-restarts", "2", "--rdzv-conf", "join_timeout=30,last_call_timeout=30",
                                RUN_TEST_WORKER, "--die-rank", "3", "--die-restart", "0"};
  Node a(dir.path(), "a", args);
  Node b(dir.path(), "b", args);
  ASSERT_EQ(a.finish(), 0) << a.err();
  ASSERT_EQ(b.finish(), 0) << b.err();
  std::string all = a.out() + b.out();
  std::string errs = a.err() + b.err();
  EXPECT_THAT(all, HasSubstr("[rank3]: dying rank=3"));
  EXPECT_THAT(errs, HasSubstr("was killed by signal 9"));
  EXPECT_THAT(errs, HasSubstr("restarting this node's workers (restart 1 of 2)"));
  EXPECT_THAT(all, HasSubstr("[rank3]: done rank=3 world=4 restart=1"));
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(count(all, "done rank=" + std::to_string(rank) + " world=4"), 1) << all;
  }
  // The rounds were kept in etcd, under the run's id.
  auto listed = run_program(FERRY_BINARY, {"store", "list", "--addr", "etcd://" + cluster->endpoints() + "/ferry",
                                           "ferry/rdzv/" + id + "/"}, 30s);
  EXPECT_EQ(listed.exit_code, 0) << listed.err;
  EXPECT_THAT(listed.out, HasSubstr("ferry/rdzv/" + id + "/"));
}

TEST(EtcdStoreCommandTest, SetGetAddListAndKeysThroughEtcd) {
  const std::string addr = "etcd://" + cluster->endpoints() + "/cli-" + std::to_string(::getpid());
  auto set = run_program(FERRY_BINARY, {"store", "set", "--addr", addr, "workers/0", "10.0.0.1:5000"}, 30s);
  ASSERT_EQ(set.exit_code, 0) << set.err;
  auto add = run_program(FERRY_BINARY, {"store", "add", "--addr", addr, "count", "3"}, 30s);
  ASSERT_EQ(add.exit_code, 0) << add.err;
  EXPECT_THAT(add.out, HasSubstr("3"));
  auto get = run_program(FERRY_BINARY, {"store", "get", "--addr", addr, "workers/0"}, 30s);
  ASSERT_EQ(get.exit_code, 0) << get.err;
  EXPECT_THAT(get.out, HasSubstr("10.0.0.1:5000"));
  auto list = run_program(FERRY_BINARY, {"store", "list", "--addr", addr}, 30s);
  ASSERT_EQ(list.exit_code, 0) << list.err;
  EXPECT_THAT(list.out, HasSubstr("workers/0 = 10.0.0.1:5000"));
  EXPECT_THAT(list.out, HasSubstr("count = 3"));
  auto keys = run_program(FERRY_BINARY, {"store", "keys", "--addr", addr}, 30s);
  EXPECT_EQ(keys.out, "2\n");
  auto missing = run_program(FERRY_BINARY, {"store", "get", "--addr", addr, "nope", "--timeout-ms", "200"}, 30s);
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_THAT(missing.err, HasSubstr("'nope'"));
  auto no_prefix = run_program(FERRY_BINARY, {"store", "list", "--addr", "etcd://" + cluster->endpoints()}, 30s);
  EXPECT_EQ(no_prefix.exit_code, 2);
  EXPECT_THAT(no_prefix.err, HasSubstr("etcd://host1:2379,host2:2379/jobprefix"));
  auto tcp = run_program(FERRY_BINARY, {"store", "list", "--addr", "127.0.0.1:1"}, 30s);
  EXPECT_EQ(tcp.exit_code, 2);
  EXPECT_THAT(tcp.err, HasSubstr("cannot list"));
  auto down = run_program(FERRY_BINARY, {"store", "get", "--addr", "etcd://127.0.0.1:1,127.0.0.1:2/x", "k",
                                         "--timeout-ms", "500"}, 30s);
  EXPECT_EQ(down.exit_code, 1);
  EXPECT_THAT(down.err, HasSubstr("127.0.0.1:1"));
  EXPECT_THAT(down.err, HasSubstr("127.0.0.1:2"));
}

}  // namespace
