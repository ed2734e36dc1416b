// File: tools/bench/rpc_report.h
//
// How `ferry bench rpc` (tools/bench/rpc_bench.h) reports: its figures as rows of ferry
// beside raw, the targets they are held to, and the JSON and table it prints. Internal
// to tools/bench/.
#pragma once

#include <cstddef>
#include <string>

namespace ferry::tools::bench {

// "64MiB", "4KiB", "8B": a size as the report's keys and labels spell it.
std::string size_label(size_t bytes);

}  // namespace ferry::tools::bench
