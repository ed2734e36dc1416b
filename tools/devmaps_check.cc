#include "tools/devmaps_check.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"
#include "device_maps/options.h"
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
  FERRY_RETURN_IF_ERROR(check_keys(where, value,
                                   {"name", "device_count", "devices", "device_maps", "host", "transports", "cuda_ipc",
                                    "device_channel", "device_channels", "cuda_ipc_min_bytes"}));
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

absl::StatusOr<WorkerPlacement> parse_placement(const std::string& where, const json& value) {
  WorkerPlacement p;
  if (auto host = value.find("host"); host != value.end()) {
    if (!host->is_string()) return bad(where + ".host", absl::StrCat("expected a string, got ", shown(*host)));
    p.host = host->get<std::string>();
  }
  if (auto transports = value.find("transports"); transports != value.end()) {
    if (!transports->is_array()) {
      return bad(where + ".transports", absl::StrCat("expected an array of transport names, got ", shown(*transports)));
    }
    p.transports.clear();
    for (size_t i = 0; i < transports->size(); ++i) {
      const json& t = (*transports)[i];
      if (!t.is_string() || t.get_ref<const std::string&>().empty()) {
        return bad(absl::StrCat(where, ".transports[", i, "]"), absl::StrCat("expected a transport name, got ", shown(t)));
      }
      p.transports.push_back(t.get<std::string>());
    }
  }
  if (auto ipc = value.find("cuda_ipc"); ipc != value.end()) {
    if (!ipc->is_boolean()) return bad(where + ".cuda_ipc", absl::StrCat("expected true or false, got ", shown(*ipc)));
    p.cuda_ipc = ipc->get<bool>();
  }
  if (auto required = value.find("device_channel"); required != value.end()) {
    const std::string* s = required->is_string() ? &required->get_ref<const std::string&>() : nullptr;
    if (s == nullptr || (!s->empty() && *s != "cuda_ipc" && *s != "staging")) {
      return bad(where + ".device_channel",
                 absl::StrCat("expected \"cuda_ipc\", \"staging\" or \"\" (none required), got ", shown(*required)));
    }
    p.device_channel = *s;
  }
  if (auto by_peer = value.find("device_channels"); by_peer != value.end()) {
    if (!by_peer->is_object()) {
      return bad(where + ".device_channels",
                 absl::StrCat("expected an object (worker name -> required channel), got ", shown(*by_peer)));
    }
    for (const auto& [peer, channel] : by_peer->items()) {
      const std::string at = absl::StrCat(where, ".device_channels.", peer);
      if (!channel.is_string()) {
        return bad(at, absl::StrCat("expected \"cuda_ipc\", \"staging\" or \"\" (none required), got ", shown(channel)));
      }
      // The check set_device_channel makes, in its words.
      absl::Status named = check_device_channel("the channel", channel.get_ref<const std::string&>());
      if (!named.ok()) return bad(at, std::string(named.message()));
      p.device_channels[peer] = channel.get<std::string>();
    }
  }
  if (auto min = value.find("cuda_ipc_min_bytes"); min != value.end()) {
    if (!min->is_number_unsigned()) {
      return bad(where + ".cuda_ipc_min_bytes", absl::StrCat("expected a number of bytes, got ", shown(*min)));
    }
    p.cuda_ipc_min_bytes = min->get<uint64_t>();
  }
  return p;
}

bool has_ring(const WorkerPlacement& p) {
  return std::find(p.transports.begin(), p.transports.end(), "ring") != p.transports.end();
}

