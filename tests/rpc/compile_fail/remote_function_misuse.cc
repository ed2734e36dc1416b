// Calls through a typed handle that must not compile. Built once per FERRY_CASE by
// the remote_function_compile_* tests, which expect the build to fail with the
// static_assert's message; built with no case as part of the normal build, which
// proves the rest of the file compiles.
#include <string>

#include "rpc/rpc.h"
#include "rpc/rref.h"

namespace {

struct Opaque {};

[[maybe_unused]] void calls() {
  ferry::RemoteFunction<int64_t(int64_t, int64_t)> add("add");
  ferry::RemoteFunction<double(std::string)> length("length");
#if FERRY_CASE == 1
  // Too few arguments.
  (void)ferry::rpc_sync("worker1", add, 1);
#elif FERRY_CASE == 3
  // An argument that does not convert to the declared type.
  (void)ferry::rpc_sync("worker1", length, Opaque{});
#elif FERRY_CASE == 4
  // remote() checks its arguments the same way.
  (void)ferry::remote("worker1", add, std::string("one"), 2);
#else
  (void)ferry::rpc_sync("worker1", add, 1, 2);
  (void)ferry::rpc_async("worker1", length, "text");
  (void)ferry::remote("worker1", add, 1, 2);
  (void)ferry::remote<int64_t>("worker1", add, 1, 2);
  (void)ferry::remote<int64_t>("worker1", "add", int64_t{1}, int64_t{2});
  (void)sizeof(Opaque);
#endif
}

}  // namespace
