// ferry_faults: a dynamic group under steady load while members are harmed, checking
// that only calls to harmed members fail, and then only with an error naming them.
//
//   ferry_faults --seconds 600 --members 8 --seed 1     # by hand
//   ferry_faults --seconds 30 --members 5               # ctest
//
// The store lives in this process, outside the group. Each member is a process of this
// binary (--member) that joins the group and keeps --in-flight calls with a tensor
// going to random members, checking each answer. Every --harm-every-ms this process
// does one of: SIGKILL a member, SIGSTOP one and SIGCONT it up to two heartbeats
// later, or start a new member. A member is marked harmed in the store before the
// signal goes. At the end everyone stopped is resumed, every member stops calling and
// drains, then leaves gracefully (shutdown), and reports.
//
// The rules, each a breach that makes the exit status non-zero:
// - a call from an unharmed member to a member never harmed fails;
// - a call to a harmed member fails with an error that does not name it;
// - an answer is wrong;
// - a call outlives its deadline by more than one heartbeat;
// - an unharmed member's shutdown fails, or any member's takes more than 5 s;
// - a member does not report, or the store stops answering.
// It prints the calls, their failures by code, and the members harmed.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "rpc/ferry.h"
#include "store/tcp_store.h"

namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

struct Settings {
  int seconds = 30;
  int members = 5;
  int max_members = 0;  // 0: twice --members
  int in_flight = 4;
  int harm_every_ms = 700;
  int heartbeat_ms = 1000;
  int timeout_ms = 3000;
  int max_elements = 16384;
  int late_slack_ms = 250;  // scheduling slack on a loaded machine, on top of the heartbeat
  uint64_t seed = 1;
};

constexpr milliseconds kShutdownLimit{5000};

std::string key(const std::string& kind, const std::string& name) { return absl::StrCat("faults/", kind, "/", name); }

// ---- A member.

// What a member saw, reported to the parent as one line in the store.
struct Tally {
  std::mutex mu;
  std::condition_variable cv;
  int64_t in_flight = 0;
  int64_t calls = 0;
  int64_t ok = 0;
  int64_t wrong = 0;
  int64_t late = 0;
  int64_t late_ms_max = 0;
  int64_t unnamed = 0;  // failures whose error does not name the target
  std::map<absl::StatusCode, int64_t> failed_by_code;
  std::map<std::string, int64_t> failed_by_target;
  std::string first_unnamed;
};

ferry::Tensor make_payload(int64_t elements, int64_t tag) {
  std::vector<float> values(static_cast<size_t>(elements));
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>((tag + static_cast<int64_t>(i)) % 65521);
  return *ferry::Tensor::from_values<float>(std::span<const float>(values), {elements});
}

bool matches(const ferry::Tensor& t, int64_t elements, int64_t tag) {
  if (t.numel() != elements || t.dtype() != ferry::DType::kFloat32) return false;
  std::span<const float> got = t.span<float>();
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != static_cast<float>((tag + static_cast<int64_t>(i)) % 65521)) return false;
  }
  return true;
}

