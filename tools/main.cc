// The `ferry` command-line tool: the project's one binary.
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "tools/commands.h"

namespace ferry::tools {
namespace {
std::vector<AddCommand>& commands() {
  static std::vector<AddCommand> list;
  return list;
}
}  // namespace

bool register_command(AddCommand add) {
  commands().push_back(add);
  return true;
}

void add_all_commands(CLI::App& app, ExitCode& exit_code) {
  for (AddCommand add : commands()) add(app, exit_code);
}

}  // namespace ferry::tools

int main(int argc, char** argv) {
  CLI::App app{"ferry: RPC for distributed tensor programs in C++"};
  app.require_subcommand(1);
  app.set_version_flag("--version", std::string("ferry ") + FERRY_VERSION);
  ferry::tools::ExitCode exit_code;
  ferry::tools::add_all_commands(app, exit_code);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 reports --help as a "parse error" with code 0; everything else is bad usage.
    int code = app.exit(e);
    return code == 0 ? ferry::tools::kExitOk : ferry::tools::kExitUsage;
  }
  return exit_code.get();
}
