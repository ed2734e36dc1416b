#include <cstdio>

#include "CLI/CLI.hpp"
#include "tensor/cuda.h"
#include "tools/commands.h"

namespace ferry::tools {

void add_version_command(CLI::App& app, CommandRegistry& registry) {
  CLI::App* cmd = app.add_subcommand("version", "Print ferry's version and the CUDA devices it sees");
  cmd->callback([&registry] {
    std::shared_ptr<CudaRuntime> cuda = cuda_runtime();
    std::printf("ferry %s\n", FERRY_VERSION);
    int n = cuda->device_count();
    if (n > 0) {
      std::printf("cuda devices: %d\n", n);
    } else {
      std::printf("cuda devices: 0 (%s)\n", cuda->unavailable_reason().c_str());
    }
    registry.set_exit_code(kExitOk);
  });
}

}  // namespace ferry::tools