int run_member(const std::string& name, int rank, int port, const Settings& s) {
  (void)ferry::register_function("faults_echo", [](ferry::Tensor t) { return t; });
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = absl::StrCat("tcp://127.0.0.1:", port);
  options.heartbeat = milliseconds(s.heartbeat_ms);
  absl::StatusOr<std::unique_ptr<ferry::TCPStore>> store =
      ferry::TCPStore::create("127.0.0.1", static_cast<uint16_t>(port), false, std::nullopt, milliseconds(30000));
  if (!store.ok()) {
    std::fprintf(stderr, "faults: %s: store: %s\n", name.c_str(), store.status().ToString().c_str());
    return 2;
  }
  absl::Status joined = ferry::init_rpc(name, ferry::BackendType::TENSORPIPE, rank, std::nullopt, options);
  if (!joined.ok()) {
    // A join can fail while members are being harmed (one holding the group's lock was
    // killed, say): counted, not a breach, as long as it fails rather than hangs.
    std::fprintf(stderr, "faults: %s: joining: %s\n", name.c_str(), joined.ToString().c_str());
    (void)(*store)->set(key("result", name), ferry::to_bytes("join_failed 1"));
    (void)(*store)->set(key("joined", name), ferry::to_bytes("0"));
    (void)(*store)->add("faults/drained", 1);
    return 0;
  }
  (void)(*store)->set(key("joined", name), ferry::to_bytes("1"));

  auto tally = std::make_shared<Tally>();
  std::mt19937_64 random(s.seed * 7919 + static_cast<uint64_t>(rank));
  const milliseconds timeout(s.timeout_ms);
  const milliseconds allowed = timeout + milliseconds(s.heartbeat_ms) + milliseconds(s.late_slack_ms);
  int64_t tag = static_cast<int64_t>(rank) << 32;
  std::vector<std::string> targets;
  Clock::time_point refreshed;
  for (;;) {
    if (Clock::now() - refreshed > milliseconds(50)) {
      absl::StatusOr<bool> stop = (*store)->check({"faults/stop"});
      if (stop.ok() && *stop) break;
      targets.clear();
      for (const ferry::WorkerInfo& w : ferry::get_worker_infos()) {
        if (w.name != name) targets.push_back(w.name);
      }
      refreshed = Clock::now();
    }
    if (targets.empty()) {
      std::this_thread::sleep_for(milliseconds(10));
      refreshed = {};
      continue;
    }
    {
      std::unique_lock<std::mutex> lock(tally->mu);
      // Every call ends by its deadline (the rule checked here), so this wait is bounded.
      tally->cv.wait_for(lock, milliseconds(50), [&] { return tally->in_flight < s.in_flight; });
      if (tally->in_flight >= s.in_flight) continue;
      ++tally->in_flight;
      ++tally->calls;
    }
    const std::string target = targets[random() % targets.size()];
    const int64_t elements = 1 + static_cast<int64_t>(random() % static_cast<uint64_t>(s.max_elements));
    ++tag;
    const Clock::time_point start = Clock::now();
    ferry::rpc_async<ferry::Tensor>(target, "faults_echo", ferry::RpcTimeout{timeout}, make_payload(elements, tag))
        .add_inline_callback([tally, target, elements, tag, start, allowed](const absl::StatusOr<ferry::Tensor>& r) {
          const milliseconds took = std::chrono::duration_cast<milliseconds>(Clock::now() - start);
          std::lock_guard<std::mutex> lock(tally->mu);
          if (took > allowed) {
            ++tally->late;
            tally->late_ms_max = std::max<int64_t>(tally->late_ms_max, took.count());
          }
          if (r.ok()) {
            if (matches(*r, elements, tag)) {
              ++tally->ok;
            } else {
              ++tally->wrong;
            }
          } else {
            ++tally->failed_by_code[r.status().code()];
            ++tally->failed_by_target[target];
            // Named in quotes, or as the worker whose error this is ("m3: ...").
            const absl::string_view message = r.status().message();
            if (message.find(absl::StrCat("\"", target, "\"")) == absl::string_view::npos &&
                !absl::StartsWith(message, absl::StrCat(target, ": "))) {
              if (tally->unnamed++ == 0) tally->first_unnamed = r.status().ToString();
            }
          }
          --tally->in_flight;
          tally->cv.notify_all();
        });
  }
  {
    std::unique_lock<std::mutex> lock(tally->mu);
    tally->cv.wait_for(lock, allowed + milliseconds(1000), [&] { return tally->in_flight == 0; });
  }
  // Nobody leaves while another still calls it.
  (void)(*store)->add("faults/drained", 1);
  absl::Status leave = (*store)->wait({"faults/leave"}, milliseconds(60000));
  const Clock::time_point leaving = Clock::now();
  absl::Status left = leave.ok() ? ferry::shutdown(true, milliseconds(30000)) : leave;
  const int64_t shutdown_ms = std::chrono::duration_cast<milliseconds>(Clock::now() - leaving).count();

  std::lock_guard<std::mutex> lock(tally->mu);
  std::ostringstream line;
  line << "calls " << tally->calls << " ok " << tally->ok << " wrong " << tally->wrong << " late " << tally->late
       << " late_ms_max " << tally->late_ms_max << " unnamed " << tally->unnamed << " in_flight " << tally->in_flight
       << " shutdown_ms " << shutdown_ms << " shutdown_ok " << (left.ok() ? 1 : 0);
  for (const auto& [code, n] : tally->failed_by_code) line << " code:" << static_cast<int>(code) << " " << n;
  for (const auto& [target, n] : tally->failed_by_target) line << " target:" << target << " " << n;
  if (!left.ok()) std::fprintf(stderr, "faults: %s: shutdown: %s\n", name.c_str(), left.ToString().c_str());
  if (tally->unnamed > 0) {
    std::fprintf(stderr, "faults: %s: an error not naming its target: %s\n", name.c_str(),
                 tally->first_unnamed.c_str());
  }
  (void)(*store)->set(key("result", name), ferry::to_bytes(line.str()));
  return 0;
}

