// `ferry run`: the real binary (FERRY_BINARY) as one or more nodes on loopback, each
// starting real workers (RUN_TEST_WORKER, see run_test_worker.cc).
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/free_port.h"
#include "tests/testing/subprocess.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// A process is gone when it no longer exists or is a zombie nobody reaped yet.
bool gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string line;
  std::getline(stat, line);
  size_t close = line.rfind(')');
  return close == std::string::npos || close + 2 >= line.size() || line[close + 2] == 'Z';
}

// The pids a worker printed as "KEY=PID".
std::vector<pid_t> pids_after(const std::string& text, const std::string& key) {
  std::vector<pid_t> pids;
  std::regex re(key + "=(\\d+)");
  for (std::sregex_iterator it(text.begin(), text.end(), re), end; it != end; ++it) {
    pids.push_back(std::stoi((*it)[1]));
  }
  return pids;
}

// One `ferry run`: one node.
class Node {
 public:
  explicit Node(std::vector<std::string> args) { child_ = ::ferry::testing::spawn(FERRY_BINARY, args); }
  ~Node() {
    if (child_.pid > 0 && code_ == kRunning) {
      kill(child_.pid, SIGKILL);
      waitpid(child_.pid, nullptr, 0);
    }
    if (child_.out >= 0) close(child_.out);
    if (child_.err >= 0) close(child_.err);
  }
  pid_t pid() const { return child_.pid; }

  // Reads both pipes until stdout (or stderr) holds `n` occurrences of `text`; false at the deadline.
  bool wait_for(const std::string& text, int n = 1, std::chrono::milliseconds timeout = 30s, bool in_err = false) {
    auto deadline = Clock::now() + timeout;
    while (count(in_err ? err_ : out_, text) < n) {
      if (!pump(deadline)) return false;
    }
    return true;
  }

  // Reads both pipes to EOF, then returns the exit code (-1 when it missed the deadline).
  int finish(std::chrono::milliseconds timeout = 60s) {
    auto deadline = Clock::now() + timeout;
    while (pump(deadline)) {
    }
    code_ = ::ferry::testing::wait_exit(child_.pid, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                        std::max(deadline - Clock::now(), Clock::duration(1s))));
    return code_;
  }

  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

 private:
  static constexpr int kRunning = -2;

  // One poll over the open pipes; false when both are closed or the deadline passed.
  bool pump(Clock::time_point deadline) {
    std::vector<pollfd> polls;
    if (child_.out >= 0) polls.push_back({child_.out, POLLIN, 0});
    if (child_.err >= 0) polls.push_back({child_.err, POLLIN, 0});
    if (polls.empty()) return false;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0 || poll(polls.data(), polls.size(), static_cast<int>(left)) <= 0) return false;
    for (const pollfd& p : polls) {
      if (p.revents == 0) continue;
      char buf[4096];
      ssize_t n = read(p.fd, buf, sizeof(buf));
      std::string& sink = p.fd == child_.out ? out_ : err_;
      if (n > 0) {
        sink.append(buf, static_cast<size_t>(n));
      } else {
        close(p.fd);
        (p.fd == child_.out ? child_.out : child_.err) = -1;
      }
    }
    return true;
  }

  ::ferry::testing::Child child_;
  std::string out_, err_;
  int code_ = kRunning;
};

std::string endpoint() { return "127.0.0.1:" + std::to_string(::ferry::testing::free_port()); }

// ferry run ARGS... RUN_TEST_WORKER WORKER_ARGS...
std::vector<std::string> run_args(std::vector<std::string> args, const std::vector<std::string>& worker_args = {}) {
  args.insert(args.begin(), "run");
  args.push_back(RUN_TEST_WORKER);
  args.insert(args.end(), worker_args.begin(), worker_args.end());
  return args;
}

