#include "stats/prometheus.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"

namespace ferry {

namespace {

// Label values come from peers (a function name is whatever a request said), so they
// are escaped as the format requires.
std::string escape(std::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (char c : value) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '"') {
      out += "\\\"";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

std::string number(double v) {
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  return absl::StrFormat("%.17g", v);
}

void counter_header(std::string& out, const std::string& name, const std::string& help, const std::string& type) {
  absl::StrAppend(&out, "# HELP ", name, " ", help, "\n# TYPE ", name, " ", type, "\n");
}

void histogram(std::string& out, const std::string& name, const std::string& help, const HistogramSnapshot& h) {
  counter_header(out, name, help, "histogram");
  uint64_t cumulative = 0;
  for (int i = 0; i < HistogramSnapshot::kBuckets; ++i) {
    cumulative += h.buckets[i];
    absl::StrAppend(&out, name, "_bucket{le=\"", number(HistogramSnapshot::upper_bound(i)), "\"} ", cumulative, "\n");
  }
  absl::StrAppend(&out, name, "_sum ", number(h.sum), "\n", name, "_count ", h.count, "\n");
  counter_header(out, absl::StrCat(name, "_max"), "largest value seen, seconds", "gauge");
  absl::StrAppend(&out, name, "_max ", number(h.max), "\n");
}

struct PairSeries {
  const char* name;
  const char* help;
  uint64_t CallCounts::*field;
};
constexpr PairSeries kPairSeries[] = {
    {"ferry_calls_made_total", "calls this worker made", &CallCounts::made},
    {"ferry_call_errors_made_total", "calls this worker made that failed", &CallCounts::made_errors},
    {"ferry_calls_served_total", "requests this worker served", &CallCounts::served},
    {"ferry_call_errors_served_total", "requests this worker answered with an error", &CallCounts::served_errors},
    {"ferry_bytes_sent_total", "request and reply bytes sent", &CallCounts::bytes_out},
    {"ferry_bytes_received_total", "request and reply bytes received", &CallCounts::bytes_in},
};

// Parses a label set `{a="x",b="y"}` starting at text[pos] == '{'; pos ends after '}'.
bool parse_labels(std::string_view text, size_t& pos, std::map<std::string, std::string>& labels) {
  ++pos;
  while (pos < text.size() && text[pos] != '}') {
    size_t eq = text.find('=', pos);
    if (eq == std::string_view::npos || eq + 1 >= text.size() || text[eq + 1] != '"') return false;
    std::string key(text.substr(pos, eq - pos));
    std::string value;
    size_t i = eq + 2;
    for (; i < text.size() && text[i] != '"'; ++i) {
      if (text[i] == '\\' && i + 1 < text.size()) {
        ++i;
        value += text[i] == 'n' ? '\n' : text[i];
      } else {
        value += text[i];
      }
    }
    if (i >= text.size()) return false;
    labels[key] = std::move(value);
    pos = i + 1;
    if (pos < text.size() && text[pos] == ',') ++pos;
  }
  if (pos >= text.size()) return false;
  ++pos;
  return true;
}

bool parse_value(std::string_view text, double& value) {
  if (text == "+Inf") {
    value = INFINITY;
    return true;
  }
  if (text == "-Inf") {
    value = -INFINITY;
    return true;
  }
  if (text == "NaN") {
    value = NAN;
    return true;
  }
  return absl::SimpleAtod(internal::av(text), &value);
}

}  // namespace

std::string to_prometheus(const StatsSnapshot& s) {
  std::string out;
  counter_header(out, "ferry_worker_info", "the worker this endpoint belongs to", "gauge");
  absl::StrAppend(&out, "ferry_worker_info{worker=\"", escape(s.worker), "\"} 1\n");
  counter_header(out, "ferry_snapshot_time_seconds", "when these figures were taken, seconds since the epoch",
                 "gauge");
  absl::StrAppend(&out, "ferry_snapshot_time_seconds ", number(s.time), "\n");
  for (const PairSeries& series : kPairSeries) {
    counter_header(out, series.name, series.help, "counter");
    for (const auto& [key, counts] : s.by_peer_function) {
      absl::StrAppend(&out, series.name, "{peer=\"", escape(key.first), "\",function=\"", escape(key.second), "\"} ",
                      counts.*series.field, "\n");
    }
  }
  counter_header(out, "ferry_errors_total", "failed calls by direction and canonical status code", "counter");
  for (const auto& [code, n] : s.made_errors_by_code) {
    absl::StrAppend(&out, "ferry_errors_total{direction=\"made\",code=\"", code, "\"} ", n, "\n");
  }
  for (const auto& [code, n] : s.served_errors_by_code) {
    absl::StrAppend(&out, "ferry_errors_total{direction=\"served\",code=\"", code, "\"} ", n, "\n");
  }
  counter_header(out, "ferry_calls_in_flight", "calls made and not finished; requests taken and not answered",
                 "gauge");
  absl::StrAppend(&out, "ferry_calls_in_flight{direction=\"made\"} ", s.made_in_flight, "\n");
  absl::StrAppend(&out, "ferry_calls_in_flight{direction=\"served\"} ", s.served_in_flight, "\n");
  histogram(out, "ferry_made_call_seconds", "made calls, send to reply or failure", s.made_latency);
  histogram(out, "ferry_served_call_seconds", "served requests, received to reply sent", s.served_latency);
  histogram(out, "ferry_queue_seconds", "served requests, received to handler start (pool queueing)",
            s.queue_latency);
  return out;
}

absl::StatusOr<std::vector<PrometheusSample>> parse_prometheus(std::string_view text) {
  std::vector<PrometheusSample> samples;
  int line_number = 0;
  size_t next = 0;
  while (next < text.size()) {
    size_t end = text.find('\n', next);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(next, end - next);
    next = end + 1;
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || line[0] == '#') continue;
    PrometheusSample sample;
    size_t pos = 0;
    while (pos < line.size() && line[pos] != '{' && line[pos] != ' ') ++pos;
    sample.name = std::string(line.substr(0, pos));
    bool ok = !sample.name.empty();
    if (ok && pos < line.size() && line[pos] == '{') ok = parse_labels(line, pos, sample.labels);
    if (ok) {
      while (pos < line.size() && line[pos] == ' ') ++pos;
      std::string_view rest = line.substr(pos);
      // An optional timestamp may follow the value.
      std::string_view value = rest.substr(0, rest.find(' '));
      ok = parse_value(value, sample.value);
    }
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("metrics line ", line_number, " does not parse: \"", internal::av(line.substr(0, 200)), "\""));
    }
    samples.push_back(std::move(sample));
  }
  return samples;
}

