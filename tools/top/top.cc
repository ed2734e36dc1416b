#include "tools/top/top.h"

#include <algorithm>
#include <future>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "metrics/metrics_server.h"
#include "stats/prometheus.h"

namespace ferry::tools {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_between(const StatsSnapshot& a, const StatsSnapshot& b) { return b.time - a.time; }

// Peers by transport, from the samples `ferry_peer_transport{peer="b",transport="ring"} 1`
// of a worker's metrics.
std::map<std::string, int> transports_in(const std::vector<PrometheusSample>& samples) {
  std::map<std::string, int> counts;
  for (const PrometheusSample& s : samples) {
    if (s.name != "ferry_peer_transport") continue;
    if (auto it = s.labels.find("transport"); it != s.labels.end()) ++counts[it->second];
  }
  return counts;
}

// Device tensors by peer and channel, from the samples
// `ferry_device_tensors_total{peer="b",channel="cuda_ipc"} 40` of a worker's metrics.
std::map<std::string, std::map<std::string, uint64_t>> device_tensors_in(const std::vector<PrometheusSample>& samples) {
  std::map<std::string, std::map<std::string, uint64_t>> out;
  for (const PrometheusSample& s : samples) {
    if (s.name != "ferry_device_tensors_total" || s.value < 0) continue;
    auto peer = s.labels.find("peer");
    auto channel = s.labels.find("channel");
    if (peer == s.labels.end() || channel == s.labels.end() || peer->second.empty() || channel->second.empty()) {
      continue;
    }
    out[peer->second][channel->second] = static_cast<uint64_t>(s.value);
  }
  return out;
}

double epoch_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// What happened between two snapshots of one histogram; the whole of `latest` when
// nothing did (or there is no earlier one), so that an idle worker still shows figures.
HistogramSnapshot window(const HistogramSnapshot& latest, const HistogramSnapshot* previous, bool* interval) {
  *interval = false;
  if (previous == nullptr || latest.count <= previous->count) return latest;
  HistogramSnapshot d;
  for (int i = 0; i < HistogramSnapshot::kBuckets; ++i) {
    d.buckets[i] = latest.buckets[i] - std::min(latest.buckets[i], previous->buckets[i]);
  }
  d.count = latest.count - previous->count;
  d.sum = latest.sum - previous->sum;
  d.max = latest.max;  // the largest since start: the window's own is not exported
  *interval = true;
  return d;
}

nlohmann::json latency(const HistogramSnapshot& h) {
  return {{"count", h.count},
          {"p50_ms", h.percentile(0.5) * 1e3},
          {"p90_ms", h.percentile(0.9) * 1e3},
          {"p99_ms", h.percentile(0.99) * 1e3},
          {"max_ms", h.max * 1e3}};
}

// The busiest entries of `now` (calls made plus served), with their rates since `before`.
nlohmann::json busiest(const std::map<std::string, CallCounts>& now, const std::map<std::string, CallCounts>* before,
                       double dt, size_t n) {
  struct Row {
    std::string name;
    CallCounts counts;
    double per_s;
  };
  std::vector<Row> rows;
  for (const auto& [name, c] : now) {
    double per_s = -1;
    if (before != nullptr && dt > 0) {
      auto it = before->find(name);
      const uint64_t was = it == before->end() ? 0 : it->second.made + it->second.served;
      per_s = static_cast<double>(c.made + c.served - std::min(c.made + c.served, was)) / dt;
    }
    rows.push_back(Row{name, c, per_s});
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    if (a.per_s != b.per_s) return a.per_s > b.per_s;
    return a.counts.made + a.counts.served > b.counts.made + b.counts.served;
  });
  nlohmann::json out = nlohmann::json::array();
  for (size_t i = 0; i < rows.size() && i < n; ++i) {
    const Row& r = rows[i];
    nlohmann::json row = {{"name", r.name},
                          {"made", r.counts.made},
                          {"served", r.counts.served},
                          {"errors", r.counts.made_errors + r.counts.served_errors}};
    row["calls_per_s"] = r.per_s < 0 ? nlohmann::json(nullptr) : nlohmann::json(r.per_s);
    out.push_back(row);
  }
  return out;
}

std::string human_bytes(double b) {
  if (b >= 1e9) return absl::StrFormat("%.1fG", b / 1e9);
  if (b >= 1e6) return absl::StrFormat("%.1fM", b / 1e6);
  if (b >= 1e3) return absl::StrFormat("%.1fk", b / 1e3);
  return absl::StrFormat("%.0f", b);
}

std::string rate(const nlohmann::json& v, bool bytes = false) {
  if (v.is_null()) return "-";
  return bytes ? human_bytes(v.get<double>()) : absl::StrFormat("%.0f", v.get<double>());
}

}  // namespace

