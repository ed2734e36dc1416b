// Runs the real `ferry devmaps check` binary on files written into a temp dir and
// checks its JSON (stdout), its messages (stderr) and its exit codes.
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/multi_process.h"
#include "tests/testing/subprocess.h"

namespace ferry {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::IsEmpty;

constexpr int kOk = 0;
constexpr int kInvalid = 1;
constexpr int kUsage = 2;

using Outcome = ::ferry::testing::ProgramRun;

class DevmapsCheck : public ::testing::Test {
 protected:
  // Runs `ferry <args>` and captures what it printed.
  Outcome ferry(const std::vector<std::string>& args) { return ::ferry::testing::run_program(FERRY_BINARY, args); }

  // Writes `text` to a fresh file and runs `ferry devmaps check` on it.
  Outcome check(const std::string& text) {
    std::string path = dir_.path() + "/group" + std::to_string(files_++) + ".json";
    std::ofstream(path) << text;
    return ferry({"devmaps", "check", path});
  }

  // The JSON printed for a file that parsed, with exit code `want_exit`.
  json check_json(const std::string& text, int want_exit) {
    Outcome run = check(text);
    EXPECT_EQ(run.exit_code, want_exit) << "stdout: " << run.out << "\nstderr: " << run.err;
    EXPECT_THAT(run.err, IsEmpty());
    json parsed = json::parse(run.out, nullptr, /*allow_exceptions=*/false);
    EXPECT_FALSE(parsed.is_discarded()) << "stdout is not JSON: " << run.out;
    return parsed;
  }

  testing::TempDir dir_;
  int files_ = 0;
};

TEST_F(DevmapsCheck, ValidGroupPrintsReverseMapsAndDevices) {
  json got = check_json(R"({"static": true, "workers": [
      {"name": "w0", "device_count": 2, "devices": ["cuda:1", "cuda:0"],
       "device_maps": {"w1": {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}}},
      {"name": "w1", "device_count": 2, "device_maps": {"w2": {"cuda:1": "cuda:0", "cpu": "cpu"}}},
      {"name": "w2", "device_count": 1},
      {"name": "w3", "device_count": 0}]})",
                        kOk);
  EXPECT_EQ(got, json::parse(R"j({"ok": true,
      "reverse_device_maps": {
        "w0": {},
        "w1": {"w0": {"cuda:1": "cuda:0", "cuda:0": "cuda:1"}},
        "w2": {"w1": {"cuda:0": "cuda:1", "cpu": "cpu"}},
        "w3": {}},
      "devices": {
        "w0": ["cuda:0", "cuda:1"],
        "w1": ["cuda:0", "cuda:1"],
        "w2": ["cuda:0"],
        "w3": []},
      "channels": {
        "w0": {"w1": {"channel": "cuda_ipc", "why": "one host, both on the ring, both share their pools; a message with fewer than 65536 bytes of device tensors takes staging (cuda_ipc_min_bytes)"}},
        "w1": {"w2": {"channel": "cuda_ipc", "why": "one host, both on the ring, both share their pools; a message with fewer than 65536 bytes of device tensors takes staging (cuda_ipc_min_bytes)"},
               "w0": {"channel": "cuda_ipc", "why": "one host, both on the ring, both share their pools; a message with fewer than 65536 bytes of device tensors takes staging (cuda_ipc_min_bytes)"}},
        "w2": {"w1": {"channel": "cuda_ipc", "why": "one host, both on the ring, both share their pools; a message with fewer than 65536 bytes of device tensors takes staging (cuda_ipc_min_bytes)"}},
        "w3": {}}})j"));
}

TEST_F(DevmapsCheck, TheExampleOfTheBrief) {
  json got = check_json(R"({"static": true, "workers": [
      {"name": "w0", "device_count": 2, "devices": ["cuda:0"], "device_maps": {"w1": {"cuda:0": "cuda:1"}}},
      {"name": "w1", "device_count": 2}]})",
                        kOk);
  EXPECT_EQ(got["reverse_device_maps"], json::parse(R"({"w0": {}, "w1": {"w0": {"cuda:1": "cuda:0"}}})"));
  EXPECT_EQ(got["devices"], json::parse(R"({"w0": ["cuda:0"], "w1": ["cuda:1"]})"));
}

