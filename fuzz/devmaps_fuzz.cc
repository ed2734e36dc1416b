// Fuzzes `ferry devmaps check`: its JSON input is parsed, validated and reported
// without I/O (tools/devmaps_check.h). Every input ends in one of the three results.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "tools/commands.h"
#include "tools/devmaps_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  ferry::tools::DevmapsCheckResult r = ferry::tools::check_devmaps_json(text);
  if (r.exit_code != ferry::tools::kExitOk && r.exit_code != ferry::tools::kExitFailed &&
      r.exit_code != ferry::tools::kExitUsage) {
    std::abort();
  }
  return 0;
}
