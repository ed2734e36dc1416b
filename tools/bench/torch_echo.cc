#include "tools/bench/torch_echo.h"

#include <ATen/ops/arange.h>

#include "absl/strings/str_cat.h"
#include "rpc/rpc.h"
#include "torch/wire.h"

namespace ferry::tools::bench {
namespace {
constexpr char kTorchEcho[] = "bench.torch_echo";
}  // namespace

bool torch_echo_available() { return true; }

absl::Status register_torch_echo() {
  return register_function(kTorchEcho, [](at::Tensor t) { return t; });
}

std::function<absl::Status(int)> torch_echo_call(std::string server, size_t bytes) {
  // Filled like the ferry::Tensor echo's (a repeating byte pattern), made once.
  at::Tensor t = at::arange(static_cast<int64_t>(bytes), at::kLong).mul_(7).to(at::kByte);
  return [server = std::move(server), t](int) -> absl::Status {
    at::Tensor back = rpc_sync<at::Tensor>(server, kTorchEcho, t);
    if (back.nbytes() != t.nbytes()) {
      return absl::InternalError(
          absl::StrCat("at::Tensor echo of ", t.nbytes(), " bytes came back with ", back.nbytes(), " bytes"));
    }
    return absl::OkStatus();
  };
}

}  // namespace ferry::tools::bench