TEST_F(DevmapsCheck, EmptyGroupAndWorkersWithoutMaps) {
  EXPECT_EQ(check_json(R"({"workers": []})", kOk),
            json::parse(R"({"ok": true, "reverse_device_maps": {}, "devices": {}, "channels": {}})"));
  EXPECT_EQ(check_json(R"({"workers": [{"name": "a", "device_count": 0}, {"name": "b", "device_count": 3,
                                        "devices": [], "device_maps": {}}]})",
                       kOk),
            json::parse(R"({"ok": true, "reverse_device_maps": {"a": {}, "b": {}},
                            "devices": {"a": [], "b": []}, "channels": {"a": {}, "b": {}}})"));
}

TEST_F(DevmapsCheck, SaysWhichChannelEachPeersDeviceTensorsTakeAndWhy) {
  json got = check_json(R"({"workers": [
      {"name": "w0", "device_count": 1, "host": "a", "cuda_ipc_min_bytes": 0,
       "device_maps": {"w1": {"cuda:0": "cuda:0"}, "w2": {"cuda:0": "cuda:0"}, "w3": {"cuda:0": "cuda:0"},
                       "w4": {"cuda:0": "cuda:0"}}},
      {"name": "w1", "device_count": 1, "host": "a"},
      {"name": "w2", "device_count": 1, "host": "b"},
      {"name": "w3", "device_count": 1, "host": "a", "cuda_ipc": false},
      {"name": "w4", "device_count": 1, "host": "a", "transports": ["tcp"]},
      {"name": "w5", "device_count": 1, "host": "a", "device_channel": "cuda_ipc",
       "device_maps": {"w2": {"cuda:0": "cuda:0"}, "w1": {"cuda:0": "cuda:0"}}},
      {"name": "w6", "device_count": 1, "host": "a", "device_channel": "staging",
       "device_maps": {"w1": {"cuda:0": "cuda:0"}}}]})",
                        kOk);
  const json& c = got["channels"];
  EXPECT_EQ(c["w0"]["w1"], json::parse(R"j({"channel": "cuda_ipc",
                                           "why": "one host (\"a\"), both on the ring, both share their pools"})j"));
  EXPECT_EQ(c["w0"]["w2"], json::parse(R"j({"channel": "staging", "why": "w2 is on another host (\"b\", w0 on \"a\")"})j"));
  EXPECT_EQ(c["w0"]["w3"]["channel"], "staging");
  EXPECT_THAT(c["w0"]["w3"]["why"].get<std::string>(), HasSubstr("w3 cannot import w0's pool"));
  EXPECT_EQ(c["w0"]["w4"], json::parse(R"j({"channel": "staging",
                                           "why": "w4 has no ring transport (its record has no ring line)"})j"));
  // Replies: from the callee back to the caller.
  EXPECT_EQ(c["w3"]["w0"], json::parse(R"j({"channel": "staging", "why": "w3 has no IPC-capable pool (\"cuda_ipc\": false)"})j"));
  EXPECT_EQ(c["w2"]["w0"]["channel"], "staging");
  // Required: cuda_ipc where it can be had at any size, else the calls fail; staging.
  EXPECT_EQ(c["w5"]["w1"]["channel"], "cuda_ipc");
  EXPECT_THAT(c["w5"]["w1"]["why"].get<std::string>(), HasSubstr("required by w5 (device_channel), at any size"));
  EXPECT_EQ(c["w5"]["w2"]["channel"], "none");
  EXPECT_EQ(c["w5"]["w2"]["why"], "w5 requires cuda_ipc (device_channel), and w2 is on another host (\"b\", w5 on "
                                  "\"a\"): its calls with device tensors to w2 fail");
  EXPECT_EQ(c["w6"]["w1"], json::parse(R"j({"channel": "staging", "why": "w6 requires staging (device_channel)"})j"));
  // The placement keys are checked like the rest.
  Outcome bad = check(R"({"workers": [{"name": "w0", "device_count": 1, "device_channel": "ipc"}]})");
  EXPECT_EQ(bad.exit_code, kUsage);
  EXPECT_THAT(bad.err, HasSubstr("workers[0].device_channel: expected \"cuda_ipc\", \"staging\" or \"\" (none required)"));
}

TEST_F(DevmapsCheck, APerPeerRequiredChannelTakesThePlaceOfTheWorkersTowardsThatPeer) {
  // w0 requires cuda_ipc towards w1 (on its host) and w2 (on another), staging towards
  // w3; w4 requires cuda_ipc everywhere but towards w1.
  json got = check_json(R"({"workers": [
      {"name": "w0", "device_count": 1, "host": "a",
       "device_channels": {"w1": "cuda_ipc", "w2": "cuda_ipc", "w3": "staging"},
       "device_maps": {"w1": {"cuda:0": "cuda:0"}, "w2": {"cuda:0": "cuda:0"}, "w3": {"cuda:0": "cuda:0"},
                       "w5": {"cuda:0": "cuda:0"}}},
      {"name": "w1", "device_count": 1, "host": "a"},
      {"name": "w2", "device_count": 1, "host": "b"},
      {"name": "w3", "device_count": 1, "host": "a"},
      {"name": "w4", "device_count": 1, "host": "a", "device_channel": "cuda_ipc", "device_channels": {"w2": ""},
       "device_maps": {"w1": {"cuda:0": "cuda:0"}, "w2": {"cuda:0": "cuda:0"}}},
      {"name": "w5", "device_count": 1, "host": "a"}]})",
                        kOk);
  const json& c = got["channels"];
  EXPECT_EQ(c["w0"]["w1"]["channel"], "cuda_ipc");
  EXPECT_THAT(c["w0"]["w1"]["why"].get<std::string>(), HasSubstr("required by w0 (device_channels.w1), at any size"));
  EXPECT_EQ(c["w0"]["w2"], json::parse(R"j({"channel": "none",
      "why": "w0 requires cuda_ipc (device_channels.w2), and w2 is on another host (\"b\", w0 on \"a\"): its calls with device tensors to w2 fail"})j"));
  EXPECT_EQ(c["w0"]["w3"], json::parse(R"j({"channel": "staging", "why": "w0 requires staging (device_channels.w3)"})j"));
  // A peer it names nothing for: as without a requirement.
  EXPECT_EQ(c["w0"]["w5"]["channel"], "cuda_ipc");
  EXPECT_THAT(c["w0"]["w5"]["why"].get<std::string>(), HasSubstr("fewer than 65536 bytes"));
  EXPECT_THAT(c["w4"]["w1"]["why"].get<std::string>(), HasSubstr("required by w4 (device_channel)"));
  EXPECT_EQ(c["w4"]["w2"], json::parse(R"j({"channel": "staging", "why": "w2 is on another host (\"b\", w4 on \"a\")"})j"));
  // Checked like the rest.
  for (const char* text : {R"({"workers": [{"name": "w0", "device_count": 1, "device_channels": {"w1": "nvlink"}}]})",
                           R"({"workers": [{"name": "w0", "device_count": 1, "device_channels": {"w1": 1}}]})"}) {
    Outcome bad = check(text);
    EXPECT_EQ(bad.exit_code, kUsage) << text;
    EXPECT_THAT(bad.err, HasSubstr("workers[0].device_channels.w1: ")) << text;
    EXPECT_THAT(bad.err, HasSubstr("\"cuda_ipc\", \"staging\" or \"\" (none required)")) << text;
  }
  Outcome not_object = check(R"({"workers": [{"name": "w0", "device_count": 1, "device_channels": "cuda_ipc"}]})");
  EXPECT_THAT(not_object.err, HasSubstr("workers[0].device_channels: expected an object (worker name -> required channel)"));
}