std::vector<std::string> node_args(const std::string& ep, const std::string& id, const std::string& nnodes,
                                   std::vector<std::string> extra = {}) {
  std::vector<std::string> args{"--nnodes", nnodes, "--nproc-per-node", "2", "--rdzv-endpoint", ep, "--rdzv-id", id,
                                "--monitor-interval", "0.05"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// This host's first IPv4 address that is not loopback; empty when it has none.
std::string non_loopback_ipv4() {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) return "";
  std::string found;
  for (ifaddrs* a = list; a != nullptr && found.empty(); a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    in_addr addr = reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr;
    if ((ntohl(addr.s_addr) >> 24) == 127) continue;
    char text[INET_ADDRSTRLEN] = {};
    if (inet_ntop(AF_INET, &addr, text, sizeof(text)) != nullptr) found = text;
  }
  freeifaddrs(list);
  return found;
}

TEST(RunCommandTest, MasterAddrIsTheAddressThatReachesTheRendezvousNotTheHostName) {
  std::string ip = non_loopback_ipv4();
  if (ip.empty()) GTEST_SKIP() << "this host has no non-loopback IPv4 address";
  std::string ep = ip + ":" + std::to_string(::ferry::testing::free_port());
  Node a(run_args({"--nnodes", "1", "--nproc-per-node", "1", "--rdzv-endpoint", ep, "--rdzv-id", "jobaddr",
                   "--monitor-interval", "0.05"}));
  ASSERT_EQ(a.finish(), 0) << a.err();
  // The resolver picks the interface that holds (or routes to) the rendezvous host,
  // whatever the host name resolves to.
  EXPECT_THAT(a.out(), HasSubstr("master=" + ip + ":")) << a.out();
}

TEST(RunCommandTest, TwoNodesOfTwoWorkersCompleteAJob) {
  std::string ep = endpoint();
  Node a(run_args(node_args(ep, "job2x2", "2", {"--rdzv-conf", "join_timeout=30"})));
  Node b(run_args(node_args(ep, "job2x2", "2", {"--rdzv-conf", "join_timeout=30"})));
  ASSERT_EQ(a.finish(), 0) << a.err();
  ASSERT_EQ(b.finish(), 0) << b.err();
  std::string all = a.out() + b.out();
  for (int rank = 0; rank < 4; ++rank) {
    // Every worker line carries the worker's rank as a prefix.
    EXPECT_EQ(count(all, "[rank" + std::to_string(rank) + "]: done rank=" + std::to_string(rank) + " world=4 restart=0"),
              1)
        << all;
  }
  // torchrun's variables: one node has group rank 0 with ranks 0-1, the other group rank 1 with ranks 2-3.
  std::string first = a.out().find("group=0") != std::string::npos ? a.out() : b.out();
  EXPECT_THAT(first, HasSubstr("started rank=0 world=4 local=0 local_world=2 group=0 group_world=2 restart=0 run=job2x2 master=127.0.0.1:"));
  EXPECT_THAT(first, HasSubstr("started rank=1 world=4 local=1 local_world=2 group=0 group_world=2"));
  EXPECT_THAT(all, HasSubstr("started rank=2 world=4 local=0 local_world=2 group=1 group_world=2"));
  EXPECT_THAT(all, HasSubstr("started rank=3 world=4 local=1 local_world=2 group=1 group_world=2"));
  std::set<std::string> masters;
  std::regex master_re("master=(\\S+)");
  for (std::sregex_iterator it(all.begin(), all.end(), master_re), end; it != end; ++it) {
    masters.insert((*it)[1]);
  }
  EXPECT_EQ(masters.size(), 1u) << all;  // every worker was given the same MASTER_ADDR:MASTER_PORT
  EXPECT_THAT(a.err(), HasSubstr("all 2 worker(s) of this node finished"));
}

TEST(RunCommandTest, WorksOnAStoreServedByFerryStoreServe) {
  ::ferry::testing::Child server = ::ferry::testing::spawn(FERRY_BINARY, {"store", "serve", "--host", "127.0.0.1"});
  std::string line = ::ferry::testing::read_until(server.out, Clock::now() + 20s, "\n");
  ASSERT_TRUE(line.starts_with("listening on 127.0.0.1:")) << line;
  std::string ep = line.substr(std::strlen("listening on "));
  ep.pop_back();
  // is_host=false: both nodes are clients of the standalone server.
  std::vector<std::string> extra{"--rdzv-conf", "join_timeout=30,is_host=false"};
  Node a(run_args(node_args(ep, "served", "2", extra)));
  Node b(run_args(node_args(ep, "served", "2", extra)));
  EXPECT_EQ(a.finish(), 0) << a.err();
  EXPECT_EQ(b.finish(), 0) << b.err();
  EXPECT_EQ(count(a.out() + b.out(), " world=4 restart=0\n"), 4) << a.out() << b.out();
  kill(server.pid, SIGTERM);
  EXPECT_EQ(::ferry::testing::wait_exit(server.pid, 10s), 0);
  close(server.out);
  close(server.err);
}

TEST(RunCommandTest, AKilledWorkerRestartsTheJobWhichCompletes) {
  std::string ep = endpoint();
  // Rank 3 SIGKILLs itself mid-job (after meeting the others) in the first round only.
  std::vector<std::string> extra{"--max-restarts", "2", "--rdzv-conf", "join_timeout=30,last_call_timeout=30"};
  std::vector<std::string> worker{"--die-rank", "3", "--die-restart", "0"};
  Node a(run_args(node_args(ep, "restart", "2", extra), worker));
  Node b(run_args(node_args(ep, "restart", "2", extra), worker));
  ASSERT_EQ(a.finish(), 0) << a.err();
  ASSERT_EQ(b.finish(), 0) << b.err();
  std::string all = a.out() + b.out();
  std::string errs = a.err() + b.err();
  EXPECT_THAT(all, HasSubstr("[rank3]: dying rank=3"));
  EXPECT_THAT(errs, HasSubstr("worker rank 3 (local rank 1, pid "));
  EXPECT_THAT(errs, HasSubstr("was killed by signal 9"));
  EXPECT_THAT(errs, HasSubstr("restarting this node's workers (restart 1 of 2)"));
  // The node that lost rank 3 restarted its workers with FERRY_RESTART_COUNT=1, and the
  // job then completed with all four ranks.
  EXPECT_THAT(all, HasSubstr("[rank3]: done rank=3 world=4 restart=1"));
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_EQ(count(all, "done rank=" + std::to_string(rank) + " world=4"), 1) << all;
  }
}

