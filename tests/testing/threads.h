// File: tests/testing/threads.h
//
// What the kernel shows of this process's threads, for tests of thread names.
#pragma once

#include <dirent.h>

#include <fstream>
#include <string>
#include <string_view>

namespace ferry::testing {

// How many of this process's threads the kernel names `name` (/proc/self/task/*/comm).
inline int threads_named(std::string_view name) {
  int n = 0;
  DIR* dir = opendir("/proc/self/task");
  while (dirent* e = dir != nullptr ? readdir(dir) : nullptr) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string comm;
    if (std::getline(in, comm) && comm == name) ++n;
  }
  if (dir != nullptr) closedir(dir);
  return n;
}

}  // namespace ferry::testing