TEST_F(DevmapsCheck, CpuIsKeptInGivenDevicesAndDroppedFromDerivedOnes) {
  json got = check_json(R"({"workers": [
      {"name": "w0", "device_count": 4, "devices": ["cuda:3", "cpu"],
       "device_maps": {"w1": {"cpu": "cpu", "cuda:3": "cuda"}}},
      {"name": "w1", "device_count": 1}]})",
                        kOk);
  EXPECT_EQ(got["devices"], json::parse(R"({"w0": ["cpu", "cuda:3"], "w1": ["cuda:0"]})"));
}

TEST_F(DevmapsCheck, StaticDefaultsToTrue) {
  const std::string group = R"("workers": [{"name": "w0", "device_count": 1,
                                             "device_maps": {"later": {"cuda:0": "cuda:5"}}}])";
  json got = check_json("{" + group + "}", kInvalid);
  EXPECT_EQ(got, json::parse(R"({"ok": false,
                                 "error": "device map w0->later: later is not a worker in the group [w0]"})"));
  EXPECT_EQ(check_json(R"({"static": true, )" + group + "}", kInvalid), got);
  // A dynamic group may map to a worker that has not joined yet.
  json dynamic = check_json(R"({"static": false, )" + group + "}", kOk);
  EXPECT_EQ(dynamic["reverse_device_maps"], json::parse(R"({"w0": {}})"));
  EXPECT_EQ(dynamic["devices"], json::parse(R"({"w0": ["cuda:0"]})"));
}