TEST(RunCommandTest, AThirdNodeJoiningRescalesTheJobAtTheNextRound) {
  std::string ep = endpoint();
  // Workers wait until the world has 6 of them, so the first round (2 nodes, 4 workers)
  // keeps running until the third node is admitted. No restarts are allowed: admitting
  // a node is not a failure.
  std::vector<std::string> extra{"--rdzv-conf", "join_timeout=30,last_call_timeout=1"};
  std::vector<std::string> worker{"--min-world", "6"};
  Node a(run_args(node_args(ep, "rescale", "2:3", extra), worker));
  Node b(run_args(node_args(ep, "rescale", "2:3", extra), worker));
  ASSERT_TRUE(a.wait_for("waiting for world 6", 2)) << a.out() << a.err();
  ASSERT_TRUE(b.wait_for("waiting for world 6", 2)) << b.out() << b.err();
  Node c(run_args(node_args(ep, "rescale", "2:3", extra), worker));
  ASSERT_EQ(a.finish(), 0) << a.err();
  ASSERT_EQ(b.finish(), 0) << b.err();
  ASSERT_EQ(c.finish(), 0) << c.err();
  // "1 node(s)", or 2 when the other member rejoined before this one looked.
  EXPECT_THAT(a.err(), HasSubstr(" node(s) waiting to join; stopping the workers to admit them in a new round"));
  EXPECT_THAT(b.err(), HasSubstr(" node(s) waiting to join; stopping the workers to admit them in a new round"));
  EXPECT_THAT(a.err(), HasSubstr("round with 3 node(s), 6 worker(s)"));
  std::string all = a.out() + b.out() + c.out();
  for (int rank = 0; rank < 6; ++rank) {
    EXPECT_EQ(count(all, "done rank=" + std::to_string(rank) + " world=6 restart=0"), 1) << all;
  }
  EXPECT_THAT(c.out(), Not(HasSubstr("world=4")));  // the late node only ever ran in the bigger round
}

TEST(RunCommandTest, TwoNodesRunARealRpcJob) {
#ifndef MODEL_PARALLEL_EXAMPLE
  GTEST_SKIP() << "built without the examples (FERRY_BUILD_EXAMPLES=OFF)";
#else
  // examples/02_model_parallel: 4 workers calling each other with rpc_sync/rpc_async,
  // meeting through env:// as the two launchers set it up.
  std::string ep = endpoint();
  std::vector<std::string> args{"run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", ep,
                                "--rdzv-id", "rpc", MODEL_PARALLEL_EXAMPLE, "5"};
  Node a(args);
  Node b(args);
  ASSERT_EQ(a.finish(), 0) << a.out() << a.err();
  ASSERT_EQ(b.finish(), 0) << b.out() << b.err();
  EXPECT_THAT(a.out() + b.out(), HasSubstr("[rank0]: loss went from "));
  EXPECT_THAT(a.out() + b.out(), HasSubstr("over 5 steps across 4 workers"));
#endif
}

