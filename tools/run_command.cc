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
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "tools/commands.h"
#include "tools/launcher/launcher.h"

namespace ferry::tools {
namespace {

struct RunFlags {
  bool standalone = false;
  bool no_python = false;  // torchrun's; what it asks for is what ferry run always does
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

// torchrun options that ferry run does not take, and what to do instead.
struct Unsupported {
  std::string_view name;
  std::string_view instead;
};
constexpr Unsupported kTorchrunOnly[] = {
    {"--master-addr", "give the rendezvous as --rdzv-endpoint HOST:PORT"},
    {"--master-port", "give the rendezvous as --rdzv-endpoint HOST:PORT"},
    {"--node-rank", "node ranks are handed out by the rendezvous; leave it out"},
    {"--rdzv-timeout", "use --rdzv-conf join_timeout=SECONDS"},
    {"--role", "ferry run has no worker roles; leave it out"},
    {"--log-dir", "each output line is prefixed with its worker's rank; redirect the launcher's output"},
    {"--redirects", "each output line is prefixed with its worker's rank; redirect the launcher's output"},
    {"--tee", "each output line is prefixed with its worker's rank; redirect the launcher's output"},
    {"--module", "run the interpreter as the program: ferry run ... python3 -m MODULE"},
    {"--run-path", "give the program's path as PROGRAM"},
};

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// Why `arg`, an option before PROGRAM that no option of ferry run matched, is refused,
// with the spelling meant when one is near. Underscores read as dashes, as torchrun
// takes both.
std::string unknown_option(std::string arg, const std::vector<std::string>& known) {
  std::string name = arg.substr(0, arg.find('='));
  std::replace(name.begin(), name.end(), '_', '-');
  std::string why = absl::StrCat("unknown option '", arg, "' before PROGRAM");
  for (const Unsupported& u : kTorchrunOnly) {
    if (name == u.name) return absl::StrCat(why, ": ferry run does not take torchrun's ", std::string(u.name), "; ",
                                              std::string(u.instead));
  }
  std::string nearest;
  size_t best = 4;  // a few typos at most
  for (const std::string& k : known) {
    size_t d = edit_distance(name, k);
    if (d < best) {
      best = d;
      nearest = k;
    }
  }
  if (!nearest.empty()) return absl::StrCat(why, ": did you mean ", nearest, "?");
  return absl::StrCat(why, " (ferry run's options: ", absl::StrJoin(known, " "), ")");
}

int run(const RunFlags& flags, const std::vector<std::string>& program, const std::vector<std::string>& known) {
  // CLI11 leaves everything it did not match to the program, an unknown option before
  // it too: that would go through a whole rendezvous and then fail to execute it.
  if (!program.empty() && program.front().size() > 1 && program.front()[0] == '-') {
    std::fprintf(stderr, "ferry run: %s\n", unknown_option(program.front(), known).c_str());
    return kExitUsage;
  }
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

// The usage line names the program and its arguments, which CLI11 knows nothing of.
class RunFormatter : public CLI::Formatter {
 public:
  std::string make_usage(const CLI::App* app, std::string name) const override {
    std::string usage = CLI::Formatter::make_usage(app, std::move(name));
    const size_t end = usage.find_last_not_of('\n');
    return absl::StrCat(usage.substr(0, end + 1), " PROGRAM [ARGS...]\n");
  }
};

void add_run_command(CLI::App& app, ExitCode& exit_code) {
  auto flags = std::make_shared<RunFlags>();
  CLI::App* cmd = app.add_subcommand("run", "Launch this node's workers of a job (like torchrun)");
  cmd->formatter(std::make_shared<RunFormatter>());
  cmd->footer(
      "PROGRAM runs with ARGS, once per worker, with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, "
      "GROUP_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and FERRY_RUN_ID set (init_rpc's env://). torchrun's underscore spellings (--nproc_per_node) "
      "are taken too. Options go before PROGRAM; an unknown one there is refused.");
  // Everything from PROGRAM on belongs to the program, its own flags included.
  cmd->prefix_command();
  cmd->add_flag("--no-python,--no_python", flags->no_python,
                "Taken for torchrun's command lines: ferry run always runs PROGRAM itself");
  cmd->add_flag("--standalone", flags->standalone, "A single node with its own rendezvous store on a free port");
  cmd->add_option("--nnodes", flags->nnodes, "Nodes in the job: N, or MIN:MAX for an elastic job")
      ->capture_default_str();
  cmd->add_option("--nproc-per-node,--nproc_per_node", flags->nproc_per_node, "Workers on this node")->capture_default_str();
  cmd->add_option("--rdzv-endpoint,--rdzv_endpoint", flags->rdzv_endpoint,
                  "The rendezvous store, HOST[:PORT] (default port 29400); the first node hosts it "
                  "when it can bind there, else it must be running (ferry store serve)");
  cmd->add_option("--rdzv-id,--rdzv_id", flags->rdzv_id, "The run's id: nodes with the same id form one job")
      ->capture_default_str();
  cmd->add_option("--rdzv-backend,--rdzv_backend", flags->rdzv_backend, "The rendezvous backend")->capture_default_str();
  cmd->add_option("--rdzv-conf,--rdzv_conf", flags->rdzv_conf,
                  "Backend options KEY=VALUE,...: join_timeout, last_call_timeout, shutdown_timeout (seconds), "
                  "is_host (bool)");
  cmd->add_option("--max-restarts,--max_restarts", flags->max_restarts, "Restarts of this node's workers after a failure")
      ->capture_default_str();
  cmd->add_option("--monitor-interval,--monitor_interval", flags->monitor_interval,
                  "Seconds between checks for waiting nodes and a closed rendezvous")
      ->capture_default_str();
  cmd->add_option("--stop-timeout,--stop_timeout", flags->stop_timeout, "Seconds workers get after SIGTERM before SIGKILL")
      ->capture_default_str();
  cmd->add_option("--local-addr,--local_addr", flags->local_addr,
                  "The address other nodes reach this node at (MASTER_ADDR when it is group rank 0)");
  std::vector<std::string> known;
  for (const CLI::Option* o : cmd->get_options()) {
    if (!o->get_lnames().empty()) known.push_back("--" + o->get_lnames().front());
  }
  cmd->callback([flags, cmd, known, &exit_code] { exit_code.set(run(*flags, cmd->remaining(), known)); });
}

}  // namespace

FERRY_REGISTER_COMMAND(add_run_command);

}  // namespace ferry::tools
