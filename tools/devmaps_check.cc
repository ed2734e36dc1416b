#include "tools/devmaps_check.h"

#include <climits>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "device_maps/validate.h"
#include "nlohmann/json.hpp"
#include "tools/commands.h"

namespace ferry::tools {
namespace {

using nlohmann::json;

absl::Status bad(std::string_view where, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(internal::av(where), ": ", what));
}

// A short rendering of an unexpected value, for "expected X, got Y" messages.
std::string shown(const json& value) {
  constexpr size_t kMax = 40;
  std::string text = value.dump();
  if (text.size() > kMax) text = text.substr(0, kMax) + "...";
  return absl::StrCat(value.type_name(), " ", text);
}

// Refuses keys outside `allowed`, so that a misspelt "device_map" is an error rather
// than a silently empty map.
absl::Status check_keys(std::string_view where, const json& object, std::initializer_list<std::string_view> allowed) {
  for (const auto& [key, value] : object.items()) {
    bool known = false;
    for (std::string_view a : allowed) known = known || key == a;
    if (!known) {
      return bad(where, absl::StrCat("unknown key \"", key, "\" (expected ",
                                     absl::StrJoin(allowed, ", ",
                                                   [](std::string* out, std::string_view k) {
                                                     absl::StrAppend(out, "\"", internal::av(k), "\"");
                                                   }),
                                     ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Device> parse_device(std::string_view where, const json& value) {
  if (!value.is_string()) return bad(where, absl::StrCat("expected a device string, got ", shown(value)));
  absl::StatusOr<Device> device = Device::parse(value.get_ref<const std::string&>());
  if (!device.ok()) return bad(where, device.status().message());
  return *device;
}

absl::StatusOr<int> parse_device_count(std::string_view where, const json& value) {
  if (value.is_number_unsigned() && value.get<uint64_t>() <= static_cast<uint64_t>(INT_MAX)) {
    return static_cast<int>(value.get<uint64_t>());
  }
  return bad(where, absl::StrCat("expected a non-negative integer, got ", shown(value)));
}

absl::StatusOr<DeviceMap> parse_device_map(const std::string& where, const json& value) {
  if (!value.is_object()) return bad(where, absl::StrCat("expected an object of device strings, got ", shown(value)));
  DeviceMap map;
  std::map<Device, std::string> spelled;  // how each source was written, for duplicates
  for (const auto& [key, target_json] : value.items()) {
    absl::StatusOr<Device> source = Device::parse(key);
    if (!source.ok()) return bad(where, absl::StrCat("key \"", key, "\": ", source.status().message()));
    FERRY_ASSIGN_OR_RETURN(Device target, parse_device(absl::StrCat(where, "[\"", key, "\"]"), target_json));
    auto [it, inserted] = spelled.emplace(*source, key);
    if (!inserted) {
      return bad(where, absl::StrCat("keys \"", it->second, "\" and \"", key, "\" are the same device ",
                                     source->to_string()));
    }
    map.emplace(*source, target);
  }
  return map;
}

absl::StatusOr<WorkerDeviceInfo> parse_worker(const std::string& where, const json& value) {
  if (!value.is_object()) return bad(where, absl::StrCat("expected an object, got ", shown(value)));
  FERRY_RETURN_IF_ERROR(check_keys(where, value, {"name", "device_count", "devices", "device_maps"}));
  WorkerDeviceInfo info;

  auto name = value.find("name");
  if (name == value.end()) return bad(where, "missing \"name\"");
  if (!name->is_string() || name->get_ref<const std::string&>().empty()) {
    return bad(where + ".name", absl::StrCat("expected a non-empty string, got ", shown(*name)));
  }
  info.name = name->get<std::string>();

  auto count = value.find("device_count");
  if (count == value.end()) return bad(where, "missing \"device_count\"");
  FERRY_ASSIGN_OR_RETURN(info.device_count, parse_device_count(where + ".device_count", *count));

  if (auto devices = value.find("devices"); devices != value.end()) {
    if (!devices->is_array()) {
      return bad(where + ".devices", absl::StrCat("expected an array of device strings, got ", shown(*devices)));
    }
    for (size_t i = 0; i < devices->size(); ++i) {
      FERRY_ASSIGN_OR_RETURN(Device d, parse_device(absl::StrCat(where, ".devices[", i, "]"), (*devices)[i]));
      info.devices.push_back(d);
    }
  }

  if (auto maps = value.find("device_maps"); maps != value.end()) {
    if (!maps->is_object()) {
      return bad(where + ".device_maps", absl::StrCat("expected an object (worker name -> device map), got ",
                                                      shown(*maps)));
    }
    for (const auto& [target, map_json] : maps->items()) {
      FERRY_ASSIGN_OR_RETURN(info.device_maps[target],
                             parse_device_map(absl::StrCat(where, ".device_maps.", target), map_json));
    }
  }
  return info;
}

// Output keeps insertion order, so that "ok" comes first for a human reader.
using ordered_json = nlohmann::ordered_json;

ordered_json device_map_json(const DeviceMap& map) {
  ordered_json out = ordered_json::object();
  for (const auto& [from, to] : map) out[from.to_string()] = to.to_string();
  return out;
}

}  // namespace

absl::StatusOr<DevmapsConfig> parse_devmaps_config(std::string_view json_text) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    // A syntax error (parse_error) or a number too large for a double (out_of_range,
    // found by fuzz/devmaps_fuzz.cc). Drop nlohmann's "[json.exception.parse_error.101] "
    // tag; keep line and column.
    std::string_view what = e.what();
    if (size_t tag_end = what.find("] "); tag_end != std::string_view::npos) what.remove_prefix(tag_end + 2);
    return absl::InvalidArgumentError(absl::StrCat("invalid JSON: ", internal::av(what)));
  }
  if (!root.is_object()) return bad("top level", absl::StrCat("expected an object, got ", shown(root)));
  FERRY_RETURN_IF_ERROR(check_keys("top level", root, {"static", "workers"}));

  DevmapsConfig config;
  if (auto is_static = root.find("static"); is_static != root.end()) {
    if (!is_static->is_boolean()) return bad("static", absl::StrCat("expected true or false, got ", shown(*is_static)));
    config.is_static_group = is_static->get<bool>();
  }
  auto workers = root.find("workers");
  if (workers == root.end()) return bad("top level", "missing \"workers\"");
  if (!workers->is_array()) return bad("workers", absl::StrCat("expected an array, got ", shown(*workers)));

  std::map<std::string, size_t> index_of;
  for (size_t i = 0; i < workers->size(); ++i) {
    std::string where = absl::StrCat("workers[", i, "]");
    FERRY_ASSIGN_OR_RETURN(WorkerDeviceInfo info, parse_worker(where, (*workers)[i]));
    auto [it, inserted] = index_of.emplace(info.name, i);
    if (!inserted) {
      return bad(where + ".name",
                 absl::StrCat("duplicate worker name \"", info.name, "\" (also workers[", it->second, "])"));
    }
    config.workers.push_back(std::move(info));
  }
  return config;
}

DevmapsCheckResult check_devmaps_json(std::string_view json_text) {
  DevmapsCheckResult result;
  absl::StatusOr<DevmapsConfig> config = parse_devmaps_config(json_text);
  if (!config.ok()) {
    result.exit_code = kExitUsage;
    result.err = absl::StrCat(config.status().message(), "\n");
    return result;
  }
  // The init handler's steps 3-5 (DESIGN.md), for every worker of the group at once.
  absl::StatusOr<GroupDeviceInfo> group = group_device_info(config->workers);
  absl::Status valid = group.ok() ? validate_device_maps(group->names, group->device_counts, group->device_maps,
                                                         group->devices, config->is_static_group)
                                  : group.status();
  ordered_json out;
  if (!valid.ok()) {
    out = {{"ok", false}, {"error", std::string(valid.message())}};
    result.exit_code = kExitFailed;
  } else {
    ordered_json reverse_all = ordered_json::object();
    ordered_json devices_all = ordered_json::object();
    for (const WorkerDeviceInfo& w : config->workers) {
      DeviceMaps reverse = create_reverse_device_maps(w.name, group->names, group->device_maps);
      std::vector<Device> devices = create_device_list(w.devices, w.device_maps, reverse);
      ordered_json reverse_json = ordered_json::object();
      for (const auto& [peer, map] : reverse) reverse_json[peer] = device_map_json(map);
      ordered_json devices_json = ordered_json::array();
      for (Device d : devices) devices_json.push_back(d.to_string());
      reverse_all[w.name] = std::move(reverse_json);
      devices_all[w.name] = std::move(devices_json);
    }
    out = {{"ok", true}, {"reverse_device_maps", std::move(reverse_all)}, {"devices", std::move(devices_all)}};
    result.exit_code = kExitOk;
  }
  result.out = out.dump(2) + "\n";
  return result;
}

}  // namespace ferry::tools
