// Subcommands of the `ferry` tool. Each lives in its own tools/*_command.cc and adds
// itself with FERRY_REGISTER_COMMAND; main() runs whichever one the user named.
// Exit codes are shared by all subcommands: 0 success, 1 the operation failed,
// 2 bad usage.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "store/store.h"

namespace CLI {
class App;
}

namespace ferry::tools {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailed = 1;
inline constexpr int kExitUsage = 2;

// Where a subcommand's callback leaves its exit code (CLI11 callbacks return void).
class ExitCode {
 public:
  void set(int code) { code_ = code; }
  int get() const { return code_; }

 private:
  int code_ = kExitOk;
};

// Adds one subcommand (and its options and callback) to `app`.
using AddCommand = void (*)(CLI::App& app, ExitCode& exit_code);

// Called at static-initialization time by FERRY_REGISTER_COMMAND. The tool's own
// object files are linked whole, so these registrations are never dropped.
bool register_command(AddCommand add);
// Adds every registered subcommand to `app`.
void add_all_commands(CLI::App& app, ExitCode& exit_code);

// An EtcdStore for "etcd://HOST:PORT,.../PREFIX" (ferry store, ferry top), or why not:
// kInvalidArgument for an address that does not parse, kFailedPrecondition in a build
// without EtcdStore, the store's errors. Defined in store_command.cc.
absl::StatusOr<std::unique_ptr<Store>> connect_etcd_store(const std::string& addr, std::chrono::milliseconds timeout);

}  // namespace ferry::tools

#define FERRY_REGISTER_COMMAND(fn) \
  [[maybe_unused]] static const bool ferry_command_registered_##fn = ::ferry::tools::register_command(&fn)
