#include <unistd.h>

#include <cstdio>
#include <string>

#include "CLI/CLI.hpp"
#include "tensor/cuda.h"
#include "tools/commands.h"

namespace ferry::tools {
namespace {

void add_version_command(CLI::App& app, ExitCode& exit_code) {
  CLI::App* cmd = app.add_subcommand("version", "Print ferry's version and the CUDA devices it sees");
  cmd->callback([&exit_code] {
    std::shared_ptr<CudaRuntime> cuda = cuda_runtime();
    std::printf("ferry %s\n", FERRY_VERSION);
    int n = cuda->device_count();
    if (n > 0) {
      std::printf("cuda devices: %d\n", n);
    } else if (::access("/proc/driver/nvidia/version", F_OK) != 0 &&
               cuda->unavailable_reason().find("cudaGetDeviceCount") == 0) {
      // The runtime then says "CUDA driver version is insufficient", which reads as an
      // upgrade to make when there is simply no GPU driver on the host.
      std::printf("cuda devices: 0 (no NVIDIA driver is loaded on this host)\n");
    } else {
      std::printf("cuda devices: 0 (%s)\n", cuda->unavailable_reason().c_str());
    }
    exit_code.set(kExitOk);
  });
}

}  // namespace

FERRY_REGISTER_COMMAND(add_version_command);

}  // namespace ferry::tools
