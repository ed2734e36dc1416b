// File: tools/trace/merge.h
//
// `ferry trace merge`: the workers' trace files (trace/trace.h) joined into one, on one
// clock.
//
// Each call traced on both sides bounds the callee's clock offset θ (callee minus
// caller): the request cannot arrive before it was sent, nor the reply before it was
// sent back, so T3 - T4 <= θ <= T2 - T1 (T1 send and T4 reply on the caller, T2 receipt
// and T3 reply on the callee). The bounds of every call between two workers, in both
// directions, are intersected and θ is the middle of what is left; when clocks drift
// enough that nothing is left, θ is the estimate of the call with the shortest network
// time ((T2 - T1 + T3 - T4) / 2, as NTP does). Offsets then follow the pairs from the
// worker with the lowest id, whose clock the merged file uses; a worker no call links
// keeps its own clock (and the file says so).
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace ferry::tools {

// Reads every *.trace.json in `directory` and returns the merged trace: every event,
// its "ts" moved onto the reference clock, one pid per worker, and in "otherData" each
// worker's offset in microseconds and how it was found. Errors: no trace file, a file
// that does not parse (naming it).
absl::StatusOr<nlohmann::json> merge_traces(const std::string& directory);

}  // namespace ferry::tools
