// ferry_flood: one caller floods one server's slow function, the way a client with no
// backpressure of its own would, and checks that the server's memory stays bounded and
// that every call ends with a result or an error (issue 27, finding 10).
//
//   ferry_flood --calls 1000000 --sleep-us 100 --timeout-s 120
//
// Two processes (forked, a file:// rendezvous, TensorPipe's backend with its default
// transports). The caller keeps --outstanding calls in flight at once (default
// 100,000: a hundred times the server's max_requests_in_flight), each with
// --timeout-s; the server's function sleeps --sleep-us and answers its argument's size.
// It prints the calls, how they ended (per status code), the time, and the server's
// VmHWM before and after with its backpressure counters (reads_paused,
// requests_refused_at_cap, requests_in_flight_peak). Exits 0 when every call ended,
// none failed, and the server's VmHWM grew by less than --max-growth-mib.
// docs/hardening.md ("Backpressure") has a run of 10^6; ctest runs a small one.
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "rpc/ferry.h"

namespace {

using Clock = std::chrono::steady_clock;

struct Settings {
  int64_t calls = 100000;
  int64_t outstanding = 100000;
  int sleep_us = 100;
  int timeout_s = 120;
  int payload = 64;
  int threads = 16;
  int64_t max_growth_mib = 256;
};

// A field of /proc/self/status in KiB ("VmRSS", "VmHWM").
int64_t status_kib(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::atoll(line.c_str() + field.size() + 1);
  }
  return -1;
}

// The server's side of the report: its memory and the agent's backpressure counters.
std::string server_stats() {
  std::map<std::string, std::string> info;
  if (std::shared_ptr<ferry::RpcAgent> agent = ferry::current_agent()) info = agent->debug_info();
  auto get = [&](const char* key) { return info.count(key) != 0 ? info[key] : std::string("?"); };
  return absl::StrCat(status_kib("VmHWM"), " ", status_kib("VmRSS"), " ", get("reads_paused"), " ",
                      get("requests_refused_at_cap"), " ", get("requests_in_flight_peak"), " ",
                      get("requests_served"));
}

void register_functions(int sleep_us) {
  (void)ferry::register_function("flood_slow", [sleep_us](std::string payload) {
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    return static_cast<int64_t>(payload.size());
  });
  (void)ferry::register_function("flood_stats", []() { return server_stats(); });
}

ferry::TensorPipeRpcBackendOptions backend_options(const std::string& url, const Settings& s) {
  ferry::TensorPipeRpcBackendOptions options;
  options.init_method = url;
  options.num_worker_threads = s.threads;
  options.rpc_timeout = std::chrono::seconds(s.timeout_s);
  return options;
}

int run_server(const std::string& url, const Settings& s) {
  register_functions(s.sleep_us);
  if (absl::Status st = ferry::init_rpc("server", 1, 2, backend_options(url, s)); !st.ok()) {
    std::fprintf(stderr, "flood: server: init_rpc: %s\n", st.ToString().c_str());
    return 1;
  }
  // The caller's last call reads this worker's figures; graceful shutdown waits for it.
  absl::Status st = ferry::shutdown(true, std::chrono::seconds(s.timeout_s + 600));
  if (!st.ok()) std::fprintf(stderr, "flood: server: shutdown: %s\n", st.ToString().c_str());
  return st.ok() ? 0 : 1;
}