TEST_F(DevmapsCheck, InvalidGroupsPrintTheValidationMessage) {
  struct Case {
    const char* file;
    const char* error;
  } cases[] = {
      {R"({"workers": [{"name": "worker1", "device_count": 4, "device_maps": {"worker2": {"cuda:0": "cuda:3"}}},
                       {"name": "worker2", "device_count": 2}]})",
       "device map worker1->worker2: target cuda:3 out of range (worker2 has 2 devices) in {cuda:0 -> cuda:3}"},
      {R"({"workers": [{"name": "w0", "device_count": 2, "devices": ["cuda:1", "cuda:1"]}]})",
       "worker w0: duplicate device cuda:1 in devices [cuda:1, cuda:1]"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "devices": ["cuda:1"]}]})",
       "worker w0: device cuda:1 out of range (w0 has 1 device) in devices [cuda:1]"},
      {R"({"static": false, "workers": [{"name": "w0", "device_count": 2,
            "device_maps": {"w1": {"cuda:0": "cuda:0", "cuda:1": "cuda:0"}}}]})",
       "device map w0->w1: cuda:0 and cuda:1 both map to cuda:0 (a device map must be one-to-one) in "
       "{cuda:0 -> cuda:0, cuda:1 -> cuda:0}"},
      {R"({"workers": [{"name": "w0", "device_count": 2, "devices": ["cuda:1"],
                        "device_maps": {"w1": {"cuda:0": "cuda:0"}}}, {"name": "w1", "device_count": 1}]})",
       "device map w0->w1: source cuda:0 is not among w0's devices [cuda:1] in {cuda:0 -> cuda:0}"},
      {R"({"workers": [{"name": "w0", "device_count": 0, "device_maps": {"w1": {"cuda:0": "cuda:0"}}},
                       {"name": "w1", "device_count": 1}]})",
       "device map w0->w1: source cuda:0 out of range (w0 has 0 devices) in {cuda:0 -> cuda:0}"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "device_maps": {"w1": {"cuda:0": "cuda:0"}}},
                       {"name": "w1", "device_count": 2, "devices": ["cuda:1"]}]})",
       "device map w0->w1: target cuda:0 is not among w1's devices [cuda:1] in {cuda:0 -> cuda:0}"},
  };
  for (const Case& c : cases) {
    EXPECT_EQ(check_json(c.file, kInvalid), (json{{"ok", false}, {"error", c.error}})) << c.file;
  }
}

