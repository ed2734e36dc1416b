// TCPStore throughput: set, get and add against a local server (one libuv loop thread)
// with 1 and 16 clients, each client its own TCPStore (own connection) on its own
// thread. Run:
//   build/bench/store_bench --benchmark_min_time=2
// items_per_second is store operations per second summed over the clients.
#include <memory>
#include <string>

#include "benchmark/benchmark.h"
#include "store/tcp_store.h"

namespace {

using namespace std::chrono_literals;

ferry::TCPStoreServer& server() {
  // Shared by every benchmark, created on first use; lives until exit.
  static ferry::TCPStoreServer* s = [] {
    ferry::TCPStoreServerOptions options;
    options.host = "127.0.0.1";
    options.port = 0;
    return ferry::TCPStoreServer::create(options)->release();
  }();
  return *s;
}

std::unique_ptr<ferry::TCPStore> client(benchmark::State& state) {
  auto store = ferry::TCPStore::create("127.0.0.1", server().port(), false, std::nullopt, 30s);
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
  std::string key = "set/" + std::to_string(state.thread_index());
  for (auto _ : state) {
    if (!store->set(key, kValue).ok()) state.SkipWithError("set failed");
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_Get(benchmark::State& state) {
  auto store = client(state);
  if (!store) return;
  std::string key = "get/" + std::to_string(state.thread_index());
  if (!store->set(key, kValue).ok()) state.SkipWithError("set failed");
  for (auto _ : state) {
    auto v = store->get(key);
    if (!v.ok()) state.SkipWithError("get failed");
    benchmark::DoNotOptimize(v);
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_Add(benchmark::State& state) {
  auto store = client(state);
  if (!store) return;
  // One counter shared by every client: the contended case rendezvous produces.
  for (auto _ : state) {
    auto v = store->add("counter", 1);
    if (!v.ok()) state.SkipWithError("add failed");
    benchmark::DoNotOptimize(v);
  }
  state.SetItemsProcessed(state.iterations());
}

BENCHMARK(BM_Set)->Threads(1)->Threads(16)->UseRealTime();
BENCHMARK(BM_Get)->Threads(1)->Threads(16)->UseRealTime();
BENCHMARK(BM_Add)->Threads(1)->Threads(16)->UseRealTime();

}  // namespace