// The channel device tensors from `from` to `to` take, and why: the choice
// Channels::choose and the cuda_ipc channel make, from what the file says of them.
std::pair<std::string, std::string> channel_between(const std::string& from, const WorkerPlacement& f,
                                                    const std::string& to, const WorkerPlacement& t) {
  // What `from` requires towards `to`: its entry for `to` in device_channels, else its
  // device_channel.
  auto own = f.device_channels.find(to);
  const std::string& required = own != f.device_channels.end() ? own->second : f.device_channel;
  const std::string setting =
      own != f.device_channels.end() ? absl::StrCat("device_channels.", to) : std::string("device_channel");
  if (required == "staging") return {"staging", absl::StrCat(from, " requires staging (", setting, ")")};
  std::string why_not;
  if (f.host != t.host) {
    why_not = absl::StrCat(to, " is on another host (\"", t.host, "\", ", from, " on \"", f.host, "\")");
  } else if (!has_ring(f) || !has_ring(t)) {
    why_not = absl::StrCat(has_ring(f) ? to : from, " has no ring transport (its record has no ring line)");
  } else if (!f.cuda_ipc) {
    why_not = absl::StrCat(from, " has no IPC-capable pool (\"cuda_ipc\": false)");
  } else if (!t.cuda_ipc) {
    why_not = absl::StrCat(to, " cannot import ", from, "'s pool (\"cuda_ipc\": false): it refuses the first "
                           "call's device tensors, and later calls stage");
  }
  if (why_not.empty()) {
    std::string why = absl::StrCat(f.host.empty() ? std::string("one host") : absl::StrCat("one host (\"", f.host, "\")"),
                                   ", both on the ring, both share their pools");
    if (required == "cuda_ipc") {
      return {"cuda_ipc", absl::StrCat(why, "; required by ", from, " (", setting, "), at any size")};
    }
    if (f.cuda_ipc_min_bytes > 0) {
      absl::StrAppend(&why, "; a message with fewer than ", f.cuda_ipc_min_bytes,
                      " bytes of device tensors takes staging (cuda_ipc_min_bytes)");
    }
    return {"cuda_ipc", why};
  }
  if (required == "cuda_ipc") {
    return {"none", absl::StrCat(from, " requires cuda_ipc (", setting, "), and ", why_not,
                                 ": its calls with device tensors to ", to, " fail")};
  }
  return {"staging", why_not};
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
    FERRY_ASSIGN_OR_RETURN(WorkerPlacement placement, parse_placement(where, (*workers)[i]));
    config.placements.push_back(std::move(placement));
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
    ordered_json channels_all = ordered_json::object();
    std::map<std::string, const WorkerPlacement*> placement_of;
    for (size_t i = 0; i < config->workers.size(); ++i) placement_of[config->workers[i].name] = &config->placements[i];
    for (size_t i = 0; i < config->workers.size(); ++i) {
      const WorkerDeviceInfo& w = config->workers[i];
      DeviceMaps reverse = create_reverse_device_maps(w.name, group->names, group->device_maps);
      // Requests to its maps' peers, replies to its reverse maps' (a dynamic group's
      // peer not in the file yet: unknown, so not reported).
      ordered_json channels_json = ordered_json::object();
      for (const DeviceMaps* maps : std::initializer_list<const DeviceMaps*>{&w.device_maps, &reverse}) {
        for (const auto& [peer, map] : *maps) {
          auto to = placement_of.find(peer);
          if (to == placement_of.end() || channels_json.contains(peer)) continue;
          auto [channel, why] = channel_between(w.name, config->placements[i], peer, *to->second);
          channels_json[peer] = {{"channel", channel}, {"why", why}};
        }
      }
      channels_all[w.name] = std::move(channels_json);
      std::vector<Device> devices = create_device_list(w.devices, w.device_maps, reverse);
      ordered_json reverse_json = ordered_json::object();
      for (const auto& [peer, map] : reverse) reverse_json[peer] = device_map_json(map);
      ordered_json devices_json = ordered_json::array();
      for (Device d : devices) devices_json.push_back(d.to_string());
      reverse_all[w.name] = std::move(reverse_json);
      devices_all[w.name] = std::move(devices_json);
    }
    out = {{"ok", true},
           {"reverse_device_maps", std::move(reverse_all)},
           {"devices", std::move(devices_all)},
           {"channels", std::move(channels_all)}};
    result.exit_code = kExitOk;
  }
  result.out = out.dump(2) + "\n";
  return result;
}

}  // namespace ferry::tools
