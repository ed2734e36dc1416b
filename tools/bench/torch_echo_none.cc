// A build without the torch component: no at::Tensor echo to measure.
#include "tools/bench/torch_echo.h"

namespace ferry::tools::bench {

bool torch_echo_available() { return false; }

absl::Status register_torch_echo() { return absl::OkStatus(); }

std::function<absl::Status(int)> torch_echo_call(std::string, size_t) {
  return [](int) { return absl::UnimplementedError("ferry was built without its torch component"); };
}

}  // namespace ferry::tools::bench
