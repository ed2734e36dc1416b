#include "base/thread_name.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <string>
#include <string_view>
#include <thread>

#include "gtest/gtest.h"

namespace ferry::internal {
namespace {

// What the kernel shows for the calling thread.
std::string own_comm() {
  std::ifstream in("/proc/self/task/" + std::to_string(syscall(SYS_gettid)) + "/comm");
  std::string comm;
  std::getline(in, comm);
  return comm;
}

// The name the kernel shows for a thread that named itself `name`.
std::string seen_after_naming(std::string_view name) {
  std::string seen;
  std::thread([&] {
    name_this_thread(name);
    seen = own_comm();
  }).join();
  return seen;
}

TEST(ThreadName, TheKernelShowsTheName) { EXPECT_EQ(seen_after_naming("ferry-test"), "ferry-test"); }

TEST(ThreadName, ALongNameIsCutAtTheKernelsFifteenBytes) {
  EXPECT_EQ(seen_after_naming("ferry-a-name-longer-than-fifteen"), "ferry-a-name-lo");
}

}  // namespace
}  // namespace ferry::internal
