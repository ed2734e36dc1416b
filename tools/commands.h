// Subcommands of the `ferry` tool. Exit codes are shared by all of them:
// 0 success, 1 the operation failed, 2 bad usage.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace ferry::tools {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;

// Collects the exit code of whichever subcommand ran (CLI11 callbacks return void).
class CommandRegistry {
 public:
  void set_exit_code(int code) { code_ = code; }
  int exit_code() const { return code_; }

 private:
  int code_ = kExitOk;
};

void add_version_command(CLI::App& app, CommandRegistry& registry);

}  // namespace ferry::tools