int run_caller(const std::string& url, const Settings& s) {
  register_functions(s.sleep_us);
  if (absl::Status st = ferry::init_rpc("caller", 0, 2, backend_options(url, s)); !st.ok()) {
    std::fprintf(stderr, "flood: caller: init_rpc: %s\n", st.ToString().c_str());
    return 1;
  }
  int rc = 0;
  try {
    const std::string before = ferry::rpc_sync<std::string>("server", "flood_stats");
    const std::string payload(static_cast<size_t>(s.payload), 'x');
    // Shared with the calls' callbacks, which may outlive this scope if calls never end.
    struct Tally {
      std::mutex mu;
      std::condition_variable cv;
      int64_t in_flight = 0;                        // guarded by mu
      int64_t ended = 0;                            // guarded by mu
      std::map<absl::StatusCode, int64_t> by_code;  // guarded by mu
      std::string first_error;                      // guarded by mu
    };
    auto tally = std::make_shared<Tally>();
    std::mutex& mu = tally->mu;
    std::condition_variable& cv = tally->cv;
    int64_t& in_flight = tally->in_flight;
    int64_t& ended = tally->ended;
    std::map<absl::StatusCode, int64_t>& by_code = tally->by_code;
    std::string& first_error = tally->first_error;
    const Clock::time_point start = Clock::now();
    const ferry::RpcTimeout timeout{std::chrono::seconds(s.timeout_s)};
    for (int64_t i = 0; i < s.calls; ++i) {
      {
        std::unique_lock<std::mutex> lock(mu);
        // Every call ends by its timeout, so this wait has a bound too.
        if (!cv.wait_for(lock, std::chrono::seconds(s.timeout_s + 60), [&] { return in_flight < s.outstanding; })) {
          std::fprintf(stderr, "flood: no call ended for %d s\n", s.timeout_s + 60);
          rc = 1;
          break;
        }
        ++in_flight;
      }
      ferry::rpc_async<int64_t>("server", "flood_slow", timeout, payload)
          .add_inline_callback([tally, expected = s.payload](const absl::StatusOr<int64_t>& r) {
            std::lock_guard<std::mutex> lock(tally->mu);
            absl::StatusCode code = r.status().code();
            if (r.ok() && *r != expected) code = absl::StatusCode::kDataLoss;
            ++tally->by_code[code];
            if (code != absl::StatusCode::kOk && tally->first_error.empty()) {
              tally->first_error = r.ok() ? "a wrong answer" : r.status().ToString();
            }
            --tally->in_flight;
            ++tally->ended;
            tally->cv.notify_all();
          });
    }
    {
      std::unique_lock<std::mutex> lock(mu);
      if (!cv.wait_for(lock, std::chrono::seconds(s.timeout_s + 60), [&] { return in_flight == 0; })) {
        std::fprintf(stderr, "flood: %lld calls never ended\n", static_cast<long long>(in_flight));
        rc = 1;
      }
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    const std::string after = ferry::rpc_sync<std::string>("server", "flood_stats");
    long long hwm0 = 0, rss0 = 0, hwm1 = 0, rss1 = 0;
    char paused[32] = "?", refused[32] = "?", peak[32] = "?", served[32] = "?";
    std::sscanf(before.c_str(), "%lld %lld", &hwm0, &rss0);
    std::sscanf(after.c_str(), "%lld %lld %31s %31s %31s %31s", &hwm1, &rss1, paused, refused, peak, served);
    std::lock_guard<std::mutex> lock(mu);
    int64_t ok = by_code.count(absl::StatusCode::kOk) != 0 ? by_code[absl::StatusCode::kOk] : 0;
    std::printf("flood: %lld calls (%lld in flight at most, %d B each, %d us each, timeout %d s) in %.1f s, "
                "%.0f calls/s\n",
                static_cast<long long>(s.calls), static_cast<long long>(s.outstanding), s.payload, s.sleep_us,
                s.timeout_s, seconds, static_cast<double>(ended) / seconds);
    std::printf("flood: ended %lld of %lld: ", static_cast<long long>(ended), static_cast<long long>(s.calls));
    for (const auto& [code, n] : by_code) {
      std::printf("%s %lld  ", absl::StatusCodeToString(code).c_str(), static_cast<long long>(n));
    }
    std::printf("\n");
    const long long growth_kib = hwm1 - std::max(hwm0, rss0);
    std::printf("flood: server VmHWM %lld MiB before, %lld MiB after (grew %lld MiB), VmRSS %lld MiB after; "
                "reads_paused %s, requests_refused_at_cap %s, requests_in_flight_peak %s, requests_served %s\n",
                hwm0 >> 10, hwm1 >> 10, growth_kib >> 10, rss1 >> 10, paused, refused, peak, served);
    if (ended != s.calls || ok != s.calls) {
      std::printf("flood: FAILED: %lld of %lld calls ok%s%s\n", static_cast<long long>(ok),
                  static_cast<long long>(s.calls), first_error.empty() ? "" : "; first error: ",
                  first_error.c_str());
      rc = 1;
    }
    if (growth_kib > s.max_growth_mib * 1024) {
      std::printf("flood: FAILED: the server grew by %lld MiB (limit %lld MiB)\n", growth_kib >> 10,
                  static_cast<long long>(s.max_growth_mib));
      rc = 1;
    }
  } catch (const ferry::RpcError& e) {
    std::fprintf(stderr, "flood: caller: %s\n", e.what());
    rc = 1;
  }
  absl::Status st = ferry::shutdown(true, std::chrono::seconds(120));
  if (!st.ok()) {
    std::fprintf(stderr, "flood: caller: shutdown: %s\n", st.ToString().c_str());
    rc = 1;
  }
  return rc;
}

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--calls N] [--outstanding N] [--sleep-us U] [--timeout-s S] [--payload BYTES] "
               "[--threads N] [--max-growth-mib M]\n",
               argv0);
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    std::string arg = argv[i];
    if (i + 1 >= argc) return usage(argv[0]);
    const char* v = argv[++i];
    if (arg == "--calls") {
      s.calls = std::atoll(v);
    } else if (arg == "--outstanding") {
      s.outstanding = std::atoll(v);
    } else if (arg == "--sleep-us") {
      s.sleep_us = std::atoi(v);
    } else if (arg == "--timeout-s") {
      s.timeout_s = std::atoi(v);
    } else if (arg == "--payload") {
      s.payload = std::atoi(v);
    } else if (arg == "--threads") {
      s.threads = std::atoi(v);
    } else if (arg == "--max-growth-mib") {
      s.max_growth_mib = std::atoll(v);
    } else {
      return usage(argv[0]);
    }
  }
  if (s.calls < 1 || s.outstanding < 1 || s.sleep_us < 0 || s.timeout_s < 1 || s.payload < 0 || s.threads < 1) {
    return usage(argv[0]);
  }
  const std::string dir = std::filesystem::temp_directory_path() / ("ferry-flood-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string url = "file://" + dir + "/store";
  std::fflush(nullptr);
  pid_t server = ::fork();
  if (server == 0) ::_exit(run_server(url, s));
  const int rc = run_caller(url, s);
  // The server ends with the caller's graceful shutdown; a server that does not is
  // killed after a while rather than waited on.
  int status = 0;
  const Clock::time_point deadline = Clock::now() + std::chrono::seconds(120);
  pid_t got = 0;
  while ((got = ::waitpid(server, &status, WNOHANG)) == 0 && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (got == 0) {
    std::fprintf(stderr, "flood: the server did not exit; killed\n");
    ::kill(server, SIGKILL);
    ::waitpid(server, &status, 0);
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  const bool server_ok = got == server && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  return rc == 0 && server_ok ? 0 : 1;
}