absl::Status JobView::refresh(std::chrono::milliseconds timeout) {
  absl::StatusOr<std::vector<MetricsEndpoint>> endpoints = find_metrics_endpoints(*store_, kMetricsStorePrefix);
  if (!endpoints.ok()) return endpoints.status();
  for (const MetricsEndpoint& e : *endpoints) {
    auto it = std::find_if(workers_.begin(), workers_.end(), [&](const WorkerView& w) { return w.worker == e.worker; });
    if (it == workers_.end()) {
      WorkerView w;
      w.worker = e.worker;
      w.first_seen = Clock::now();
      workers_.push_back(std::move(w));
      it = workers_.end() - 1;
    }
    if (it->address != e.address) {
      // A new endpoint (the worker restarted): its counters start again.
      it->address = e.address;
      it->latest.reset();
      it->previous.reset();
    }
    it->departed = e.departed;
    it->lease_expired = e.lease_expired;
    if (e.departed) {
      // Its last figures stay, as totals: it makes no calls per second any more.
      it->error.clear();
      it->previous.reset();
    }
  }
  // Scraped all at once: a stopped worker costs one timeout, not one each. One that left
  // is not: its port may be gone, or someone else's now.
  std::vector<std::future<absl::StatusOr<std::string>>> answers;
  for (const WorkerView& w : workers_) {
    if (w.departed) {
      answers.emplace_back();
      continue;
    }
    answers.push_back(std::async(std::launch::async, [address = w.address, timeout] {
      return scrape_metrics(address, timeout);
    }));
  }
  for (size_t i = 0; i < workers_.size(); ++i) {
    WorkerView& w = workers_[i];
    if (w.departed) continue;
    absl::StatusOr<std::string> text = answers[i].get();
    absl::StatusOr<StatsSnapshot> snapshot =
        text.ok() ? from_prometheus(*text) : absl::StatusOr<StatsSnapshot>(text.status());
    if (!snapshot.ok()) {
      w.error = std::string(snapshot.status().message());
      continue;
    }
    w.error.clear();
    // The text parsed as a snapshot, so it parses as samples too.
    const std::vector<PrometheusSample> samples = parse_prometheus(*text).value_or(std::vector<PrometheusSample>());
    w.transports = transports_in(samples);
    w.device_tensors = device_tensors_in(samples);
    w.last_answer = Clock::now();
    w.previous = std::move(w.latest);
    w.latest = *std::move(snapshot);
  }
  std::sort(workers_.begin(), workers_.end(), [](const WorkerView& a, const WorkerView& b) { return a.worker < b.worker; });
  return absl::OkStatus();
}

nlohmann::json JobView::json() const {
  nlohmann::json workers = nlohmann::json::array();
  const Clock::time_point now = Clock::now();
  for (const WorkerView& w : workers_) {
    nlohmann::json j = {{"worker", w.worker}, {"address", w.address}};
    // A worker that left is neither answering nor silent: it is gone, as it meant to.
    const bool answering = !w.departed && w.error.empty() && w.last_answer.has_value();
    j["answering"] = answering;
    j["departed"] = w.departed.has_value();
    j["departed_seconds_ago"] =
        w.departed ? nlohmann::json(std::max(0.0, epoch_seconds() - *w.departed)) : nlohmann::json(nullptr);
    j["error"] = w.error;
    // Its endpoint refuses connections: nothing listens on its port any more, so the
    // process ended without leaving (killed, crashed). A stopped one times out instead.
    // Or, where the store has leases, its lease expired: that holds across hosts too,
    // where a dead host's port answers nothing at all.
    j["gone"] = !w.departed && (w.lease_expired || absl::StrContains(w.error, "Connection refused"));
    j["lease_expired"] = !w.departed && w.lease_expired;
    const Clock::time_point since = w.last_answer.value_or(w.first_seen);
    j["silent_seconds"] = answering || w.departed ? 0.0 : std::chrono::duration<double>(now - since).count();
    // Which transport reaches how many of its peers: {"ring": 3, "tcp": 4}.
    j["transports"] = w.transports;
    // Which channel its device tensors to each peer took: {"b": {"cuda_ipc": 40}}.
    j["device_tensors"] = w.device_tensors;
    if (!w.latest.has_value()) {
      workers.push_back(j);
      continue;
    }
    const StatsSnapshot& s = *w.latest;
    const StatsSnapshot* p = w.previous.has_value() ? &*w.previous : nullptr;
    const double dt = p == nullptr ? 0 : seconds_between(*p, s);
    auto per_s = [&](uint64_t a, uint64_t b) -> nlohmann::json {
      if (p == nullptr || dt <= 0) return nullptr;
      return static_cast<double>(a - std::min(a, b)) / dt;
    };
    j["made"] = s.totals.made;
    j["served"] = s.totals.served;
    j["made_per_s"] = per_s(s.totals.made, p ? p->totals.made : 0);
    j["served_per_s"] = per_s(s.totals.served, p ? p->totals.served : 0);
    j["in_flight_made"] = s.made_in_flight;
    j["in_flight_served"] = s.served_in_flight;
    j["errors_made"] = s.totals.made_errors;
    j["errors_served"] = s.totals.served_errors;
    j["errors_by_code"] = {{"made", s.made_errors_by_code}, {"served", s.served_errors_by_code}};
    j["bytes_in"] = s.totals.bytes_in;
    j["bytes_out"] = s.totals.bytes_out;
    j["bytes_in_per_s"] = per_s(s.totals.bytes_in, p ? p->totals.bytes_in : 0);
    j["bytes_out_per_s"] = per_s(s.totals.bytes_out, p ? p->totals.bytes_out : 0);
    bool interval = false;
    j["latency"] = {
        {"made", latency(window(s.made_latency, p ? &p->made_latency : nullptr, &interval))},
        {"served", latency(window(s.served_latency, p ? &p->served_latency : nullptr, &interval))},
        {"queue", latency(window(s.queue_latency, p ? &p->queue_latency : nullptr, &interval))},
    };
    j["functions"] = busiest(s.by_function, p ? &p->by_function : nullptr, dt, 5);
    j["peers"] = busiest(s.by_peer, p ? &p->by_peer : nullptr, dt, 5);
    workers.push_back(j);
  }
  return {{"workers", workers}};
}

