// File: process_group/module.h
//
// The module-level process-group API of seed 004 (torch.distributed's), over ferry's
// ProcessGroup: one default group per process, made by init_process_group, named by
// WORLD, gone after destroy_process_group.
//
//   ferry::dist::InitProcessGroupOptions options;
//   options.init_method = "tcp://10.0.0.1:29500";
//   options.world_size = 4;
//   options.rank = rank;
//   FERRY_RETURN_IF_ERROR(ferry::dist::init_process_group(options));
//   FERRY_ASSIGN_OR_RETURN(int me, ferry::dist::get_rank());               // of WORLD
//   FERRY_ASSIGN_OR_RETURN(std::shared_ptr<ferry::ProcessGroup> world, ferry::dist::default_group());
//   FERRY_RETURN_IF_ERROR(world->all_reduce(tensor));
//   FERRY_RETURN_IF_ERROR(ferry::dist::destroy_process_group());
//
// Errors, as the seed's: initializing twice (kFailedPrecondition "trying to initialize
// the default process group twice"), a backend other than "gloo" (kInvalidArgument
// "Invalid distributed backend name: ..."), any use before init (kFailedPrecondition,
// naming the function, "... call init_process_group first").
//
// Thread-safe: every function may be called from any thread; init and destroy are
// serialized.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "process_group/process_group.h"
#include "store/store.h"

namespace ferry::dist {

struct InitProcessGroupOptions {
  // The only one ferry has (case-insensitive).
  std::string backend = "gloo";
  // Where the ranks meet (rendezvous/rendezvous.h: env://, tcp://, file://), unless
  // `store` is given. rank and world_size are added to the URL when set here.
  std::string init_method = "env://";
  // A store every rank shares; then rank and world_size are required.
  std::shared_ptr<Store> store;
  // -1: from the init_method (env:// reads RANK and WORLD_SIZE).
  int world_size = -1;
  int rank = -1;
  // The rendezvous's and the group's timeout (see ProcessGroup::create).
  std::chrono::milliseconds timeout = ProcessGroup::kDefaultTimeout;
  // Keeps this group's keys apart from other groups' on a shared store.
  std::string group_name;
};

// Makes the default group. Errors: initialized already, an invalid backend name, a
// store without rank and world size, a rank or world size other than the rendezvous
// gave, the rendezvous's and ProcessGroup::create's errors.
[[nodiscard]] absl::Status init_process_group(const InitProcessGroupOptions& options);
bool is_initialized();
// Shuts the default group down and forgets it (handles others still hold fail with
// kFailedPrecondition). kFailedPrecondition when there is none.
[[nodiscard]] absl::Status destroy_process_group();

// Names a group: WORLD (the default group, looked up at use) or a given one, which the
// caller keeps alive while the GroupRef is in use.
class GroupRef {
 public:
  // NOLINTNEXTLINE(google-explicit-constructor): a group stands for itself.
  GroupRef(const ProcessGroup& group) : group_(&group) {}
  static constexpr GroupRef world() { return GroupRef(); }
  bool is_world() const { return group_ == nullptr; }
  const ProcessGroup* group() const { return group_; }

 private:
  constexpr GroupRef() = default;
  const ProcessGroup* group_ = nullptr;
};
inline constexpr GroupRef WORLD = GroupRef::world();

// The default group itself (shared: it stays usable until destroy_process_group).
[[nodiscard]] absl::StatusOr<std::shared_ptr<ProcessGroup>> default_group();
// This process's rank in `group` (-1 for a sub-group it is not a member of), and the
// group's size. Errors: WORLD before init.
[[nodiscard]] absl::StatusOr<int> get_rank(GroupRef group = WORLD);
[[nodiscard]] absl::StatusOr<int> get_world_size(GroupRef group = WORLD);

}  // namespace ferry::dist
