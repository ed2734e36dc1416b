// File: backends/kwargs.h
//
// A backend's keyword arguments as a table: each key, the type its value must have,
// and what it sets. One table gives the options constructor its parsing and its
// errors (an unknown key names the known ones; a value of the wrong type names the
// key and both types).
//
//   const KwargTable<MyOptions>& table() {
//     static const auto* t = new KwargTable<MyOptions>(
//         "MINE", {kwarg<MyOptions, int64_t>("threads", [](MyOptions& o, int64_t n) {
//                    o.threads = n;
//                    return absl::OkStatus();
//                  })},
//         /*device_kwargs=*/true);
//     return *t;
//   }
//   FERRY_RETURN_IF_ERROR(table().apply(kwargs, options));
//
// Options derived from AgentBackendOptions (backends/agent_backend_options.h) start
// their table with agent_kwargs<MyOptions>(), and construct_options() is a whole
// options constructor over a table.
#pragma once

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "backends/backend_registry.h"
#include "base/status.h"

namespace ferry {

// The name kwarg_type_name gives values of type T ("int64", "vector<string>", ...).
template <typename T>
const char* kwarg_type_name_of() {
  static const KwargValue sample{std::in_place_type<T>};
  return kwarg_type_name(sample);
}

// One key of a table: its name, its value's type, and how it sets Options.
template <typename Options>
struct KwargEntry {
  std::string key;
  const char* type = "";
  std::function<absl::Status(Options&, const KwargValue&)> apply;
  // For a deprecated spelling kept for a release: the key that replaces it.
  std::string deprecated_for = "";
};

// An entry for key `key` whose value must be a T; `set(options, value)` applies it and
// may refuse it with an error that says what was expected.
template <typename Options, typename T, typename Set>
KwargEntry<Options> kwarg(std::string key, Set set) {
  const char* type = kwarg_type_name_of<T>();
  return KwargEntry<Options>{std::move(key), type,
                             [set = std::move(set)](Options& options, const KwargValue& value) -> absl::Status {
                               return set(options, std::get<T>(value));
                             }};
}

// `entry`, marked as a deprecated spelling of `replacement`.
template <typename Options>
KwargEntry<Options> deprecated(KwargEntry<Options> entry, std::string replacement) {
  entry.deprecated_for = std::move(replacement);
  return entry;
}

// A backend's table. Immutable once built, so thread-safe.
template <typename Options>
class KwargTable {
 public:
  // `backend` names the backend in errors. With `device_kwargs`, the table also has
  // "device_maps" (DeviceMaps) and "devices" (vector<Device>), applied through
  // Options::set_device_map and Options::set_devices.
  KwargTable(std::string backend, std::vector<KwargEntry<Options>> entries, bool device_kwargs)
      : backend_(std::move(backend)), entries_(std::move(entries)) {
    if (device_kwargs) {
      entries_.push_back(kwarg<Options, DeviceMaps>("device_maps", [](Options& o, const DeviceMaps& maps) {
        for (const auto& [worker, map] : maps) FERRY_RETURN_IF_ERROR(o.set_device_map(worker, map));
        return absl::OkStatus();
      }));
      entries_.push_back(kwarg<Options, std::vector<Device>>("devices", [](Options& o, const std::vector<Device>& d) {
        return o.set_devices(std::vector<DeviceSpec>(d.begin(), d.end()));
      }));
    }
  }

  // Applies every keyword argument to `options`. Errors (kInvalidArgument): an unknown
  // key, a value of the wrong type, and what an entry refuses.
  absl::Status apply(const Kwargs& kwargs, Options& options) const {
    for (const auto& [key, value] : kwargs) {
      const KwargEntry<Options>* entry = find(key);
      if (entry == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(backend_, " backend has no option \"", key,
                                                       "\" (expected one of: ", known(), ")"));
      }
      if (kwarg_type_name(value) != std::string_view(entry->type)) {
        return absl::InvalidArgumentError(absl::StrCat(backend_, " option \"", key, "\" must be ", entry->type,
                                                       ", got ", kwarg_type_name(value)));
      }
      FERRY_RETURN_IF_ERROR(entry->apply(options, value));
    }
    return absl::OkStatus();
  }

  // "key (type), ...": for documentation and errors.
  std::string known() const {
    return absl::StrJoin(entries_, ", ", [](std::string* out, const KwargEntry<Options>& e) {
      absl::StrAppend(out, e.key, " (", e.type);
      if (!e.deprecated_for.empty()) absl::StrAppend(out, ", deprecated: use ", e.deprecated_for);
      absl::StrAppend(out, ")");
    });
  }

 private:
  const KwargEntry<Options>* find(const std::string& key) const {
    for (const KwargEntry<Options>& e : entries_) {
      if (e.key == key) return &e;
    }
    return nullptr;
  }

  std::string backend_;
  std::vector<KwargEntry<Options>> entries_;
};

// The keys of the settings every AgentBackendOptions has: num_worker_threads (int64),
// heartbeat_ms (int64), auth_token (string).
template <typename Options>
std::vector<KwargEntry<Options>> agent_kwargs() {
  return {
      kwarg<Options, int64_t>("num_worker_threads",
                              [](Options& o, int64_t n) {
                                // Clamped only to fit an int: validate() says what the range is.
                                o.num_worker_threads =
                                    static_cast<int>(std::clamp<int64_t>(n, -1, Options::kMaxWorkerThreads + 1));
                                return absl::OkStatus();
                              }),
      kwarg<Options, int64_t>("heartbeat_ms",
                              [](Options& o, int64_t ms) {
                                o.heartbeat = std::chrono::milliseconds(ms);
                                return absl::OkStatus();
                              }),
      kwarg<Options, std::string>("auth_token",
                                  [](Options& o, const std::string& token) {
                                    o.auth_token = token;
                                    return absl::OkStatus();
                                  }),
  };
}

// An options constructor over `table`: a default Options with `rpc_timeout` and
// `init_method`, the keyword arguments applied, then Options::validate().
template <typename Options>
absl::StatusOr<std::unique_ptr<RpcBackendOptions>> construct_options(const KwargTable<Options>& table,
                                                                     std::chrono::milliseconds rpc_timeout,
                                                                     const std::string& init_method,
                                                                     const Kwargs& kwargs) {
  auto options = std::make_unique<Options>();
  options->rpc_timeout = rpc_timeout;
  options->init_method = init_method;
  FERRY_RETURN_IF_ERROR(table.apply(kwargs, *options));
  FERRY_RETURN_IF_ERROR(options->validate());
  return options;
}

}  // namespace ferry