TEST_F(DevmapsCheck, MalformedInputIsAUsageErrorSayingWhere) {
  struct Case {
    const char* file;
    const char* message;
  } cases[] = {
      {"", "invalid JSON: parse error at line 1, column 1"},
      {R"({"workers": [)", "invalid JSON: parse error at line 1, column 14"},
      // Found by fuzz/devmaps_fuzz.cc: once an uncaught exception (the tool aborted).
      {"1e11555", "invalid JSON: number overflow parsing '1e11555'"},
      {R"({"workers": [{"name": "w0", "device_count": 1e400}]})", "invalid JSON: number overflow parsing '1e400'"},
      {"[]", "top level: expected an object, got array []"},
      {R"({"worker": []})", R"(top level: unknown key "worker" (expected "static", "workers"))"},
      {R"({"static": true})", R"(top level: missing "workers")"},
      {R"({"workers": {}})", "workers: expected an array, got object {}"},
      {R"({"static": "yes", "workers": []})", R"(static: expected true or false, got string "yes")"},
      {R"({"workers": [3]})", "workers[0]: expected an object, got number 3"},
      {R"({"workers": [{"device_count": 1}]})", R"(workers[0]: missing "name")"},
      {R"({"workers": [{"name": "", "device_count": 1}]})", R"(workers[0].name: expected a non-empty string, got string "")"},
      {R"({"workers": [{"name": 7, "device_count": 1}]})", "workers[0].name: expected a non-empty string, got number 7"},
      {R"({"workers": [{"name": "w0"}]})", R"(workers[0]: missing "device_count")"},
      {R"({"workers": [{"name": "w0", "device_count": -1}]})",
       "workers[0].device_count: expected a non-negative integer, got number -1"},
      {R"({"workers": [{"name": "w0", "device_count": 1.5}]})",
       "workers[0].device_count: expected a non-negative integer, got number 1.5"},
      {R"({"workers": [{"name": "w0", "device_count": "2"}]})",
       R"(workers[0].device_count: expected a non-negative integer, got string "2")"},
      {R"({"workers": [{"name": "w0", "device_count": 4294967296}]})",
       "workers[0].device_count: expected a non-negative integer, got number 4294967296"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "device_map": {}}]})",
       R"(workers[0]: unknown key "device_map" (expected "name", "device_count", "devices", "device_maps", "host", "transports", "cuda_ipc", "device_channel", "device_channels", "cuda_ipc_min_bytes"))"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "devices": "cuda:0"}]})",
       R"(workers[0].devices: expected an array of device strings, got string "cuda:0")"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "devices": ["cuda:0", "gpu"]}]})",
       R"(workers[0].devices[1]: invalid device string "gpu": unknown device type)"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "devices": [0]}]})",
       "workers[0].devices[0]: expected a device string, got number 0"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "device_maps": []}]})",
       "workers[0].device_maps: expected an object (worker name -> device map), got array []"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "device_maps": {"w1": ["cuda:0"]}}]})",
       R"(workers[0].device_maps.w1: expected an object of device strings, got array ["cuda:0"])"},
      {R"({"workers": [{"name": "w0", "device_count": 1},
                       {"name": "w1", "device_count": 1, "device_maps": {"w0": {"gpu:0": "cuda:0"}}}]})",
       R"(workers[1].device_maps.w0: key "gpu:0": invalid device string "gpu:0": unknown device type)"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "device_maps": {"w1": {"cuda:0": "cuda:x"}}}]})",
       R"(workers[0].device_maps.w1["cuda:0"]: invalid device string "cuda:x")"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "device_maps": {"w1": {"cuda:0": 1}}}]})",
       R"(workers[0].device_maps.w1["cuda:0"]: expected a device string, got number 1)"},
      {R"({"workers": [{"name": "w0", "device_count": 1, "device_maps": {"w1": {"cuda:0": "cpu", "cuda": "cuda"}}}]})",
       R"(workers[0].device_maps.w1: keys "cuda" and "cuda:0" are the same device cuda:0)"},
      {R"({"workers": [{"name": "w0", "device_count": 1}, {"name": "w1", "device_count": 1},
                       {"name": "w0", "device_count": 1}]})",
       R"(workers[2].name: duplicate worker name "w0" (also workers[0]))"},
  };
  for (const Case& c : cases) {
    Outcome run = check(c.file);
    EXPECT_EQ(run.exit_code, kUsage) << c.file;
    EXPECT_THAT(run.out, IsEmpty()) << c.file;
    EXPECT_THAT(run.err, HasSubstr(c.message)) << c.file;
  }
}

TEST_F(DevmapsCheck, MissingFileIsAUsageError) {
  std::string path = dir_.path() + "/no-such-file.json";
  Outcome run = ferry({"devmaps", "check", path});
  EXPECT_EQ(run.exit_code, kUsage);
  EXPECT_THAT(run.out, IsEmpty());
  EXPECT_THAT(run.err, HasSubstr("cannot read " + path + ": No such file or directory"));
}

TEST_F(DevmapsCheck, ADirectoryIsAUsageError) {
  Outcome run = ferry({"devmaps", "check", dir_.path()});
  EXPECT_EQ(run.exit_code, kUsage);
  EXPECT_THAT(run.err, HasSubstr("cannot read " + dir_.path()));
}

TEST_F(DevmapsCheck, BadUsageIsAUsageError) {
  EXPECT_EQ(ferry({"devmaps", "check"}).exit_code, kUsage);
  EXPECT_EQ(ferry({"devmaps"}).exit_code, kUsage);
  EXPECT_EQ(ferry({"devmaps", "check", "a.json", "b.json"}).exit_code, kUsage);
  Outcome help = ferry({"devmaps", "check", "--help"});
  EXPECT_EQ(help.exit_code, kOk);
  EXPECT_THAT(help.out, HasSubstr("FILE"));
}

}  // namespace
}  // namespace ferry