TEST(RunCommandTest, OnceMaxRestartsAreUsedUpItExitsWithTheWorkersCode) {
  Node node(run_args({"--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--monitor-interval", "0.05"},
                     {"--exit-rank", "1", "--exit-code", "7", "--hang"}));
  // Rank 1 exits 7 at once; rank 0 hangs with a grandchild until the launcher stops it.
  EXPECT_EQ(node.finish(), 7) << node.err();
  EXPECT_EQ(count(node.out(), "[rank1]: started rank=1"), 2) << node.out();  // first run and one restart
  EXPECT_THAT(node.out(), HasSubstr("restart=1"));
  EXPECT_THAT(node.err(), HasSubstr("worker rank 1 (local rank 1, pid "));
  EXPECT_THAT(node.err(), HasSubstr("exited with code 7; restarting this node's workers (restart 1 of 1)"));
  EXPECT_THAT(node.err(), HasSubstr("exited with code 7; no restarts left (--max-restarts 1), exiting with code 7"));
  // Every worker and what it started was stopped.
  std::vector<pid_t> pids = pids_after(node.out(), "pid");
  std::vector<pid_t> grandchildren = pids_after(node.out(), "grandchild");
  pids.insert(pids.end(), grandchildren.begin(), grandchildren.end());
  EXPECT_FALSE(pids.empty()) << node.out();
  for (pid_t pid : pids) EXPECT_TRUE(gone(pid)) << "pid " << pid << " survived";
}

TEST(RunCommandTest, MinNodesNeverReachedIsAClearRendezvousTimeout) {
  Node node(run_args(node_args(endpoint(), "alone", "2:3", {"--rdzv-conf", "join_timeout=1"})));
  EXPECT_EQ(node.finish(), 1) << node.err();
  EXPECT_THAT(node.err(), HasSubstr("rendezvous timed out: rendezvous of run 'alone'"));
  EXPECT_THAT(node.err(), HasSubstr("timed out after 1s in round 0: 1 node(s) joined, at least 2 needed (min 2, max 3)"));
  EXPECT_THAT(node.out(), Not(HasSubstr("started")));
}

TEST(RunCommandTest, SigtermAndSigintStopEverythingWithNoOrphans) {
  for (int sig : {SIGTERM, SIGINT}) {
    const std::string name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
    Node node(run_args({"--standalone", "--nproc-per-node", "3"}, {"--hang"}));
    ASSERT_TRUE(node.wait_for("hanging pid=", 3)) << node.out() << node.err();
    std::vector<pid_t> pids = pids_after(node.out(), "pid");
    std::vector<pid_t> grandchildren = pids_after(node.out(), "grandchild");
    ASSERT_EQ(pids.size(), 3u);
    ASSERT_EQ(grandchildren.size(), 3u);
    kill(node.pid(), sig);
    EXPECT_EQ(node.finish(), 128 + sig) << node.err();
    EXPECT_THAT(node.err(), HasSubstr("stopped by " + name + "; stopping the workers"));
    // Stopped workers are not reported as failures.
    EXPECT_EQ(count(node.err(), "worker rank"), 0) << node.err();
    pids.insert(pids.end(), grandchildren.begin(), grandchildren.end());
    for (pid_t pid : pids) EXPECT_TRUE(gone(pid)) << name << ": pid " << pid << " survived";
  }
}

TEST(RunCommandTest, SigintDuringTheRendezvousStopsTheLauncher) {
  Node node(run_args(node_args(endpoint(), "interrupted", "2", {"--rdzv-conf", "join_timeout=60"})));
  // The launcher is waiting for a second node that never comes.
  ASSERT_TRUE(node.wait_for("joining the rendezvous of run 'interrupted'", 1, 30s, /*in_err=*/true)) << node.err();
  kill(node.pid(), SIGINT);
  EXPECT_EQ(node.finish(20s), 128 + SIGINT) << node.err();
  EXPECT_THAT(node.err(), HasSubstr("stopped by SIGINT during the rendezvous"));
}

