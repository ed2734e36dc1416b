// File: tools/bench/report.h
//
// Report helpers `ferry bench rpc` and `ferry bench init` share: the machine's state
// around a run, and the median their per-run figures reduce to.
//
//   report.nproc = static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
//   report.load_before = load_average();
//   ... run ...
//   j["machine"] = machine_json(report.nproc, report.load_before, report.load_after);
//   table += load_label(report.load_before);  // "0.42"
#pragma once

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "nlohmann/json.hpp"

namespace ferry::tools::bench {

// The 1-, 5- and 15-minute load averages; empty when the system cannot say.
std::vector<double> load_average();

// How a table shows a load_average(): its 1-minute figure, or "?" when unknown.
std::string load_label(const std::vector<double>& load);

// The report's "machine" object: the core count and the load around the run.
nlohmann::ordered_json machine_json(int nproc, const std::vector<double>& load_before,
                                    const std::vector<double>& load_after);

// The median of `sorted` (ascending, not empty): the middle value, or the mean of the
// two middle ones.
double median_of_sorted(const std::vector<double>& sorted);

// The median of a column of JSON numbers.
template <typename Json>
double median_of_numbers(const std::vector<Json>& column) {
  std::vector<double> v;
  for (const Json& x : column) v.push_back(x.template get<double>());
  std::sort(v.begin(), v.end());
  return median_of_sorted(v);
}

// Reduces JSON values of one shape (one per run) to one value of that shape, place by
// place: `leaf` gets the column of values at each place and returns the reduced value,
// or nullopt to go on: objects then reduce key by key, arrays index by index, and
// anything else takes the first value. Each bench says what its figures reduce to,
// e.g. a float to the median of its column.
template <typename Json, typename Leaf>
Json reduce_by_place(const std::vector<Json>& values, const Leaf& leaf) {
  if (std::optional<Json> reduced = leaf(values)) return *std::move(reduced);
  const Json& first = values.front();
  if (first.is_object()) {
    Json out = Json::object();
    for (auto it = first.begin(); it != first.end(); ++it) {
      std::vector<Json> column;
      for (const Json& x : values) column.push_back(x.at(it.key()));
      out[it.key()] = reduce_by_place(column, leaf);
    }
    return out;
  }
  if (first.is_array()) {
    Json out = Json::array();
    for (size_t i = 0; i < first.size(); ++i) {
      std::vector<Json> column;
      for (const Json& x : values) column.push_back(x.at(i));
      out.push_back(reduce_by_place(column, leaf));
    }
    return out;
  }
  return first;
}

}  // namespace ferry::tools::bench