absl::StatusOr<StatsSnapshot> from_prometheus(std::string_view text) {
  absl::StatusOr<std::vector<PrometheusSample>> samples = parse_prometheus(text);
  if (!samples.ok()) return samples.status();
  StatsSnapshot s;
  auto histogram_of = [&](std::string_view base) -> HistogramSnapshot* {
    if (base == "ferry_made_call_seconds") return &s.made_latency;
    if (base == "ferry_served_call_seconds") return &s.served_latency;
    if (base == "ferry_queue_seconds") return &s.queue_latency;
    return nullptr;
  };
  // Buckets arrive cumulative; counts per bucket are their differences.
  std::map<HistogramSnapshot*, std::vector<uint64_t>> cumulative;
  for (const PrometheusSample& p : *samples) {
    const uint64_t n = p.value < 0 || std::isnan(p.value) ? 0 : static_cast<uint64_t>(std::llround(p.value));
    if (p.name == "ferry_worker_info") {
      s.worker = p.labels.count("worker") ? p.labels.at("worker") : "";
      continue;
    }
    if (p.name == "ferry_snapshot_time_seconds") {
      s.time = p.value;
      continue;
    }
    bool matched = false;
    for (const PairSeries& series : kPairSeries) {
      if (p.name != series.name) continue;
      matched = true;
      const std::string peer = p.labels.count("peer") ? p.labels.at("peer") : "";
      const std::string function = p.labels.count("function") ? p.labels.at("function") : "";
      s.by_peer_function[{peer, function}].*series.field += n;
      s.by_peer[peer].*series.field += n;
      s.by_function[function].*series.field += n;
      s.totals.*series.field += n;
    }
    if (matched) continue;
    if (p.name == "ferry_errors_total") {
      const std::string code = p.labels.count("code") ? p.labels.at("code") : "";
      (p.labels.count("direction") && p.labels.at("direction") == "served" ? s.served_errors_by_code
                                                                            : s.made_errors_by_code)[code] += n;
      continue;
    }
    if (p.name == "ferry_calls_in_flight") {
      const bool served = p.labels.count("direction") && p.labels.at("direction") == "served";
      (served ? s.served_in_flight : s.made_in_flight) = static_cast<int64_t>(p.value);
      continue;
    }
    for (std::string_view suffix : {"_bucket", "_sum", "_count", "_max"}) {
      std::string_view name = p.name;
      if (name.size() <= suffix.size() || name.substr(name.size() - suffix.size()) != suffix) continue;
      HistogramSnapshot* h = histogram_of(name.substr(0, name.size() - suffix.size()));
      if (h == nullptr) continue;
      if (suffix == "_bucket") {
        cumulative[h].push_back(n);
      } else if (suffix == "_sum") {
        h->sum = p.value;
      } else if (suffix == "_count") {
        h->count = n;
      } else {
        h->max = p.value;
      }
      break;
    }
  }
  for (auto& [h, buckets] : cumulative) {
    if (buckets.size() != HistogramSnapshot::kBuckets) {
      return absl::InvalidArgumentError(absl::StrCat("a histogram has ", buckets.size(), " buckets, expected ",
                                                     HistogramSnapshot::kBuckets));
    }
    uint64_t before = 0;
    for (int i = 0; i < HistogramSnapshot::kBuckets; ++i) {
      if (buckets[i] < before) return absl::InvalidArgumentError("histogram buckets are not cumulative");
      h->buckets[i] = buckets[i] - before;
      before = buckets[i];
    }
  }
  return s;
}

}  // namespace ferry