std::vector<std::string> JobView::table(int width) const {
  std::vector<std::string> lines;
  lines.push_back(absl::StrFormat("%-12s %8s %8s %9s %8s %8s %7s %8s %8s  %s", "WORKER", "MADE/s", "SERVED/s",
                                  "INFLIGHT", "P50ms", "P99ms", "ERRORS", "IN/s", "OUT/s", "BUSIEST"));
  const nlohmann::json all = json();
  for (const nlohmann::json& w : all["workers"]) {
    std::string line;
    const std::string name = w["worker"].get<std::string>().substr(0, 12);
    if (w["departed"].get<bool>()) {
      line = absl::StrFormat("%-12s left the job %.0f s ago", name, w["departed_seconds_ago"].get<double>());
      if (w.contains("made")) {
        absl::StrAppendFormat(&line, " (made %d, served %d, errors %d)", w["made"].get<uint64_t>(),
                              w["served"].get<uint64_t>(),
                              w["errors_made"].get<uint64_t>() + w["errors_served"].get<uint64_t>());
      }
    } else if (w["gone"].get<bool>()) {
      line = absl::StrFormat("%-12s gone without leaving: %s", name,
                             w["lease_expired"].get<bool>() ? "its store lease expired"
                                                            : "its endpoint refuses connections");
    } else if (!w["answering"].get<bool>()) {
      line = absl::StrFormat("%-12s not answering for %.0f s (%s)", name, w["silent_seconds"].get<double>(),
                             w["error"].get<std::string>());
    } else if (!w.contains("made")) {
      line = absl::StrFormat("%-12s (no figures yet)", name);
    } else {
      std::string busiest;
      for (const nlohmann::json& f : w["functions"]) {
        if (busiest.size() > 40) break;
        absl::StrAppendFormat(&busiest, "%s%s:%s", busiest.empty() ? "" : " ", f["name"].get<std::string>(),
                              rate(f["calls_per_s"]));
      }
      std::string peers;
      for (const nlohmann::json& f : w["peers"]) {
        if (peers.size() > 40) break;
        absl::StrAppendFormat(&peers, "%s%s:%s", peers.empty() ? "" : " ", f["name"].get<std::string>(),
                              rate(f["calls_per_s"]));
      }
      const nlohmann::json& made = w["latency"]["made"];
      const nlohmann::json& served = w["latency"]["served"];
      // The latency shown is the made calls' where the worker makes calls, else the
      // served ones'.
      const nlohmann::json& l = made["count"].get<uint64_t>() > 0 ? made : served;
      std::string via;
      for (const auto& [transport, n] : w["transports"].items()) {
        absl::StrAppendFormat(&via, "%s%s %d", via.empty() ? " | via " : ", ", transport, n.get<int>());
      }
      // Each peer's device tensors by channel: " | devices b cuda_ipc 40 staging 2".
      std::string devices;
      for (const auto& [peer, by_channel] : w["device_tensors"].items()) {
        absl::StrAppend(&devices, devices.empty() ? " | devices " : "; ", peer);
        for (const auto& [channel, n] : by_channel.items()) {
          absl::StrAppend(&devices, " ", channel, " ", n.get<uint64_t>());
        }
      }
      via += devices;
      line = absl::StrFormat("%-12s %8s %8s %4d/%-4d %8.3f %8.3f %7d %8s %8s  fn %s | peers %s%s", name,
                             rate(w["made_per_s"]), rate(w["served_per_s"]), w["in_flight_made"].get<int64_t>(),
                             w["in_flight_served"].get<int64_t>(), l["p50_ms"].get<double>(),
                             l["p99_ms"].get<double>(),
                             static_cast<int>(w["errors_made"].get<uint64_t>() + w["errors_served"].get<uint64_t>()),
                             rate(w["bytes_in_per_s"], true), rate(w["bytes_out_per_s"], true), busiest, peers, via);
    }
    if (width > 0 && static_cast<int>(line.size()) > width) line.resize(static_cast<size_t>(width));
    lines.push_back(line);
  }
  if (all["workers"].empty()) lines.push_back("(no worker has published a metrics endpoint in this store yet)");
  return lines;
}

}  // namespace ferry::tools