// ---- The parent.

struct Member {
  std::string name;
  pid_t pid = -1;
  bool harmed = false;
  bool killed = false;
  Clock::time_point resume_at{};  // stopped until then
};

pid_t spawn(const std::string& self, const std::string& name, int rank, int port, const Settings& s) {
  std::vector<std::string> args = {self,
                                   "--member",
                                   name,
                                   std::to_string(rank),
                                   std::to_string(port),
                                   "--heartbeat-ms",
                                   std::to_string(s.heartbeat_ms),
                                   "--timeout-ms",
                                   std::to_string(s.timeout_ms),
                                   "--in-flight",
                                   std::to_string(s.in_flight),
                                   "--max-elements",
                                   std::to_string(s.max_elements),
                                   "--late-slack-ms",
                                   std::to_string(s.late_slack_ms),
                                   "--seed",
                                   std::to_string(s.seed)};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {
    execv(self.c_str(), argv.data());
    _exit(127);
  }
  return pid;
}

// Parses a member's report into counters by field name.
std::map<std::string, int64_t> parse(const std::string& line) {
  std::map<std::string, int64_t> fields;
  std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
  for (size_t i = 0; i + 1 < words.size(); i += 2) {
    int64_t value = 0;
    if (absl::SimpleAtoi(words[i + 1], &value)) fields[words[i]] = value;
  }
  return fields;
}

