// One worker of the multi-host test (multi_host_netns_test.cc), run inside a network
// namespace: takes a host name of its own (in a UTS namespace of its own, so that the
// namespace's /etc/hosts makes it resolve to 127.0.0.1), runs init_rpc with the
// default TENSORPIPE options through the given tcp:// store, calls every worker, and
// shuts down gracefully.
//
//   netns_worker HOSTNAME RANK WORLD_SIZE tcp://10.213.7.1:29500 TENSORPIPE|PROCESS_GROUP [MODE]
//
// MODE (TENSORPIPE, the default options but the heartbeat):
// - "alltoall": every worker echoes a 256 KiB tensor through every worker, twice, all
//   at once, and says which transports carried its calls;
// - "kill:R": worker R dies (SIGKILL) 2 s after init; every worker on another host
//   has a 20 s call running on it meanwhile, and says how soon that call failed and
//   why. The heartbeat is 60 s, so a prompt failure comes from the connection's end;
// - "cuda": every worker has one emulated CUDA device (tensor/emulated_cuda.h); worker 0
//   maps cuda:0 to cuda:0 of every other worker, echoes a 256 KiB CUDA tensor through
//   each and says how each call went ("rank 0 -> worker1: ok" or "... failed: <status>")
//   and which channel its device tensors took (debug_info's device_tensors.*). A
//   required channel comes from FERRY_DEVICE_CHANNEL.
//
// Exit 0 when every call returned what it should; 1 with the reason on stderr.
#include <sched.h>
#include <unistd.h>

#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <map>

#include "backends/process_group/process_group_backend.h"
#include "rpc/rpc.h"
#include "tensor/cuda.h"
#include "tensor/emulated_cuda.h"

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

// Every worker echoes a 256 KiB tensor through every worker, twice, all at once.
int all_to_all(int rank, int world) {
  std::vector<int32_t> values(64 * 1024);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<int32_t>(i * 31 + static_cast<size_t>(rank));
  const ferry::Tensor sent = ferry::Tensor::from_vector(values);
  std::vector<ferry::Future<ferry::Tensor>> calls;
  for (int round = 0; round < 2; ++round) {
    for (int to = 0; to < world; ++to) {
      calls.push_back(ferry::rpc_async<ferry::Tensor>("worker" + std::to_string(to), "echo", sent));
    }
  }
  int failures = 0;
  for (ferry::Future<ferry::Tensor>& f : calls) {
    absl::StatusOr<ferry::Tensor> got = f.result();
    if (!got.ok() || got->nbytes() != sent.nbytes() || std::memcmp(got->data(), sent.data(), sent.nbytes()) != 0) {
      ++failures;
      std::fprintf(stderr, "netns_worker: an echo failed: %s\n", got.ok() ? "wrong bytes" : got.status().ToString().c_str());
    }
  }
  std::map<std::string, std::string> info = ferry::current_agent()->debug_info();
  std::printf("rank %d: %zu echoes, %d failed; transports %s; tcp_opened %s; ring_opened %s\n", rank, calls.size(),
              failures, info["transports"].c_str(), info["tcp_opened"].c_str(), info["ring_opened"].c_str());
  absl::Status down = ferry::shutdown();
  if (!down.ok()) return fail("shutdown: " + down.ToString());
  std::fflush(stdout);
  return failures == 0 ? 0 : 1;
}

// Worker `victim` dies 2 s after init; the others on other hosts have a call on it.
int killed_peer(int rank, int victim) {
  constexpr int kPerHost = 4;
  if (rank == victim) {
    std::this_thread::sleep_for(std::chrono::seconds(2));
    raise(SIGKILL);
  }
  if (rank / kPerHost != victim / kPerHost) {
    const auto start = std::chrono::steady_clock::now();
    absl::StatusOr<int64_t> r =
        ferry::rpc_async<int64_t>("worker" + std::to_string(victim), "nap", int64_t{20000}).result();
    const auto ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
    if (r.ok()) return fail("the call on the killed worker succeeded");
    std::printf("rank %d: the call on worker%d failed after %lld ms: %s\n", rank, victim, static_cast<long long>(ms),
                r.status().ToString().c_str());
  }
  std::fflush(stdout);
  absl::Status down = ferry::shutdown(/*graceful=*/false);
  if (!down.ok()) return fail("shutdown: " + down.ToString());
  return 0;
}

