// `ferry top`: a running job seen live. Finds every worker's metrics endpoint through
// the job's store (workers started with FERRY_METRICS_PORT), scrapes each every second
// and shows a table; a worker that stops answering stays, marked as such.
//
//   ferry top --store 10.0.0.1:29500                   # the job's store (MASTER_ADDR:MASTER_PORT)
//   ferry top --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7   # as `ferry run` was given
//   ferry top --store 127.0.0.1:29500 --once --json    # one snapshot for scripts
//
// The job token comes from FERRY_AUTH_TOKEN, as for the other commands. Exit codes:
// 0 done, 1 the store could not be reached, 2 bad usage.
// The function forms, not macros: refresh() and timeout() are also names here.
#define NCURSES_NOMACROS
#include <curses.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <memory>
#include <string>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "metrics/metrics_server.h"
#include "store/prefix_store.h"
#include "store/tcp_store.h"
#include "tools/commands.h"
#include "tools/top/top.h"

namespace ferry::tools {
namespace {

struct TopFlags {
  std::string store;
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";
  bool once = false;
  bool json = false;
  int interval_ms = 1000;
  int timeout_ms = 800;
};

absl::StatusOr<std::shared_ptr<Store>> connect(const std::string& address, std::chrono::milliseconds timeout) {
  if (address.starts_with("etcd://")) {
    absl::StatusOr<std::unique_ptr<Store>> etcd = connect_etcd_store(address, timeout);
    if (!etcd.ok()) return etcd.status();
    return std::shared_ptr<Store>(*std::move(etcd));
  }
  absl::StatusOr<std::pair<std::string, int>> where = split_host_port(address);
  if (!where.ok()) return where.status();
  absl::StatusOr<std::unique_ptr<TCPStore>> store =
      TCPStore::create(where->first, static_cast<uint16_t>(where->second), false, std::nullopt, timeout);
  if (!store.ok()) return store.status();
  return std::shared_ptr<Store>(*std::move(store));
}

// The job's store from its rendezvous: `ferry run` records the store of the latest
// round (node 0's "MASTER_ADDR port") under ferry/rdzv/<id>/r<round>/data/master.
absl::StatusOr<std::shared_ptr<Store>> store_from_rendezvous(const TopFlags& flags,
                                                             std::chrono::milliseconds timeout) {
  absl::StatusOr<std::shared_ptr<Store>> root = connect(flags.rdzv_endpoint, timeout);
  if (!root.ok()) return root.status();
  auto run = std::make_shared<PrefixStore>("ferry/rdzv/" + flags.rdzv_id, *root);
  std::string master;
  for (int round = 0; round < 100000; ++round) {
    PrefixStore data(absl::StrCat("r", round, "/data"), run);
    absl::StatusOr<bool> there = data.check({"master"});
    if (!there.ok()) return there.status();
    if (!*there) {
      // Rounds are numbered in order, but a round may close without a master (it
      // failed); look one further before giving up.
      if (!master.empty() && !PrefixStore(absl::StrCat("r", round + 1, "/data"), run).check({"master"}).value_or(false)) {
        break;
      }
      if (master.empty() && round > 16) break;
      continue;
    }
    absl::StatusOr<Bytes> value = data.get("master", timeout);
    if (!value.ok()) return value.status();
    master = to_string(*value);
  }
  if (master.empty()) {
    return absl::NotFoundError(absl::StrCat("no round of run \"", flags.rdzv_id, "\" at ", flags.rdzv_endpoint,
                                            " has started workers yet (is --rdzv-id right?)"));
  }
  const size_t space = master.rfind(' ');
  std::string host = master.substr(0, space);
  if (host.find(':') != std::string::npos) host = "[" + host + "]";
  return connect(absl::StrCat(host, ":", master.substr(space + 1)), timeout);
}

std::string clock_now() {
  std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%H:%M:%S", std::localtime(&t));
  return buf;
}

int live(JobView& view, const TopFlags& flags, const std::string& source) {
  const std::chrono::milliseconds scrape_wait(flags.timeout_ms);
  if (!isatty(STDOUT_FILENO)) {
    // Not a terminal (a pipe, a log): the same table, printed once a second.
    for (;;) {
      absl::Status s = view.refresh(scrape_wait);
      std::cout << "ferry top " << source << "  " << clock_now() << (s.ok() ? "" : "  store: " + s.ToString())
                << "\n";
      for (const std::string& line : view.table(0)) std::cout << line << "\n";
      std::cout << std::endl;
      std::this_thread::sleep_for(std::chrono::milliseconds(flags.interval_ms));
    }
  }
  initscr();
  cbreak();
  noecho();
  curs_set(0);
  timeout(flags.interval_ms);
  for (;;) {
    absl::Status s = view.refresh(scrape_wait);
    erase();
    mvaddstr(0, 0,
             absl::StrCat("ferry top ", source, "  ", clock_now(), "  (q quits)",
                          s.ok() ? "" : "  store: " + std::string(s.message()))
                 .c_str());
    int row = 2;
    for (const std::string& line : view.table(COLS - 1)) {
      if (row >= LINES) break;
      mvaddstr(row++, 0, line.c_str());
    }
    refresh();
    const int key = getch();
    if (key == 'q' || key == 'Q') break;
  }
  endwin();
  return kExitOk;
}

void add_top(CLI::App& app, ExitCode& exit_code) {
  auto flags = std::make_shared<TopFlags>();
  CLI::App* cmd = app.add_subcommand("top", "Show a running job's workers live (calls/s, latency, errors, bytes)");
  cmd->footer(
      "Environment: FERRY_AUTH_TOKEN, the job token, for a job that has one: its store refuses a reader that does "
      "not prove it. The workers' metrics endpoints are plain HTTP and need none (docs/observability.md).");
  cmd->add_option("--store", flags->store, "The job's store, HOST:PORT (MASTER_ADDR:MASTER_PORT), or etcd://HOST:PORT,.../PREFIX");
  cmd->add_option("--rdzv-endpoint", flags->rdzv_endpoint, "The rendezvous endpoint `ferry run` was given");
  cmd->add_option("--rdzv-id", flags->rdzv_id, "The run's id, as `ferry run` was given")->capture_default_str();
  cmd->add_flag("--once", flags->once, "One snapshot (two looks, --interval-ms apart, for the rates), then exit");
  cmd->add_flag("--json", flags->json, "With --once: print JSON (docs/observability.md)");
  cmd->add_option("--interval-ms", flags->interval_ms, "Between refreshes")->capture_default_str()->check(
      CLI::Range(50, 60000));
  cmd->add_option("--timeout-ms", flags->timeout_ms, "How long a worker has to answer a scrape")
      ->capture_default_str()
      ->check(CLI::Range(10, 60000));
  cmd->callback([flags, &exit_code] {
    if (flags->store.empty() == flags->rdzv_endpoint.empty()) {
      std::fprintf(stderr, "ferry top: give exactly one of --store and --rdzv-endpoint\n");
      exit_code.set(kExitUsage);
      return;
    }
    const std::chrono::milliseconds timeout(std::max(flags->timeout_ms, 2000));
    absl::StatusOr<std::shared_ptr<Store>> store =
        flags->store.empty() ? store_from_rendezvous(*flags, timeout) : connect(flags->store, timeout);
    if (!store.ok()) {
      std::fprintf(stderr, "ferry top: %s\n", store.status().ToString().c_str());
      exit_code.set(store.status().code() == absl::StatusCode::kInvalidArgument ? kExitUsage : kExitFailed);
      return;
    }
    JobView view(*store);
    const std::string source = flags->store.empty() ? flags->rdzv_endpoint : flags->store;
    if (!flags->once) {
      exit_code.set(live(view, *flags, source));
      return;
    }
    absl::Status first = view.refresh(std::chrono::milliseconds(flags->timeout_ms));
    std::this_thread::sleep_for(std::chrono::milliseconds(flags->interval_ms));
    absl::Status second = first.ok() ? view.refresh(std::chrono::milliseconds(flags->timeout_ms)) : first;
    if (!second.ok()) {
      std::fprintf(stderr, "ferry top: reading the store: %s\n", second.ToString().c_str());
      exit_code.set(kExitFailed);
      return;
    }
    if (flags->json) {
      nlohmann::json j = view.json();
      j["store"] = source;
      std::cout << j.dump(2) << std::endl;
    } else {
      for (const std::string& line : view.table(0)) std::cout << line << "\n";
    }
  });
}

FERRY_REGISTER_COMMAND(add_top);

}  // namespace
}  // namespace ferry::tools
