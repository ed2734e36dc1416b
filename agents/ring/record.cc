#include "agents/ring/record.h"

#include <unistd.h>

#include <fstream>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace ferry::internal::ring {

namespace {

constexpr absl::string_view kProbeQuery = "?probe=";

std::string read_line(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

}  // namespace

const std::string& host_scope() {
  static const std::string scope = [] {
    std::string boot = read_line("/proc/sys/kernel/random/boot_id");
    char ns[128] = {};
    ssize_t n = readlink("/proc/self/ns/net", ns, sizeof(ns) - 1);
    std::string net = n > 0 ? std::string(ns, static_cast<size_t>(n)) : "net:[?]";
    // "net:[4026531992]" -> "4026531992"
    size_t open = net.find('['), close = net.find(']');
    if (open != std::string::npos && close != std::string::npos && close > open) {
      net = net.substr(open + 1, close - open - 1);
    }
    return absl::StrCat(boot.empty() ? "noboot" : boot, "/", net);
  }();
  return scope;
}

std::string record_line(const std::string& socket, pid_t pid, const uint64_t* probe) {
  return absl::StrCat("ring ring://", host_scope(), "/", socket, kProbeQuery, absl::Hex(pid), ".",
                      absl::Hex(reinterpret_cast<uint64_t>(probe)), ".", absl::Hex(*probe), "\n");
}

bool parse_record(const std::string& address, RingRecord& r) {
  for (absl::string_view line : absl::StrSplit(address, '\n', absl::SkipEmpty())) {
    if (!absl::ConsumePrefix(&line, "ring ring://")) continue;
    size_t query = line.find(kProbeQuery);
    if (query == absl::string_view::npos) return false;
    std::vector<absl::string_view> probe = absl::StrSplit(line.substr(query + kProbeQuery.size()), '.');
    line = line.substr(0, query);
    size_t last = line.rfind('/');
    uint64_t pid = 0;
    if (last == absl::string_view::npos || probe.size() != 3 || !absl::SimpleHexAtoi(probe[0], &pid) ||
        !absl::SimpleHexAtoi(probe[1], &r.probe_addr) || !absl::SimpleHexAtoi(probe[2], &r.probe_value)) {
      return false;
    }
    r.pid = static_cast<pid_t>(pid);
    r.scope = std::string(line.substr(0, last));
    r.socket = std::string(line.substr(last + 1));
    return !r.socket.empty();
  }
  return false;
}

}  // namespace ferry::internal::ring
