// File: tools/launcher/launcher.h
//
// The agent behind `ferry run`: one per node. It joins the run's elastic rendezvous
// (rendezvous/elastic.h, the "store" backend), starts this node's workers with
// torchrun's environment variables, watches them, and re-rendezvous when a worker
// fails (up to max_restarts times) or when nodes wait to join (any number of times).
//
//   LaunchOptions options;
//   options.min_nodes = options.max_nodes = 2;
//   options.nproc_per_node = 4;
//   options.rdzv_endpoint = "10.0.0.1:29400";
//   options.program = {"./train", "--epochs", "3"};
//   return run_launcher(options);   // the exit code for main()
//
// Each worker gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
// GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port on the node of group rank 0,
// where worker rank 0 is expected to host its store, as env:// does), FERRY_RUN_ID,
// FERRY_RESTART_COUNT (how many times this node restarted its workers after a failure;
// restarts to admit new nodes do not count, as in torchrun) and FERRY_MAX_RESTARTS.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "rendezvous/elastic.h"

namespace ferry::tools {

struct LaunchOptions {
  // One node on its own: a store hosted here on a free port, nnodes 1.
  bool standalone = false;
  int min_nodes = 1;
  int max_nodes = 1;
  int nproc_per_node = 1;
  std::string rdzv_backend = "store";
  std::string rdzv_endpoint;  // HOST[:PORT]
  std::string rdzv_id = "none";
  RendezvousConfig rdzv_conf;  // join_timeout, last_call_timeout, ... (see store_handler.h)
  int max_restarts = 0;
  std::chrono::milliseconds monitor_interval{100};
  // How long workers get to exit after SIGTERM before SIGKILL.
  std::chrono::milliseconds stop_timeout{std::chrono::seconds(10)};
  // The address the other nodes reach this node at, for MASTER_ADDR; default: 127.0.0.1
  // when the rendezvous endpoint is on loopback, else this host's name.
  std::optional<std::string> local_addr;
  std::vector<std::string> program;  // PROGRAM ARGS...
};

// "MIN:MAX" or "N" into min and max; kInvalidArgument saying what was expected.
absl::Status parse_nnodes(std::string_view text, int* min_nodes, int* max_nodes);
// "KEY=VALUE,KEY=VALUE" into a config of text values.
absl::StatusOr<RendezvousConfig> parse_rdzv_conf(std::string_view text);
// Seconds as a decimal number ("0.1", "5") into milliseconds (at least 1 ms).
absl::StatusOr<std::chrono::milliseconds> parse_seconds(std::string_view name, std::string_view text);

// Runs the node's agent until the job ends and returns the exit code: 0 when every
// worker of the last round exited 0; the failing worker's exit code (128 + signal when
// a signal killed it) once no restarts are left; 128 + the signal when the launcher was
// stopped by SIGINT, SIGTERM or SIGHUP (forwarded to the workers first); 1 for a
// rendezvous that failed or was closed by another node; 2 for bad options. Messages go
// to stderr, prefixed "ferry run: ". Must be called from the process's main thread
// before it starts any other thread (it blocks the stop signals and SIGCHLD to take
// them from a signalfd).
int run_launcher(const LaunchOptions& options);

}  // namespace ferry::tools
