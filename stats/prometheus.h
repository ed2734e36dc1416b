// File: stats/prometheus.h
//
// A StatsSnapshot as Prometheus' text exposition format (version 0.0.4), and back: the
// metrics endpoint (metrics/) writes it, `ferry top` and tests read it.
//
//   std::string text = to_prometheus(stats.snapshot());
//   FERRY_ASSIGN_OR_RETURN(StatsSnapshot again, from_prometheus(text));
//
// Series (every counter is cumulative since the agent started):
//   ferry_worker_info{worker}                      1
//   ferry_calls_made_total{peer,function}          calls made
//   ferry_call_errors_made_total{peer,function}    made calls that failed
//   ferry_calls_served_total{peer,function}        requests served
//   ferry_call_errors_served_total{peer,function}  requests answered with an error
//   ferry_bytes_sent_total{peer,function}          requests and replies sent
//   ferry_bytes_received_total{peer,function}      requests and replies received
//   ferry_errors_total{direction,code}             errors by canonical code
//   ferry_calls_in_flight{direction}               made / served, now
//   ferry_made_call_seconds, ferry_served_call_seconds, ferry_queue_seconds:
//       histograms (_bucket{le} cumulative, _sum, _count) plus a _max gauge, of the
//       timed calls only (one in AgentStats' time_one_in): _count is the number of
//       samples, not of calls
// Pure functions; thread-compatible.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "stats/stats.h"

namespace ferry {

std::string to_prometheus(const StatsSnapshot& snapshot);

// One sample line of the exposition format.
struct PrometheusSample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

// Every sample of `text` (comments and blank lines skipped). kInvalidArgument naming
// the line for a line that does not parse.
absl::StatusOr<std::vector<PrometheusSample>> parse_prometheus(std::string_view text);

// The snapshot to_prometheus() wrote (series it does not know are ignored).
// kInvalidArgument when the text does not parse.
absl::StatusOr<StatsSnapshot> from_prometheus(std::string_view text);

}  // namespace ferry