// Worker 0 echoes a 256 KiB CUDA tensor through every other worker (over the limit
// under which cuda_ipc leaves a message to staging) and says how each call went.
int cuda_echoes(int rank, int world) {
  if (rank == 0) {
    std::vector<float> values(64 * 1024);
    for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i % 1000) + 0.5f;
    const ferry::Tensor sent = *ferry::Tensor::from_vector(values).to(ferry::Device::cuda(0));
    for (int to = 1; to < world; ++to) {
      const std::string peer = "worker" + std::to_string(to);
      absl::StatusOr<ferry::Tensor> got = ferry::rpc_async<ferry::Tensor>(peer, "echo", sent).result();
      if (!got.ok()) {
        std::printf("rank 0 -> %s: failed: %s\n", peer.c_str(), got.status().ToString().c_str());
      } else if (got->device() != ferry::Device::cuda(0) || *got->to_vector<float>() != values) {
        std::printf("rank 0 -> %s: wrong tensor\n", peer.c_str());
      } else {
        std::printf("rank 0 -> %s: ok\n", peer.c_str());
      }
    }
    for (const auto& [key, value] : ferry::current_agent()->debug_info()) {
      if (key.rfind("device_tensors.", 0) == 0) std::printf("rank 0: %s=%s\n", key.c_str(), value.c_str());
    }
  }
  std::fflush(stdout);
  absl::Status down = ferry::shutdown();
  if (!down.ok()) return fail("shutdown: " + down.ToString());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 6 && argc != 7) return fail("usage: netns_worker HOSTNAME RANK WORLD_SIZE INIT_METHOD BACKEND [MODE]");
  const std::string mode = argc == 7 ? argv[6] : "";
  const std::string hostname = argv[1];
  const int rank = std::atoi(argv[2]);
  const int world = std::atoi(argv[3]);
  if (unshare(CLONE_NEWUTS) != 0) return fail(std::string("unshare(CLONE_NEWUTS): ") + std::strerror(errno));
  if (sethostname(hostname.data(), hostname.size()) != 0) {
    return fail(std::string("sethostname: ") + std::strerror(errno));
  }
  (void)ferry::register_function("add", [](int64_t a, int64_t b) { return a + b; });
  (void)ferry::register_function("host", [] { return this_host(); });
  (void)ferry::register_function("echo", [](ferry::Tensor t) { return t; });
  (void)ferry::register_function("nap", [](int64_t ms) {
    std::this_thread::sleep_for(std::chrono::milliseconds(ms));
    return ms;
  });
  // Default options, but for where the store is and a bounded init.
  const std::string backend = argv[5];
  ferry::TensorPipeRpcBackendOptions tensorpipe;
  ferry::ProcessGroupRpcBackendOptions process_group;
  ferry::RpcBackendOptions& options =
      backend == "PROCESS_GROUP" ? static_cast<ferry::RpcBackendOptions&>(process_group) : tensorpipe;
  options.init_method = argv[4];
  options.rpc_timeout = std::chrono::seconds(30);
  if (mode.rfind("kill:", 0) == 0) tensorpipe.heartbeat = std::chrono::seconds(60);
  if (mode == "cuda") {
    ferry::EmulatedCudaOptions emulated;
    emulated.pool_capacity = uint64_t{1} << 28;
    ferry::set_cuda_runtime(std::make_shared<ferry::EmulatedCudaRuntime>(1, emulated));
    for (int to = 1; to < world && rank == 0; ++to) {
      absl::Status mapped = tensorpipe.set_device_map("worker" + std::to_string(to), ferry::DeviceMapSpec{{0, 0}});
      if (!mapped.ok()) return fail("set_device_map: " + mapped.ToString());
    }
  }
  absl::Status init = ferry::init_rpc("worker" + std::to_string(rank),
                                      backend == "PROCESS_GROUP" ? ferry::BackendType::PROCESS_GROUP
                                                                 : ferry::BackendType::TENSORPIPE,
                                      rank, world, options);
  if (!init.ok()) return fail("init_rpc: " + init.ToString());
  if (mode == "alltoall") return all_to_all(rank, world);
  if (mode == "cuda") return cuda_echoes(rank, world);
  if (mode.rfind("kill:", 0) == 0) return killed_peer(rank, std::atoi(mode.c_str() + 5));
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
