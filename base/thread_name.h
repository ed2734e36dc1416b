// File: base/thread_name.h
//
// Names the calling thread as the kernel shows it (/proc/<pid>/task/<tid>/comm, top -H,
// perf's comm column, gdb's thread list), so that a profile of a worker says which of
// its threads spent the time: "ferry-pool", "ferry-ring-data" and so on.
//
//   std::thread([] { internal::name_this_thread("ferry-ring-data"); run(); });
#pragma once

#include <string_view>

namespace ferry::internal {

// The kernel keeps 15 bytes of a name; longer names are cut there. Best effort: a
// name the kernel refuses leaves the thread as it was.
void name_this_thread(std::string_view name);

}  // namespace ferry::internal
