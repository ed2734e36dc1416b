// Statistics for `ferry bench rpc` (see measure.h).
#include "tools/bench/measure.h"

#include <sched.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tools/bench/report.h"

namespace ferry::tools::bench {

LatencyStats latency_stats(std::vector<double>& samples) {
  LatencyStats s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  size_t n = samples.size();
  s.samples = static_cast<int>(n);
  s.median_us = median_of_sorted(samples);
  // The nearest-rank p99: with 10,000 samples, the 9,900th smallest.
  size_t rank = static_cast<size_t>(std::ceil(0.99 * static_cast<double>(n)));
  s.p99_us = samples[std::clamp<size_t>(rank, 1, n) - 1];
  s.mean_us = std::accumulate(samples.begin(), samples.end(), 0.0) / static_cast<double>(n);
  s.min_us = samples.front();
  return s;
}

void set_call_latency(ThroughputResult& r, std::vector<double>& samples) {
  LatencyStats s = latency_stats(samples);
  r.median_us = s.median_us;
  r.p99_us = s.p99_us;
}

int allowed_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 0;
  return CPU_COUNT(&set);
}

}  // namespace ferry::tools::bench
