#include "process_group/module.h"

#include <mutex>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "rendezvous/rendezvous.h"
#include "store/prefix_store.h"

namespace ferry::dist {
namespace {

struct DefaultGroup {
  std::mutex init_mu;  // one init or destroy at a time
  std::mutex mu;       // guards group
  std::shared_ptr<ProcessGroup> group;
};

DefaultGroup& state() {
  static DefaultGroup* s = new DefaultGroup();  // never destroyed: used until exit
  return *s;
}

std::shared_ptr<ProcessGroup> current() {
  std::lock_guard<std::mutex> lock(state().mu);
  return state().group;
}

absl::Status not_initialized(std::string_view function) {
  return absl::FailedPreconditionError(absl::StrCat(
      std::string(function), ": the default process group is not initialized; call init_process_group first"));
}

absl::StatusOr<const ProcessGroup*> resolve(GroupRef ref, std::string_view function,
                                            std::shared_ptr<ProcessGroup>& keep) {
  if (!ref.is_world()) return ref.group();
  keep = current();
  if (keep == nullptr) return not_initialized(function);
  return keep.get();
}

std::string with_query(const std::string& url, const char* key, int value) {
  if (value < 0 || absl::StrContains(url, absl::StrCat(key, "="))) return url;
  return absl::StrCat(url, absl::StrContains(url, "?") ? "&" : "?", key, "=", value);
}

}  // namespace

absl::Status init_process_group(const InitProcessGroupOptions& options) {
  DefaultGroup& s = state();
  std::lock_guard<std::mutex> init_lock(s.init_mu);
  if (current() != nullptr) {
    return absl::FailedPreconditionError(
        "init_process_group: trying to initialize the default process group twice (call destroy_process_group "
        "first)");
  }
  if (absl::AsciiStrToLower(options.backend) != "gloo") {
    return absl::InvalidArgumentError(absl::StrCat("Invalid distributed backend name: \"", options.backend,
                                                   "\" (ferry's process groups run on \"gloo\")"));
  }
  if (options.timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError(
        absl::StrCat("init_process_group: timeout ", options.timeout.count(), " ms must be positive"));
  }
  std::shared_ptr<Store> store = options.store;
  int rank = options.rank;
  int world_size = options.world_size;
  if (store != nullptr) {
    if (rank < 0 || world_size < 1) {
      return absl::InvalidArgumentError(absl::StrCat(
          "init_process_group: with a store, rank and world_size are required (got rank ", rank, ", world_size ",
          world_size, ")"));
    }
  } else {
    std::string url = with_query(with_query(options.init_method, "rank", rank), "world_size", world_size);
    FERRY_ASSIGN_OR_RETURN(RendezvousResult r, rendezvous(url, options.timeout));
    if ((rank >= 0 && r.rank != rank) || (world_size >= 0 && r.world_size != world_size)) {
      return absl::InvalidArgumentError(absl::StrCat("init_process_group: rendezvous through ", options.init_method,
                                                     " gave rank ", r.rank, " of ", r.world_size,
                                                     ", but rank ", rank, " of ", world_size, " was asked for"));
    }
    store = std::move(r.store);
    rank = r.rank;
    world_size = r.world_size;
  }
  if (!options.group_name.empty()) {
    store = std::make_shared<PrefixStore>(absl::StrCat("ferry/group/", options.group_name), std::move(store));
  }
  FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> group,
                         ProcessGroup::create(std::move(store), rank, world_size, options.timeout));
  std::lock_guard<std::mutex> lock(s.mu);
  s.group = std::move(group);
  return absl::OkStatus();
}

bool is_initialized() { return current() != nullptr; }

absl::Status destroy_process_group() {
  DefaultGroup& s = state();
  std::lock_guard<std::mutex> init_lock(s.init_mu);
  std::shared_ptr<ProcessGroup> group;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    group.swap(s.group);
  }
  if (group == nullptr) return not_initialized("destroy_process_group");
  group->shutdown();
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<ProcessGroup>> default_group() {
  std::shared_ptr<ProcessGroup> group = current();
  if (group == nullptr) return not_initialized("default_group");
  return group;
}

absl::StatusOr<int> get_rank(GroupRef group) {
  std::shared_ptr<ProcessGroup> keep;
  FERRY_ASSIGN_OR_RETURN(const ProcessGroup* g, resolve(group, "get_rank", keep));
  return g->rank();
}

absl::StatusOr<int> get_world_size(GroupRef group) {
  std::shared_ptr<ProcessGroup> keep;
  FERRY_ASSIGN_OR_RETURN(const ProcessGroup* g, resolve(group, "get_world_size", keep));
  return g->world_size();
}

}  // namespace ferry::dist
