// `ferry devmaps check FILE.json`: validates a whole group's device maps the way
// init_rpc would and prints what every worker's agent would get. The logic lives in
// tools/devmaps_check.h; this file only reads the file and prints.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "CLI/CLI.hpp"
#include "agents/cuda_ipc/cuda_ipc.h"
#include "tools/commands.h"
#include "tools/devmaps_check.h"

namespace ferry::tools {
namespace {

static_assert(kDefaultCudaIpcMinBytes == kCudaIpcMinBytes, "devmaps check reports the channel's default threshold");

// The whole file, or false with errno set (a directory opens but fails to read).
bool read_whole_file(const std::string& path, std::string& text) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path.c_str(), "rb"), &std::fclose);
  if (file == nullptr) return false;
  char buffer[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buffer, 1, sizeof(buffer), file.get())) > 0) text.append(buffer, n);
  return std::ferror(file.get()) == 0;
}

void add_devmaps_command(CLI::App& app, ExitCode& exit_code) {
  CLI::App* devmaps = app.add_subcommand("devmaps", "Device-map tools");
  devmaps->require_subcommand(1);
  CLI::App* check = devmaps->add_subcommand(
      "check",
      "Validate a group's device maps (a JSON file) as init_rpc would; print every worker's reverse device maps "
      "and devices, and the channel (cuda_ipc or staging) each worker's device tensors take to each peer and why, as "
      "JSON. Exit 0: valid; 1: invalid; 2: unreadable or malformed input");
  // Owned by the callback, which CLI11 keeps as long as the app.
  auto path = std::make_shared<std::string>();
  check->add_option("FILE", *path, "The group's configuration: {\"static\": true, \"workers\": [...]}")->required();
  check->callback([path, &exit_code] {
    std::string text;
    errno = 0;
    if (!read_whole_file(*path, text)) {
      int err = errno;
      std::fprintf(stderr, "ferry devmaps check: cannot read %s: %s\n", path->c_str(),
                   err != 0 ? std::strerror(err) : "read error");
      exit_code.set(kExitUsage);
      return;
    }
    DevmapsCheckResult result = check_devmaps_json(text);
    std::fputs(result.out.c_str(), stdout);
    if (!result.err.empty()) std::fprintf(stderr, "ferry devmaps check: %s: %s", path->c_str(), result.err.c_str());
    exit_code.set(result.exit_code);
  });
}

}  // namespace

FERRY_REGISTER_COMMAND(add_devmaps_command);

}  // namespace ferry::tools
