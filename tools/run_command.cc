// `ferry run`: the launcher, one per node (like torchrun). It joins the run's elastic
// rendezvous, starts this node's workers with the env:// variables set, restarts them
// when one fails and when nodes wait to join, and forwards SIGINT and SIGTERM.
//
//   ferry run --standalone --nproc-per-node 4 ./train --epochs 3
//   ferry run --nnodes 2:4 --nproc-per-node 8 --rdzv-endpoint 10.0.0.1:29400 --rdzv-id job7
//       --max-restarts 3 ./train      (one command line)
//
// Exit codes: 0 every worker finished; the failing worker's code once no restarts are
// left; 128 + signal when stopped by one; 1 when the rendezvous failed; 2 bad usage.
// See tools/launcher/launcher.h.
#include <memory>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "tools/commands.h"
#include "tools/launcher/launcher.h"

namespace ferry::tools {
namespace {

struct RunFlags {
  bool standalone = false;
  std::string nnodes = "1";
  int nproc_per_node = 1;
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";
  std::string rdzv_backend = "store";
  std::string rdzv_conf;
  int max_restarts = 0;
  std::string monitor_interval = "0.1";
  std::string stop_timeout = "10";
  std::string local_addr;
};

int run(const RunFlags& flags, const std::vector<std::string>& program) {
  LaunchOptions options;
  options.standalone = flags.standalone;
  options.nproc_per_node = flags.nproc_per_node;
  options.rdzv_endpoint = flags.rdzv_endpoint;
  options.rdzv_id = flags.rdzv_id;
  options.rdzv_backend = flags.rdzv_backend;
  options.max_restarts = flags.max_restarts;
  options.program = program;
  if (!flags.local_addr.empty()) options.local_addr = flags.local_addr;
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "ferry run: %s\n", std::string(s.message()).c_str());
    return kExitUsage;
  };
  if (absl::Status s = parse_nnodes(flags.nnodes, &options.min_nodes, &options.max_nodes); !s.ok()) return fail(s);
  auto conf = parse_rdzv_conf(flags.rdzv_conf);
  if (!conf.ok()) return fail(conf.status());
  options.rdzv_conf = *conf;
  auto interval = parse_seconds("--monitor-interval", flags.monitor_interval);
  if (!interval.ok()) return fail(interval.status());
  options.monitor_interval = *interval;
  auto stop = parse_seconds("--stop-timeout", flags.stop_timeout);
  if (!stop.ok()) return fail(stop.status());
  options.stop_timeout = *stop;
  if (flags.standalone && flags.nnodes != "1") {
    std::fprintf(stderr, "ferry run: --standalone runs one node: leave out --nnodes\n");
    return kExitUsage;
  }
  return run_launcher(options);
}

void add_run_command(CLI::App& app, ExitCode& exit_code) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* cmd = app.add_subcommand("run", "Launch this node's workers of a job (like torchrun)");
  // Everything from PROGRAM on belongs to the program, its own flags included.
  cmd->prefix_command();
  cmd->add_flag("--standalone", flags->standalone, "A single node with its own rendezvous store on a free port");
  cmd->add_option("--nnodes", flags->nnodes, "Nodes in the job: N, or MIN:MAX for an elastic job")
      ->capture_default_str();
  cmd->add_option("--nproc-per-node", flags->nproc_per_node, "Workers on this node")->capture_default_str();
  cmd->add_option("--rdzv-endpoint", flags->rdzv_endpoint,
                  "The rendezvous store, HOST[:PORT] (default port 29400); the first node hosts it "
                  "when it can bind there, else it must be running (ferry store serve)");
  cmd->add_option("--rdzv-id", flags->rdzv_id, "The run's id: nodes with the same id form one job")
      ->capture_default_str();
  cmd->add_option("--rdzv-backend", flags->rdzv_backend, "The rendezvous backend")->capture_default_str();
  cmd->add_option("--rdzv-conf", flags->rdzv_conf,
                  "Backend options KEY=VALUE,...: join_timeout, last_call_timeout, shutdown_timeout (seconds), "
                  "is_host (bool)");
  cmd->add_option("--max-restarts", flags->max_restarts, "Restarts of this node's workers after a failure")
      ->capture_default_str();
  cmd->add_option("--monitor-interval", flags->monitor_interval,
                  "Seconds between checks for waiting nodes and a closed rendezvous")
      ->capture_default_str();
  cmd->add_option("--stop-timeout", flags->stop_timeout, "Seconds workers get after SIGTERM before SIGKILL")
      ->capture_default_str();
  cmd->add_option("--local-addr", flags->local_addr,
                  "The address other nodes reach this node at (MASTER_ADDR when it is group rank 0)");
  cmd->callback([flags, cmd, &exit_code] { exit_code.set(run(*flags, cmd->remaining())); });
}

}  // namespace

FERRY_REGISTER_COMMAND(add_run_command);

}  // namespace ferry::tools
