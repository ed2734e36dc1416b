#include "base/thread_name.h"

#include <pthread.h>

#include <algorithm>
#include <cstring>

namespace ferry::internal {

void name_this_thread(std::string_view name) {
  char buf[16] = {};  // the kernel's limit, with its terminating zero
  std::memcpy(buf, name.data(), std::min(name.size(), sizeof(buf) - 1));
  pthread_setname_np(pthread_self(), buf);
}

}  // namespace ferry::internal
