// One worker of the multi-host test (multi_host_netns_test.cc), run inside a network
// namespace: takes a host name of its own (in a UTS namespace of its own, so that the
// namespace's /etc/hosts makes it resolve to 127.0.0.1), runs init_rpc with the
// default TENSORPIPE options through the given tcp:// store, calls every worker, and
// shuts down gracefully.
//
//   netns_worker HOSTNAME RANK WORLD_SIZE tcp://10.213.7.1:29500 TENSORPIPE|PROCESS_GROUP
//
// Exit 0 when every call returned what it should; 1 with the reason on stderr.
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "backends/process_group/process_group_backend.h"
#include "rpc/rpc.h"

namespace {

std::string this_host() {
  char name[256] = {};
  gethostname(name, sizeof(name) - 1);
  return name;
}

int fail(const std::string& what) {
  std::fprintf(stderr, "netns_worker: %s\n", what.c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6) return fail("usage: netns_worker HOSTNAME RANK WORLD_SIZE INIT_METHOD BACKEND");
  const std::string hostname = argv[1];
  const int rank = std::atoi(argv[2]);
  const int world = std::atoi(argv[3]);
  if (unshare(CLONE_NEWUTS) != 0) return fail(std::string("unshare(CLONE_NEWUTS): ") + std::strerror(errno));
  if (sethostname(hostname.data(), hostname.size()) != 0) {
    return fail(std::string("sethostname: ") + std::strerror(errno));
  }
  (void)ferry::register_function("add", [](int64_t a, int64_t b) { return a + b; });
  (void)ferry::register_function("host", [] { return this_host(); });
  // Default options, but for where the store is and a bounded init.
  const std::string backend = argv[5];
  ferry::TensorPipeRpcBackendOptions tensorpipe;
  ferry::ProcessGroupRpcBackendOptions process_group;
  ferry::RpcBackendOptions& options =
      backend == "PROCESS_GROUP" ? static_cast<ferry::RpcBackendOptions&>(process_group) : tensorpipe;
  options.init_method = argv[4];
  options.rpc_timeout = std::chrono::seconds(30);
  absl::Status init = ferry::init_rpc("worker" + std::to_string(rank),
                                      backend == "PROCESS_GROUP" ? ferry::BackendType::PROCESS_GROUP
                                                                 : ferry::BackendType::TENSORPIPE,
                                      rank, world, options);
  if (!init.ok()) return fail("init_rpc: " + init.ToString());
  int failures = 0;
  for (int to = 0; to < world; ++to) {
    const std::string peer = "worker" + std::to_string(to);
    try {
      int64_t sum = ferry::rpc_sync<int64_t>(peer, "add", int64_t{rank}, int64_t{100 * to});
      std::string host = ferry::rpc_sync<std::string>(peer, "host");
      if (sum != rank + 100 * to) {
        ++failures;
        std::fprintf(stderr, "netns_worker: %s add gave %lld\n", peer.c_str(), static_cast<long long>(sum));
      }
      std::printf("rank %d -> %s on host %s: ok\n", rank, peer.c_str(), host.c_str());
    } catch (const std::exception& e) {
      ++failures;
      std::fprintf(stderr, "netns_worker: call to %s failed: %s\n", peer.c_str(), e.what());
    }
  }
  absl::Status down = ferry::shutdown();
  if (!down.ok()) return fail("shutdown: " + down.ToString());
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}
