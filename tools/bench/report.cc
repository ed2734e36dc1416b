// Report helpers for the benches (see report.h).
#include "tools/bench/report.h"

#include <stdlib.h>

#include "absl/strings/str_format.h"

namespace ferry::tools::bench {

std::vector<double> load_average() {
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) != 3) return {};
  return {load[0], load[1], load[2]};
}

std::string load_label(const std::vector<double>& load) {
  return load.empty() ? std::string("?") : absl::StrFormat("%.2f", load[0]);
}

nlohmann::ordered_json machine_json(int nproc, const std::vector<double>& load_before,
                                    const std::vector<double>& load_after) {
  return {{"nproc", nproc}, {"load_average_before", load_before}, {"load_average_after", load_after}};
}

double median_of_sorted(const std::vector<double>& sorted) {
  size_t n = sorted.size();
  return n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
}

}  // namespace ferry::tools::bench
