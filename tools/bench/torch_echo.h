// File: tools/bench/torch_echo.h
//
// The at::Tensor echo of `ferry bench rpc`: the same echo as the ferry::Tensor one, with
// a function registered on at::Tensor (torch/wire.h), so the two compare what the
// torch component adds (wrapping on each side) at the same sizes. Built with the torch
// component only; without it torch_echo_available() is false and nothing is measured.
// This header includes no libtorch header, so rpc_bench.cc compiles without libtorch.
#pragma once

#include <cstddef>
#include <functional>
#include <string>

#include "absl/status/status.h"

namespace ferry::tools::bench {

// Whether this build has the torch component (and so the at::Tensor echo).
bool torch_echo_available();

// Registers the echo function (at::Tensor -> at::Tensor) in this process; a no-op
// without the torch component. Errors: kAlreadyExists from a second registration.
absl::Status register_torch_echo();

// One echo call per invocation: an at::Tensor of `bytes` bytes (uint8, made once) to
// worker `server` and back, checked for its size; the status of the call. Called on
// the measuring thread only. Without the torch component every call is kUnimplemented.
std::function<absl::Status(int)> torch_echo_call(std::string server, size_t bytes);

}  // namespace ferry::tools::bench