TEST(RunCommandTest, WorkersDieWithAKilledLauncher) {
  // No grandchildren here: PR_SET_PDEATHSIG reaches the workers only.
  Node node(run_args({"--standalone", "--nproc-per-node", "2"}, {"--hang", "--alone"}));
  ASSERT_TRUE(node.wait_for("hanging pid=", 2)) << node.out() << node.err();
  std::vector<pid_t> pids = pids_after(node.out(), "pid");
  kill(node.pid(), SIGKILL);  // no chance to stop them: PR_SET_PDEATHSIG does
  EXPECT_EQ(node.finish(), 128 + SIGKILL);
  for (pid_t pid : pids) {
    auto deadline = Clock::now() + 10s;
    while (!gone(pid) && Clock::now() < deadline) usleep(10000);
    EXPECT_TRUE(gone(pid)) << "worker " << pid << " survived its launcher";
  }
}

TEST(RunCommandTest, BadUsageIsExplained) {
  struct Case {
    std::vector<std::string> args;
    std::string message;
  };
  std::vector<Case> cases = {
      {{"run", "--standalone"}, "no PROGRAM given"},
      {{"run", "--nnodes", "3:2", "--rdzv-endpoint", "127.0.0.1:1", "true"},
       "--nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got '3:2'"},
      {{"run", "--nnodes", "x", "--rdzv-endpoint", "127.0.0.1:1", "true"}, "got 'x'"},
      {{"run", "--standalone", "--rdzv-endpoint", "127.0.0.1:1", "true"}, "--standalone runs one node"},
      {{"run", "true"}, "--rdzv-endpoint HOST:PORT is required"},
      {{"run", "--standalone", "--nproc-per-node", "0", "true"}, "--nproc-per-node must be at least 1, got 0"},
      {{"run", "--standalone", "--monitor-interval", "-1", "true"}, "--monitor-interval must be a number of seconds"},
      {{"run", "--standalone", "--rdzv-conf", "join_timeout", "true"}, "--rdzv-conf entries must be KEY=VALUE"},
      {{"run", "--standalone", "--rdzv-conf", "join_timeout=soon", "true"},
       "The rendezvous configuration option 'join_timeout' does not represent a valid integer value."},
      {{"run", "--rdzv-endpoint", "127.0.0.1:99999", "true"}, "port \"99999\" is not a number in 0..65535"},
      // An unknown option before PROGRAM is refused at once, not run as the program
      // after a whole rendezvous; a near miss names the spelling meant.
      {{"run", "--standalone", "--nproc-per-nodes", "2", "true"},
       "unknown option '--nproc-per-nodes' before PROGRAM: did you mean --nproc-per-node?"},
      {{"run", "--standalone", "--master_addr", "10.0.0.1", "true"},
       "ferry run does not take torchrun's --master-addr; give the rendezvous as --rdzv-endpoint HOST:PORT"},
      {{"run", "--standalone", "--node-rank=1", "true"}, "node ranks are handed out by the rendezvous"},
      {{"run", "--standalone", "--frobnicate", "true"}, "unknown option '--frobnicate' before PROGRAM (ferry run's options: "},
  };
  for (const Case& c : cases) {
    ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(FERRY_BINARY, c.args, 20s);
    EXPECT_EQ(r.exit_code, 2) << c.message << "\n" << r.err;
    EXPECT_THAT(r.err, HasSubstr(c.message));
  }
}

// torchrun's command line, as its users type it, runs as it is.
TEST(RunCommandTest, TorchrunsUnderscoreSpellingsAndNoPythonAreTaken) {
  ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(
      FERRY_BINARY,
      {"run", "--standalone", "--no_python", "--nproc_per_node", "2", "--max_restarts", "0", "sh", "-c", "echo $RANK"},
      20s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank0]: 0\n"));
  EXPECT_THAT(r.out, HasSubstr("[rank1]: 1\n"));
  ::ferry::testing::ProgramRun help = ::ferry::testing::run_program(FERRY_BINARY, {"run", "--help"}, 20s);
  EXPECT_THAT(help.out, HasSubstr("ferry run [OPTIONS] PROGRAM [ARGS...]"));
}

