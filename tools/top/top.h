// File: tools/top/top.h
//
// The model behind `ferry top`: every worker of a job found through its store, scraped,
// and turned into per-second figures between two looks.
//
//   JobView view(store);
//   view.refresh(std::chrono::milliseconds(500));   // scrape every worker once
//   ... a second later ...
//   view.refresh(std::chrono::milliseconds(500));
//   std::cout << view.table() << view.json().dump(2);
//
// Thread-compatible: one thread drives it.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "nlohmann/json.hpp"
#include "stats/stats.h"
#include "store/store.h"

namespace ferry::tools {

// One worker as last seen.
struct WorkerView {
  std::string worker;
  std::string address;
  // The last two snapshots that came back (rates are their difference).
  std::optional<StatsSnapshot> latest;
  std::optional<StatsSnapshot> previous;
  // When it last answered, and why the last scrape failed ("" when it answered).
  std::optional<std::chrono::steady_clock::time_point> last_answer;
  std::chrono::steady_clock::time_point first_seen;
  std::string error;
  // When it left the job on purpose (seconds since the epoch), as its store record says:
  // it is not scraped any more, and its last figures stay.
  std::optional<double> departed;
  // It never left, and its store lease expired (MetricsEndpoint::lease_expired): it died.
  bool lease_expired = false;
  // How many of its peers each transport reaches (its ferry_peer_transport series).
  std::map<std::string, int> transports;
  // Device tensors sent to each peer, by the channel they took (its
  // ferry_device_tensors_total series): {"worker1": {"cuda_ipc": 40, "staging": 2}}.
  std::map<std::string, std::map<std::string, uint64_t>> device_tensors;
};

class JobView {
 public:
  explicit JobView(std::shared_ptr<Store> store) : store_(std::move(store)) {}

  // Looks the workers up in the store again and scrapes each (all at once), at most
  // `timeout` each, except those that left. Errors: only the store's; a worker that does
  // not answer is recorded as such.
  absl::Status refresh(std::chrono::milliseconds timeout);

  const std::vector<WorkerView>& workers() const { return workers_; }
  // The figures of every worker, as `ferry top --json` prints them (docs/observability.md).
  nlohmann::json json() const;
  // The live screen's text, `width` columns at most.
  std::vector<std::string> table(int width) const;

 private:
  std::shared_ptr<Store> store_;
  std::vector<WorkerView> workers_;
};

}  // namespace ferry::tools
