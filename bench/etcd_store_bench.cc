// EtcdStore's latency per operation (one client, sequential) and throughput with 16
// clients, against the etcd cluster FERRY_ETCD_ENDPOINTS names (scripts/etcd-cluster.sh
// starts a local one). Each benchmark uses a fresh key prefix. Run:
//   scripts/etcd-cluster.sh start /tmp/etcd-bench
//   FERRY_ETCD_ENDPOINTS=127.0.0.1:23790,127.0.0.1:23791,127.0.0.1:23792 build/bench/etcd_store_bench
//   scripts/etcd-cluster.sh stop /tmp/etcd-bench
// items_per_second is store operations per second summed over the clients.
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <memory>
#include <string>

#include "benchmark/benchmark.h"
#include "store/etcd/etcd_store.h"

namespace {

std::unique_ptr<ferry::EtcdStore> client(benchmark::State& state) {
  const char* endpoints = std::getenv("FERRY_ETCD_ENDPOINTS");
  if (endpoints == nullptr) {
    state.SkipWithError("set FERRY_ETCD_ENDPOINTS (scripts/etcd-cluster.sh start DIR prints it)");
    return nullptr;
  }
  static std::atomic<int> run{0};
  ferry::EtcdStoreOptions options;
  options.endpoints = endpoints;
  options.prefix = "bench-" + std::to_string(::getpid()) + "-" + std::to_string(run++);
  auto store = ferry::EtcdStore::create(options);
  if (!store.ok()) {
    state.SkipWithError(std::string(store.status().message()).c_str());
    return nullptr;
  }
  return *std::move(store);
}

const ferry::Bytes kValue = ferry::to_bytes("a 32-byte value, like an address");

void BM_Set(benchmark::State& state) {
  auto store = client(state);
  if (!store) return;
  std::string key = "k" + std::to_string(state.thread_index());
  for (auto _ : state) {
    if (!store->set(key, kValue).ok()) state.SkipWithError("set failed");
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Set)->UseRealTime()->Threads(1)->Threads(16);

void BM_Get(benchmark::State& state) {
  auto store = client(state);
  if (!store) return;
  std::string key = "k" + std::to_string(state.thread_index());
  if (!store->set(key, kValue).ok()) state.SkipWithError("set failed");
  for (auto _ : state) {
    if (!store->get(key).ok()) state.SkipWithError("get failed");
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Get)->UseRealTime()->Threads(1)->Threads(16);

// A read and a compare-and-put transaction per add, retried when another client won.
void BM_Add(benchmark::State& state) {
  auto store = client(state);
  if (!store) return;
  std::string key = "c" + std::to_string(state.thread_index());
  for (auto _ : state) {
    if (!store->add(key, 1).ok()) state.SkipWithError("add failed");
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Add)->UseRealTime()->Threads(1)->Threads(16);

}  // namespace

BENCHMARK_MAIN();
