#include "agents/core/registry.h"

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "agents/core/transport_set.h"
#include "base/status.h"

namespace ferry {
namespace {

class Registry {
 public:
  absl::Status add(TransportEntry entry) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    for (const std::string& name : entry.names) {
      if (find(name) != nullptr) {
        return absl::AlreadyExistsError(absl::StrCat("transport \"", name, "\": already registered"));
      }
    }
    auto shared = std::make_shared<const TransportEntry>(std::move(entry));
    // Stable: equal ranks keep the order they registered in.
    auto at = std::upper_bound(entries_.begin(), entries_.end(), shared->rank,
                               [](int rank, const std::shared_ptr<const TransportEntry>& e) { return rank < e->rank; });
    entries_.insert(at, std::move(shared));
    return absl::OkStatus();
  }

  // A copy, so that makers run without the lock (a maker may register, or take long).
  std::vector<std::shared_ptr<const TransportEntry>> entries() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return entries_;
  }

 private:
  const TransportEntry* find(std::string_view name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (const auto& e : entries_) {
      if (std::find(e->names.begin(), e->names.end(), name) != e->names.end()) return e.get();
    }
    return nullptr;
  }

  mutable absl::Mutex mu_;
  // By rank. Entries are immutable once registered and never removed.
  std::vector<std::shared_ptr<const TransportEntry>> entries_ ABSL_GUARDED_BY(mu_);
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: agents may outlive static destruction
  return *r;
}

using Entries = std::vector<std::shared_ptr<const TransportEntry>>;

std::string all_names(const Entries& entries) {
  std::vector<std::string> names;
  for (const auto& e : entries) names.insert(names.end(), e->names.begin(), e->names.end());
  return names.empty() ? std::string("none") : absl::StrJoin(names, ", ");
}

bool contains(const std::vector<std::string>& names, std::string_view name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

bool well_formed(const std::string& name) {
  if (name.empty()) return false;
  for (char c : name) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '_' && c != '-') return false;
  }
  return true;
}

absl::Status check_entry(const TransportEntry& entry) {
  if (entry.names.empty()) return absl::InvalidArgumentError("a transport must have at least one name");
  for (size_t i = 0; i < entry.names.size(); ++i) {
    const std::string& name = entry.names[i];
    if (!well_formed(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("transport name \"", name, "\" is not valid (expected letters, digits, '_' or '-')"));
    }
    if (std::find(entry.names.begin(), entry.names.begin() + i, name) != entry.names.begin() + i) {
      return absl::InvalidArgumentError(absl::StrCat("transport \"", name, "\" is named twice in one entry"));
    }
  }
  const std::string who = absl::StrCat("transport \"", absl::StrJoin(entry.names, ","), "\"");
  for (const std::string& name : entry.same_host_names) {
    if (!contains(entry.names, name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": same-host name \"", name, "\" is not one of its names"));
    }
  }
  for (const std::string& name : entry.other_host_names) {
    if (!contains(entry.names, name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": other-host name \"", name, "\" is not one of its names"));
    }
  }
  if (!entry.reaches) return absl::InvalidArgumentError(absl::StrCat(who, ": no reaches function"));
  if (!entry.make) return absl::InvalidArgumentError(absl::StrCat(who, ": no maker"));
  return absl::OkStatus();
}

// One chosen entry and its chosen names (in the entry's order).
struct Chosen {
  std::shared_ptr<const TransportEntry> entry;
  std::vector<std::string> names;
};
struct Choice {
  std::vector<Chosen> parts;  // by rank
  bool listed = false;
};

// The list given, else FERRY_TRANSPORTS; unset for the defaults. `source` names it in
// errors.
absl::StatusOr<std::optional<std::vector<std::string>>> asked_for(const std::optional<std::vector<std::string>>& given,
                                                                  std::string& source) {
  source = "transports";
  if (given) return given;
  const char* env = std::getenv("FERRY_TRANSPORTS");
  if (env == nullptr || *env == '\0') return std::optional<std::vector<std::string>>();
  source = absl::StrCat("FERRY_TRANSPORTS=\"", env, "\"");
  std::vector<std::string> names = absl::StrSplit(env, ',', absl::SkipWhitespace());
  for (std::string& name : names) name = std::string(absl::StripAsciiWhitespace(name));
  return std::optional<std::vector<std::string>>(std::move(names));
}

