#include "process_group/process_group.h"

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "gloo/transport/tcp/device.h"
#include "process_group/internal/group_impl.h"
#include "process_group/internal/interface.h"
#include "store/prefix_store.h"

namespace ferry {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProduct: return "product";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
  }
  return "unknown";
}

// ---- creation ----------------------------------------------------------------------

ProcessGroup::ProcessGroup(std::shared_ptr<Store> store, std::string prefix, int rank, int world_size,
                           std::chrono::milliseconds timeout, std::vector<int> ranks)
    : store_(std::move(store)), prefix_(std::move(prefix)), rank_(rank), world_size_(world_size),
      timeout_(timeout), ranks_(std::move(ranks)) {}

ProcessGroup::~ProcessGroup() { shutdown(); }

void ProcessGroup::shutdown() {
  if (impl_) impl_->shutdown();
}

namespace {

// Checks the world size against the first rank's, so a disagreeing world size fails
// at once with a clear message instead of a rendezvous that times out.
absl::Status check_world_size(Store& store, const std::string& prefix, int rank, int world_size) {
  const std::string mine = std::to_string(world_size);
  FERRY_ASSIGN_OR_RETURN(Bytes agreed, store.compare_set(absl::StrCat(prefix, "/world_size"), Bytes{}, to_bytes(mine)));
  if (to_string(agreed) != mine) {
    return absl::InvalidArgumentError(absl::StrCat("process group: world size ", world_size, " on rank ", rank,
                                                   " differs from ", to_string(agreed),
                                                   " given by the first rank to arrive"));
  }
  return absl::OkStatus();
}

// Gloo writes to its sockets without MSG_NOSIGNAL: a write to a peer that just died
// would kill this process with SIGPIPE instead of failing the operation. Ignored once,
// unless the program installed a handler of its own.
void ignore_sigpipe() {
  static const bool done = [] {
    struct sigaction current {};
    if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) signal(SIGPIPE, SIG_IGN);
    return true;
  }();
  (void)done;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::create(std::shared_ptr<Store> store, int rank,
                                                                   int world_size, std::chrono::milliseconds timeout,
                                                                   const ProcessGroupOptions& options) {
  if (store == nullptr) return absl::InvalidArgumentError("process group: the store is null");
  if (world_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("process group: world size ", world_size, " must be at least 1"));
  }
  if (rank < 0 || rank >= world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("process group: rank ", rank, " is out of range for world size ", world_size));
  }
  if (timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError(absl::StrCat("process group: timeout ", timeout.count(), " ms must be positive"));
  }
  FERRY_ASSIGN_OR_RETURN(internal::ListenAddress bind,
                         internal::resolve_bind_address(options, std::getenv("FERRY_SOCKET_IFNAME")));
  ignore_sigpipe();

  // Each rank numbers the groups it makes on this store; the n-th groups of all ranks
  // meet under the same prefix (see the contract in the header).
  FERRY_ASSIGN_OR_RETURN(int64_t generation, store->add(absl::StrCat("ferry/process_group/count/rank_", rank), 1));
  std::string prefix = absl::StrCat("ferry/process_group/", generation);
  FERRY_RETURN_IF_ERROR(check_world_size(*store, prefix, rank, world_size));

  std::shared_ptr<gloo::transport::Device> device;
  FERRY_RETURN_IF_ERROR(catch_gloo("process group: opening the transport", bind.source, [&] {
    gloo::transport::tcp::attr attr;
    attr.hostname = bind.host;
    device = gloo::transport::tcp::CreateDevice(attr);
    return absl::OkStatus();
  }));
  FERRY_LOG(INFO) << "process group rank " << rank << " of " << world_size << " listens on " << bind.host << " ("
                  << bind.source << ")";

  std::vector<int> ranks(world_size);
  for (int i = 0; i < world_size; ++i) ranks[i] = i;
  std::unique_ptr<ProcessGroup> group(new ProcessGroup(store, prefix, rank, world_size, timeout, std::move(ranks)));
  auto impl = std::make_shared<Impl>(rank, world_size, timeout, std::move(device));
  FERRY_RETURN_IF_ERROR(impl->connect(std::make_shared<PrefixStore>(prefix + "/gloo", store)));
  group->impl_ = std::move(impl);
  return group;
}

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::new_group(
    const std::vector<int>& ranks, std::optional<std::chrono::milliseconds> timeout) {
  if (!is_member()) {
    return absl::FailedPreconditionError(absl::StrCat("new_group: this process is not a member of the group ",
                                                      ranks_string(ranks_), "; only members can make sub-groups"));
  }
  FERRY_RETURN_IF_ERROR(impl_->usable("new_group"));
  const int64_t id = next_group_id_.fetch_add(1);
  absl::Status local = absl::OkStatus();
  std::set<int> seen;
  if (ranks.empty()) local = absl::InvalidArgumentError("new_group: the list of ranks is empty");
  for (int r : ranks) {
    if (!local.ok()) break;
    if (r < 0 || r >= world_size_) {
      local = absl::InvalidArgumentError(absl::StrCat("new_group: rank ", r, " in ", ranks_string(ranks),
                                                      " is out of range for a group of ", world_size_, " ranks"));
    } else if (!seen.insert(r).second) {
      local = absl::InvalidArgumentError(absl::StrCat("new_group: rank ", r, " appears twice in ", ranks_string(ranks)));
    }
  }
  if (timeout.has_value() && *timeout <= std::chrono::milliseconds::zero()) {
    local = absl::InvalidArgumentError(absl::StrCat("new_group: timeout ", timeout->count(), " ms must be positive"));
  }
  // Every rank must ask for the same sub-group: compare the lists (this also waits
  // until every rank of this group has called new_group).
  Bytes mine;
  for (int r : ranks) {
    const auto u = static_cast<uint32_t>(r);
    for (int i = 0; i < 4; ++i) mine.push_back(static_cast<uint8_t>(u >> (8 * i)));
  }
  FERRY_ASSIGN_OR_RETURN(std::vector<Bytes> all, all_gather_bytes_internal(mine, local, "new_group"));
  auto decode = [](const Bytes& b) {
    std::vector<int> out;
    for (size_t i = 0; i + 4 <= b.size(); i += 4) {
      uint32_t u = 0;
      for (int k = 0; k < 4; ++k) u |= static_cast<uint32_t>(b[i + k]) << (8 * k);
      out.push_back(static_cast<int>(u));
    }
    return out;
  };
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) {
      return absl::InvalidArgumentError(absl::StrCat("new_group: ranks ", ranks_string(decode(all[r])), " on rank ", r,
                                                     " differ from ", ranks_string(decode(all[0])), " on rank 0"));
    }
  }

  std::vector<int> parent_ranks;
  for (int r : ranks) parent_ranks.push_back(ranks_[r]);
  const std::chrono::milliseconds sub_timeout = timeout.value_or(timeout_);
  std::string prefix = absl::StrCat(prefix_, "/sub", id);
  auto it = std::find(ranks.begin(), ranks.end(), rank_);
  if (it == ranks.end()) {
    return std::unique_ptr<ProcessGroup>(new ProcessGroup(store_, std::move(prefix), -1,
                                                          static_cast<int>(ranks.size()), sub_timeout,
                                                          std::move(parent_ranks)));
  }
  const int sub_rank = static_cast<int>(it - ranks.begin());
  std::unique_ptr<ProcessGroup> group(new ProcessGroup(store_, prefix, sub_rank, static_cast<int>(ranks.size()),
                                                       sub_timeout, std::move(parent_ranks)));
  // Sub-groups share the parent's transport device (one event loop thread).
  auto impl = std::make_shared<Impl>(sub_rank, static_cast<int>(ranks.size()), sub_timeout, impl_->device());
  FERRY_RETURN_IF_ERROR(impl->connect(std::make_shared<PrefixStore>(prefix + "/gloo", store_)));
  group->impl_ = std::move(impl);
  return group;
}

}  // namespace ferry