int run_parent(const std::string& self, const Settings& s) {
  ferry::TCPStoreServerOptions server_options;
  server_options.host = "127.0.0.1";
  absl::StatusOr<std::unique_ptr<ferry::TCPStoreServer>> server = ferry::TCPStoreServer::create(server_options);
  if (!server.ok()) {
    std::fprintf(stderr, "faults: store server: %s\n", server.status().ToString().c_str());
    return 2;
  }
  const int port = (*server)->port();
  absl::StatusOr<std::unique_ptr<ferry::TCPStore>> client =
      ferry::TCPStore::create("127.0.0.1", static_cast<uint16_t>(port), false, std::nullopt, milliseconds(10000));
  if (!client.ok()) {
    std::fprintf(stderr, "faults: store: %s\n", client.status().ToString().c_str());
    return 2;
  }
  ferry::Store& store = **client;
  std::mt19937_64 random(s.seed);
  std::vector<Member> members;
  int next_rank = 1;  // nobody is rank 0: the store is this process's
  auto start_member = [&] {
    Member m;
    m.name = absl::StrCat("m", next_rank);
    m.pid = spawn(self, m.name, next_rank, port, s);
    ++next_rank;
    members.push_back(m);
  };
  for (int i = 0; i < s.members; ++i) start_member();
  // Harm starts once the first members are in.
  for (const Member& m : members) {
    (void)store.wait({key("joined", m.name)}, milliseconds(120000));
  }
  const int max_members = s.max_members > 0 ? s.max_members : 2 * s.members;
  int kills = 0, stops = 0, joins = 0;
  const Clock::time_point end = Clock::now() + std::chrono::seconds(s.seconds);
  while (Clock::now() < end) {
    std::this_thread::sleep_for(milliseconds(s.harm_every_ms));
    for (Member& m : members) {
      if (m.resume_at != Clock::time_point{} && Clock::now() >= m.resume_at) {
        kill(m.pid, SIGCONT);
        m.resume_at = {};
      }
    }
    // Victims: members running now. At least two never harmed stay so, to judge by;
    // members harmed before may be harmed again (a stopped one killed later), so the
    // harmed ones do not fill the group for good.
    std::vector<Member*> running, fresh;
    int alive = 0;
    for (Member& m : members) {
      if (m.killed) continue;
      ++alive;
      if (m.resume_at != Clock::time_point{}) continue;
      running.push_back(&m);
      if (!m.harmed) fresh.push_back(&m);
    }
    std::vector<Member*> victims;
    for (Member* m : running) {
      if (m->harmed || fresh.size() > 2) victims.push_back(m);
    }
    // A full group makes room: the next harm is a kill.
    const int action = alive >= max_members ? 0 : static_cast<int>(random() % 3);
    if ((action == 2 || victims.empty()) && alive < max_members) {
      start_member();
      ++joins;
      continue;
    }
    if (victims.empty()) continue;
    Member& victim = *victims[random() % victims.size()];
    // Marked before the signal: any failure of a call to it comes after.
    if (!store.set(key("harmed", victim.name), ferry::to_bytes("1")).ok()) {
      std::fprintf(stderr, "faults: BREACH: the store stopped answering\n");
      break;
    }
    victim.harmed = true;
    if (action == 0) {
      kill(victim.pid, SIGKILL);
      (void)waitpid(victim.pid, nullptr, 0);
      victim.killed = true;
      ++kills;
    } else {
      kill(victim.pid, SIGSTOP);
      victim.resume_at = Clock::now() + milliseconds(random() % static_cast<uint64_t>(2 * s.heartbeat_ms + 1));
      ++stops;
    }
  }
  for (Member& m : members) {
    if (m.resume_at != Clock::time_point{}) kill(m.pid, SIGCONT);
  }
  // The end: stop calling, drain, then leave together.
  int breaches = 0;
  int expected = 0;
  for (const Member& m : members) expected += m.killed ? 0 : 1;
  (void)store.set("faults/stop", ferry::to_bytes("1"));
  const Clock::time_point drain_by = Clock::now() + milliseconds(s.timeout_ms + 30000);
  while (Clock::now() < drain_by) {
    absl::StatusOr<int64_t> drained = store.add("faults/drained", 0);
    if (drained.ok() && *drained >= expected) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  (void)store.set("faults/leave", ferry::to_bytes("1"));

  int64_t calls = 0, ok = 0;
  int join_failures = 0;
  std::map<std::string, int64_t> failed_by_code;
  for (Member& m : members) {
    if (m.killed) continue;
    const Clock::time_point deadline = Clock::now() + milliseconds(90000);
    int status = 0;
    pid_t done = 0;
    while ((done = waitpid(m.pid, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(20));
    }
    if (done == 0) {
      kill(m.pid, SIGKILL);
      (void)waitpid(m.pid, nullptr, 0);
      std::fprintf(stderr, "faults: BREACH: %s did not exit within 90 s of the end\n", m.name.c_str());
      ++breaches;
      continue;
    }
    absl::StatusOr<ferry::Bytes> report = store.get(key("result", m.name), milliseconds(0));
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0 || !report.ok()) {
      std::fprintf(stderr, "faults: BREACH: %s ended without a report (status %d)\n", m.name.c_str(), status);
      ++breaches;
      continue;
    }
    const std::string line = ferry::to_string(*report);
    std::map<std::string, int64_t> f = parse(line);
    if (f["join_failed"] > 0) {
      ++join_failures;
      continue;
    }
    calls += f["calls"];
    ok += f["ok"];
    auto breach = [&](const std::string& what) {
      std::fprintf(stderr, "faults: BREACH: %s%s: %s\n", m.name.c_str(), m.harmed ? " (harmed)" : "", what.c_str());
      ++breaches;
    };
    if (f["wrong"] > 0) breach(absl::StrCat(f["wrong"], " wrong answers"));
    if (f["late"] > 0) breach(absl::StrCat(f["late"], " calls past their deadline and a heartbeat, the longest ",
                                           f["late_ms_max"], " ms"));
    if (f["unnamed"] > 0) breach(absl::StrCat(f["unnamed"], " failures not naming their target"));
    if (f["in_flight"] > 0) breach(absl::StrCat(f["in_flight"], " calls never ended"));
    if (f["shutdown_ms"] > kShutdownLimit.count()) breach(absl::StrCat("shutdown took ", f["shutdown_ms"], " ms"));
    if (!m.harmed && f["shutdown_ok"] != 1) breach("shutdown failed");
    std::vector<std::string> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
    for (size_t i = 0; i + 1 < words.size(); i += 2) {
      if (words[i].rfind("code:", 0) == 0) {
        int code = 0;
        (void)absl::SimpleAtoi(words[i].substr(5), &code);
        failed_by_code[absl::StatusCodeToString(static_cast<absl::StatusCode>(code))] += std::stoll(words[i + 1]);
      }
      // A harmed caller may have been dropped by the others: only unharmed callers judge.
      if (words[i].rfind("target:", 0) == 0 && !m.harmed) {
        const std::string target = words[i].substr(7);
        absl::StatusOr<bool> harmed = store.check({key("harmed", target)});
        if (harmed.ok() && !*harmed) breach(absl::StrCat(words[i + 1], " calls to ", target, ", never harmed, failed"));
      }
    }
  }
  absl::StatusOr<int64_t> alive_store = store.add("faults/drained", 0);
  if (!alive_store.ok()) {
    std::fprintf(stderr, "faults: BREACH: the store stopped answering: %s\n", alive_store.status().ToString().c_str());
    ++breaches;
  }
  int harmed = 0;
  for (const Member& m : members) harmed += m.harmed ? 1 : 0;
  std::printf("faults: %d s, %d members in all (%d started during the run, %d of them failed to join), %d harmed "
              "(%d kills, %d stops)\n",
              s.seconds, static_cast<int>(members.size()), joins, join_failures, harmed, kills, stops);
  std::printf("faults: %lld calls, %lld ok, failed:", static_cast<long long>(calls), static_cast<long long>(ok));
  for (const auto& [code, n] : failed_by_code) std::printf(" %s %lld", code.c_str(), static_cast<long long>(n));
  std::printf("\nfaults: %s (%d breaches)\n", breaches == 0 ? "PASSED" : "FAILED", breaches);
  return breaches == 0 ? 0 : 1;
}

bool flag(int argc, char** argv, int& i, std::string_view name, int64_t& out) {
  if (argv[i] != name || i + 1 >= argc) return false;
  return absl::SimpleAtoi(argv[++i], &out);
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  std::string member;
  int rank = 0, port = 0;
  for (int i = 1; i < argc; ++i) {
    int64_t v = 0;
    const std::string_view a = argv[i];
    if (a == "--member" && i + 3 < argc) {
      member = argv[++i];
      rank = std::atoi(argv[++i]);
      port = std::atoi(argv[++i]);
    } else if (flag(argc, argv, i, "--seconds", v)) {
      s.seconds = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--members", v)) {
      s.members = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--max-members", v)) {
      s.max_members = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--in-flight", v)) {
      s.in_flight = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--harm-every-ms", v)) {
      s.harm_every_ms = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--heartbeat-ms", v)) {
      s.heartbeat_ms = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--timeout-ms", v)) {
      s.timeout_ms = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--max-elements", v)) {
      s.max_elements = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--late-slack-ms", v)) {
      s.late_slack_ms = static_cast<int>(v);
    } else if (flag(argc, argv, i, "--seed", v)) {
      s.seed = static_cast<uint64_t>(v);
    } else {
      std::fprintf(stderr,
                   "usage: ferry_faults [--seconds N] [--members N] [--max-members N] [--in-flight N] "
                   "[--harm-every-ms N] [--heartbeat-ms N] [--timeout-ms N] [--max-elements N] [--late-slack-ms N] "
                   "[--seed N]\n"
                   "unknown or malformed argument: %s\n",
                   argv[i]);
      return 2;
    }
  }
  if (s.members < 3 || s.in_flight < 1 || s.seconds < 1 || s.harm_every_ms < 1 || s.heartbeat_ms < 1 ||
      s.timeout_ms < 1 || s.max_elements < 1) {
    std::fprintf(stderr, "ferry_faults: --members must be at least 3, and every count and time at least 1\n");
    return 2;
  }
  if (!member.empty()) return run_member(member, rank, port, s);
  return run_parent("/proc/self/exe", s);
}
