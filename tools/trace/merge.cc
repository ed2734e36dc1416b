#include "tools/trace/merge.h"

#include <algorithm>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>

#include "absl/strings/str_cat.h"

namespace ferry::tools {

namespace {

struct Side {
  int worker = -1;
  int64_t a = 0;  // caller: send; callee: receipt
  int64_t b = 0;  // caller: reply received; callee: reply sent
};

// What the calls between workers x < y say about θ = clock(y) - clock(x).
struct PairBounds {
  double lo = -std::numeric_limits<double>::infinity();
  double hi = std::numeric_limits<double>::infinity();
  double best_delay = std::numeric_limits<double>::infinity();
  double best_estimate = 0;
  int calls = 0;
};

}  // namespace

absl::StatusOr<nlohmann::json> merge_traces(const std::string& directory) {
  std::error_code ec;
  std::vector<std::filesystem::path> paths;
  for (const auto& entry : std::filesystem::directory_iterator(directory, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 11 && name.substr(name.size() - 11) == ".trace.json") paths.push_back(entry.path());
  }
  if (ec) return absl::NotFoundError(absl::StrCat("cannot read ", directory, ": ", ec.message()));
  if (paths.empty()) return absl::NotFoundError(absl::StrCat("no *.trace.json file in ", directory));
  std::sort(paths.begin(), paths.end());

  std::map<int, nlohmann::json> files;  // by worker id
  std::map<int, std::string> names;
  for (const auto& path : paths) {
    std::ifstream in(path);
    nlohmann::json j = nlohmann::json::parse(in, nullptr, false);
    if (j.is_discarded() || !j.contains("traceEvents") || !j.contains("otherData")) {
      return absl::InvalidArgumentError(absl::StrCat(path.string(), " is not a ferry trace file"));
    }
    const int id = j["otherData"].value("id", -1);
    if (files.count(id)) {
      return absl::InvalidArgumentError(absl::StrCat(path.string(), ": worker id ", id, " appears twice"));
    }
    names[id] = j["otherData"].value("worker", path.filename().string());
    files[id] = std::move(j);
  }

  // Both sides of every call, by flow id.
  std::map<std::string, Side> callers;
  std::map<std::string, Side> callees;
  for (const auto& [id, file] : files) {
    for (const nlohmann::json& e : file["traceEvents"]) {
      if (e.value("ph", "") != "X" || !e.contains("args") || !e["args"].contains("flow")) continue;
      const std::string cat = e.value("cat", "");
      const nlohmann::json& args = e["args"];
      if (cat == "call") {
        callers[args["flow"]] = Side{id, args["t_send"].get<int64_t>(), args["t_reply"].get<int64_t>()};
      } else if (cat == "queue") {
        callees[args["flow"]] = Side{id, args["t_recv"].get<int64_t>(), args["t_reply"].get<int64_t>()};
      }
    }
  }
  std::map<std::pair<int, int>, PairBounds> pairs;
  for (const auto& [flow, caller] : callers) {
    auto it = callees.find(flow);
    if (it == callees.end() || it->second.worker == caller.worker) continue;
    const Side& callee = it->second;
    // θ(callee - caller) in [T3 - T4, T2 - T1].
    double lo = static_cast<double>(callee.b - caller.b);
    double hi = static_cast<double>(callee.a - caller.a);
    const double delay = static_cast<double>((caller.b - caller.a) - (callee.b - callee.a));
    double estimate = (lo + hi) / 2;
    int x = caller.worker;
    int y = callee.worker;
    if (x > y) {
      // The same bounds for θ(caller - callee).
      std::swap(x, y);
      std::tie(lo, hi) = std::make_pair(-hi, -lo);
      estimate = -estimate;
    }
    PairBounds& p = pairs[{x, y}];
    p.lo = std::max(p.lo, lo);
    p.hi = std::min(p.hi, hi);
    ++p.calls;
    if (delay < p.best_delay) {
      p.best_delay = delay;
      p.best_estimate = estimate;
    }
  }

  // Offsets along the pairs, breadth first from the lowest id: a first answer, and the
  // one kept when the bounds contradict each other.
  std::map<int, double> offset;
  std::map<int, std::string> how;
  std::deque<int> queue;
  const int reference = files.begin()->first;
  offset[reference] = 0;
  how[reference] = "reference clock";
  queue.push_back(reference);
  bool all_consistent = true;
  while (!queue.empty()) {
    const int x = queue.front();
    queue.pop_front();
    for (const auto& [key, p] : pairs) {
      int other;
      double theta;  // clock(other) - clock(x)
      const bool consistent = p.lo <= p.hi;
      all_consistent = all_consistent && consistent;
      const double mid = consistent ? (p.lo + p.hi) / 2 : p.best_estimate;
      if (key.first == x) {
        other = key.second;
        theta = mid;
      } else if (key.second == x) {
        other = key.first;
        theta = -mid;
      } else {
        continue;
      }
      if (offset.count(other)) continue;
      offset[other] = offset[x] + theta;
      how[other] = absl::StrCat(consistent ? "bounds of " : "shortest round trip of ", p.calls, " calls with ",
                                names[x]);
      queue.push_back(other);
    }
  }
  // A path's offsets need not satisfy the pairs off the path (worker1 and worker2 both
  // aligned to worker0 may still disagree about their own calls). Every pair's bounds
  // together are difference constraints, lo <= o(y) - o(x) <= hi, whose solutions form
  // a convex set: shortest paths (Bellman-Ford) give its two extreme solutions, and
  // their mean, moved so the reference stays at 0, satisfies every pair at once.
  bool path_fits = true;  // the path's offsets already satisfy every pair: kept
  for (const auto& [key, p] : pairs) {
    if (!offset.count(key.first) || !offset.count(key.second)) continue;
    const double d = offset[key.second] - offset[key.first];
    path_fits = path_fits && p.lo <= d && d <= p.hi;
  }
  if (all_consistent && !path_fits) {
    std::vector<int> ids;
    for (const auto& [id, unused] : offset) ids.push_back(id);
    struct Edge {
      int from, to;
      double w;  // o(to) - o(from) <= w
    };
    std::vector<Edge> edges;
    for (const auto& [key, p] : pairs) {
      if (!offset.count(key.first) || !offset.count(key.second)) continue;
      edges.push_back({key.first, key.second, p.hi});
      edges.push_back({key.second, key.first, -p.lo});
    }
    auto solve = [&](bool reversed) -> std::optional<std::map<int, double>> {
      std::map<int, double> d;
      for (int id : ids) d[id] = 0;
      for (size_t round = 0; round <= ids.size(); ++round) {
        bool changed = false;
        for (const Edge& e : edges) {
          const int from = reversed ? e.to : e.from;
          const int to = reversed ? e.from : e.to;
          if (d[from] + e.w < d[to] - 1e-9) {
            d[to] = d[from] + e.w;
            changed = true;
          }
        }
        if (!changed) {
          const double base = reversed ? -d[reference] : d[reference];
          for (auto& [id, v] : d) v = (reversed ? -v : v) - base;
          return d;
        }
      }
      return std::nullopt;  // a negative cycle: the bounds contradict each other
    };
    std::optional<std::map<int, double>> high = solve(false);
    std::optional<std::map<int, double>> low = solve(true);
    if (high.has_value() && low.has_value()) {
      for (int id : ids) {
        offset[id] = ((*high)[id] + (*low)[id]) / 2;
        if (id != reference) how[id] = absl::StrCat("bounds of every traced call (", how[id], ")");
      }
    }
  }

  nlohmann::json events = nlohmann::json::array();
  nlohmann::json workers = nlohmann::json::object();
  for (auto& [id, file] : files) {
    const bool aligned = offset.count(id) > 0;
    const double shift = aligned ? offset[id] : 0;
    workers[names[id]] = {{"id", id},
                          {"offset_us", shift},
                          {"aligned", aligned},
                          {"how", aligned ? how[id] : "no traced call links it to the others: its own clock"}};
    for (nlohmann::json& e : file["traceEvents"]) {
      if (e.contains("ts")) e["ts"] = e["ts"].get<double>() - shift;
      events.push_back(std::move(e));
    }
  }
  return nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}, {"otherData", {{"workers", workers}}}};
}

}  // namespace ferry::tools
