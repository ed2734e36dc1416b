// `ferry trace merge`: joins the trace files workers wrote under FERRY_TRACE=DIR into one
// file, their clocks aligned from the calls they traced (tools/trace/merge.h), for
// Perfetto or chrome://tracing: one process track per worker.
//
//   FERRY_TRACE=/tmp/t ferry run --standalone --nproc-per-node 3 ./pipeline
//   ferry trace merge /tmp/t -o job.json
//
// Exit codes: 0 written, 1 no trace file or one that does not parse, 2 bad usage.
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "tools/commands.h"
#include "tools/trace/merge.h"

namespace ferry::tools {
namespace {

struct MergeFlags {
  std::string directory;
  std::string output = "job.json";
};

void add_trace(CLI::App& app, ExitCode& exit_code) {
  CLI::App* trace = app.add_subcommand("trace", "Work with the call traces workers write under FERRY_TRACE");
  trace->require_subcommand(1);
  auto flags = std::make_shared<MergeFlags>();
  CLI::App* merge = trace->add_subcommand("merge", "Join the workers' trace files on one clock");
  merge->add_option("directory", flags->directory, "The FERRY_TRACE directory")->required();
  merge->add_option("-o,--output", flags->output, "The merged file")->capture_default_str();
  merge->callback([flags, &exit_code] {
    absl::StatusOr<nlohmann::json> merged = merge_traces(flags->directory);
    if (!merged.ok()) {
      std::fprintf(stderr, "ferry trace merge: %s\n", merged.status().ToString().c_str());
      exit_code.set(kExitFailed);
      return;
    }
    std::ofstream out(flags->output, std::ios::trunc);
    out << merged->dump();
    if (!out.good()) {
      std::fprintf(stderr, "ferry trace merge: cannot write %s\n", flags->output.c_str());
      exit_code.set(kExitFailed);
      return;
    }
    for (const auto& [name, w] : (*merged)["otherData"]["workers"].items()) {
      std::printf("%-16s offset %+.0f us  (%s)\n", name.c_str(), w["offset_us"].get<double>(),
                  w["how"].get<std::string>().c_str());
    }
    std::printf("wrote %s\n", flags->output.c_str());
  });
}

FERRY_REGISTER_COMMAND(add_trace);

}  // namespace
}  // namespace ferry::tools
