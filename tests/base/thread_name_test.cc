#include "base/thread_name.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <fstream>
#include <string>
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

TEST(ThreadName, TheKernelShowsTheName) {
  std::string seen;
  std::thread([&] {
    name_this_thread("ferry-test");
    seen = own_comm();
  }).join();
  EXPECT_EQ(seen, "ferry-test");
}

TEST(ThreadName, ALongNameIsCutAtTheKernelsFifteenBytes) {
  std::string seen;
  std::thread([&] {
    name_this_thread("ferry-a-name-longer-than-fifteen");
    seen = own_comm();
  }).join();
  EXPECT_EQ(seen, "ferry-a-name-lo");
}

}  // namespace
}  // namespace ferry::internal