absl::StatusOr<Choice> choose(const Entries& entries, const std::optional<std::vector<std::string>>& given) {
  std::string source;
  FERRY_ASSIGN_OR_RETURN(std::optional<std::vector<std::string>> asked, asked_for(given, source));
  Choice choice;
  if (!asked) {
    bool same_host_served = false;
    bool other_hosts_served = false;
    for (const auto& e : entries) {
      if (!e->by_default) continue;
      Chosen c{e, {}};
      for (const std::string& name : e->names) {
        if (same_host_served && contains(e->same_host_names, name)) continue;
        if (other_hosts_served && contains(e->other_host_names, name)) continue;
        c.names.push_back(name);
      }
      if (!e->same_host_names.empty()) same_host_served = true;
      if (!e->other_host_names.empty()) other_hosts_served = true;
      if (!c.names.empty()) choice.parts.push_back(std::move(c));
    }
    if (choice.parts.empty()) {
      return absl::FailedPreconditionError(absl::StrCat("no transport is registered as a default (registered: ",
                                                        all_names(entries), "); list some in `transports`"));
    }
    return choice;
  }
  choice.listed = true;
  if (asked->empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source, " names no transport (expected some of: ", all_names(entries), ")"));
  }
  for (size_t i = 0; i < asked->size(); ++i) {
    const std::string& name = (*asked)[i];
    if (std::find(asked->begin(), asked->begin() + i, name) != asked->begin() + i) {
      return absl::InvalidArgumentError(absl::StrCat(source, " lists transport \"", name, "\" twice"));
    }
    bool known = false;
    for (const auto& e : entries) known = known || contains(e->names, name);
    if (!known) {
      return absl::InvalidArgumentError(absl::StrCat(source, ": unknown transport \"", name,
                                                     "\" (registered: ", all_names(entries), ")"));
    }
  }
  for (const auto& e : entries) {
    Chosen c{e, {}};
    for (const std::string& name : e->names) {
      if (contains(*asked, name)) c.names.push_back(name);
    }
    if (!c.names.empty()) choice.parts.push_back(std::move(c));
  }
  return choice;
}

TransportArgs args_for(const TransportArgs& args, const Chosen& c, bool listed) {
  TransportArgs mine = args;
  mine.names = c.names;
  mine.listed = listed;
  return mine;
}

}  // namespace

absl::Status register_transport(TransportEntry entry) {
  FERRY_RETURN_IF_ERROR(check_entry(entry));
  return registry().add(std::move(entry));
}

bool transport_registered(std::string_view name) {
  for (const auto& e : registry().entries()) {
    if (contains(e->names, name)) return true;
  }
  return false;
}

std::vector<std::string> registered_transports() {
  std::vector<std::string> names;
  for (const auto& e : registry().entries()) names.insert(names.end(), e->names.begin(), e->names.end());
  return names;
}

absl::StatusOr<std::vector<std::string>> chosen_transports(const std::optional<std::vector<std::string>>& listed) {
  FERRY_ASSIGN_OR_RETURN(Choice choice, choose(registry().entries(), listed));
  std::vector<std::string> names;
  for (const Chosen& c : choice.parts) names.insert(names.end(), c.names.begin(), c.names.end());
  return names;
}

absl::Status check_transports(const std::optional<std::vector<std::string>>& listed, const TransportArgs& args) {
  FERRY_ASSIGN_OR_RETURN(Choice choice, choose(registry().entries(), listed));
  for (const Chosen& c : choice.parts) {
    if (c.entry->check) FERRY_RETURN_IF_ERROR(c.entry->check(args_for(args, c, choice.listed)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Transport>> make_transport(const std::optional<std::vector<std::string>>& listed,
                                                          TransportArgs args) {
  FERRY_ASSIGN_OR_RETURN(Choice choice, choose(registry().entries(), listed));
  std::vector<std::unique_ptr<Transport>> parts;
  std::vector<TransportReaches> judges;
  for (const Chosen& c : choice.parts) {
    absl::StatusOr<std::unique_ptr<Transport>> made = c.entry->make(args_for(args, c, choice.listed));
    if (!made.ok()) {
      return absl::Status(made.status().code(), absl::StrCat("transport \"", absl::StrJoin(c.names, ","),
                                                             "\": ", made.status().message()));
    }
    if (*made == nullptr) {
      return absl::InternalError(absl::StrCat("transport \"", absl::StrJoin(c.names, ","), "\": its maker made none"));
    }
    parts.push_back(*std::move(made));
    judges.push_back(c.entry->reaches);
  }
  if (parts.size() == 1) return std::move(parts.front());
  return std::make_unique<TransportSet>(std::move(parts), std::move(judges));
}

}  // namespace ferry
