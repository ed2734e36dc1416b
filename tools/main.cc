// The `ferry` command-line tool: the project's one binary. Each subcommand lives in
// its own file and adds itself to the app through tools/commands.h.
#include <cstdio>

#include "CLI/CLI.hpp"
#include "tools/commands.h"

int main(int argc, char** argv) {
  CLI::App app{"ferry: RPC for distributed tensor programs in C++"};
  app.require_subcommand(1);
  ferry::tools::CommandRegistry registry;
  ferry::tools::add_version_command(app, registry);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // CLI11 prints help with code 0; every other parse error is bad usage: exit 2.
    int code = app.exit(e);
    return code == 0 ? 0 : ferry::tools::kExitUsage;
  }
  return registry.exit_code();
}