// A standalone job's store is on a free port: the launcher says which, and how to
// watch the job from another shell.
TEST(RunCommandTest, AStandaloneJobSaysWhereItsRendezvousIsAndHowToWatchIt) {
  ::ferry::testing::ProgramRun r =
      ::ferry::testing::run_program(FERRY_BINARY, {"run", "--standalone", "--rdzv-id", "seen", "true"}, 20s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  const std::string at = "joining the rendezvous of run 'seen' at 127.0.0.1:";
  const size_t found = r.err.find(at);
  ASSERT_NE(found, std::string::npos) << r.err;
  const std::string port = r.err.substr(found + at.size(), r.err.find_first_not_of("0123456789", found + at.size()) -
                                                               (found + at.size()));
  ASSERT_FALSE(port.empty()) << r.err;
  EXPECT_NE(port, "0") << r.err;
  EXPECT_THAT(r.err, HasSubstr("watch it with: ferry top --rdzv-endpoint 127.0.0.1:" + port + " --rdzv-id seen\n"));
}

TEST(RunCommandTest, AProgramThatCannotRunIsNamed) {
  ::ferry::testing::ProgramRun r =
      ::ferry::testing::run_program(FERRY_BINARY, {"run", "--standalone", "/nonexistent/program"}, 20s);
  EXPECT_EQ(r.exit_code, 127) << r.err;
  EXPECT_THAT(r.err, HasSubstr("[rank0]: ferry run: cannot execute /nonexistent/program"));
  EXPECT_THAT(r.err, HasSubstr("worker rank 0 (local rank 0, pid "));
  EXPECT_THAT(r.err, HasSubstr("exited with code 127"));
}

TEST(RunCommandTest, TheProgramKeepsItsOwnFlags) {
  ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(
      FERRY_BINARY, {"run", "--standalone", "--nproc-per-node", "2", "sh", "-c", "echo \"$RANK $0 $1\"", "--nnodes", "x"},
      20s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("[rank0]: 0 --nnodes x\n"));
  EXPECT_THAT(r.out, HasSubstr("[rank1]: 1 --nnodes x\n"));
}

TEST(RunCommandTest, EveryOutputLineIsPrefixedEvenTheLastWithoutANewline) {
  ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(
      FERRY_BINARY, {"run", "--standalone", "sh", "-c", "printf 'a\\nb'; printf 'e1\\ne2' >&2"}, 20s);
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[rank0]: a\n[rank0]: b\n");
  EXPECT_THAT(r.err, HasSubstr("[rank0]: e1\n[rank0]: e2\n"));
}

}  // namespace

// `ferry --version` as every tool takes it, and `ferry version` on a host without a GPU
// driver saying so rather than asking for a newer driver.
TEST(FerryCli, VersionFlagAndCommand) {
  ::ferry::testing::ProgramRun flag = ::ferry::testing::run_program(FERRY_BINARY, {"--version"}, 20s);
  EXPECT_EQ(flag.exit_code, 0) << flag.err;
  EXPECT_THAT(flag.out, ::testing::StartsWith("ferry "));
  ::ferry::testing::ProgramRun command = ::ferry::testing::run_program(FERRY_BINARY, {"version"}, 20s);
  EXPECT_EQ(command.exit_code, 0) << command.err;
  EXPECT_THAT(command.out, HasSubstr(flag.out));
  if (access("/proc/driver/nvidia/version", F_OK) != 0 && getenv("FERRY_EMULATE_CUDA") == nullptr) {
    EXPECT_THAT(command.out, HasSubstr("cuda devices: 0 ("));
    EXPECT_THAT(command.out, Not(HasSubstr("insufficient")));
  }
}

// The commands that talk to a job's store say where its token comes from.
TEST(FerryCli, HelpOfTheStoreReadingCommandsNamesTheTokenVariable) {
  for (std::vector<std::string> args :
       {std::vector<std::string>{"top", "--help"}, {"store", "--help"}, {"store", "serve", "--help"},
        {"store", "get", "--help"}}) {
    ::ferry::testing::ProgramRun r = ::ferry::testing::run_program(FERRY_BINARY, args, 20s);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_THAT(r.out, HasSubstr("FERRY_AUTH_TOKEN")) << args[0] << " " << args[1];
  }
}
