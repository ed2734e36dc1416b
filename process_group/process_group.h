// File: process_group/process_group.h
//
// ProcessGroup: collectives (broadcast, all_reduce, reduce, all_gather, gather,
// scatter, barrier) and point-to-point messages (send, recv, isend, irecv) between the
// ranks of a job, over Gloo's TCP transport. The ranks rendezvous through a Store.
// CUDA tensors are staged through host memory (this Gloo has no CUDA).
//
//   // Every rank, with the same store, its own rank and the same world size:
//   FERRY_ASSIGN_OR_RETURN(std::unique_ptr<ferry::ProcessGroup> group,
//                          ferry::ProcessGroup::create(store, rank, world_size));
//   FERRY_RETURN_IF_ERROR(group->all_reduce(tensor, ferry::ReduceOp::kSum));
//   FERRY_ASSIGN_OR_RETURN(std::vector<std::string> names,
//                          group->all_gather_object(std::string("worker") + std::to_string(rank)));
//   FERRY_RETURN_IF_ERROR(group->barrier());
//
// Contract, as in torch.distributed: every rank of a group calls the same collectives
// in the same order with matching arguments. Arguments that do not match across ranks
// (shapes, dtypes, roots, reduce ops, the collective itself) are detected: every rank
// fails with the same message naming both ranks, e.g. "all_reduce: tensor shape [4] on
// rank 1 differs from [3] on rank 0". The check overlaps the data: ranks whose
// arguments differ never exchange data with each other, but the output tensors of a
// collective that failed this way hold unspecified values.
//
// Errors: a rank that dies or disconnects makes the others' pending and later
// operations fail (kUnavailable, or kDeadlineExceeded when nothing arrives within the
// group timeout). After such a transport error the group is broken, as Gloo's
// transport pairs are: every later operation fails at once with the same error; make
// a new group to go on.
//
// Serialized values: all_gather_object<T> takes any T that ferry's payload archive can
// serialize (include serialization/types.h, or the cereal/types/ headers T needs, e.g.
// <cereal/types/string.hpp>) and that is default-constructible; CPU tensors inside it
// travel inline. A peer's bytes are decoded by the bounded reader: a hostile or
// mismatched value fails with kDataLoss naming the rank, and never allocates more
// than its bytes can hold.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <cstddef>
#include <exception>
#include <tuple>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "process_group/work.h"
#include "serialization/archive.h"
#include "serialization/message.h"
#include "store/store.h"
#include "tensor/tensor.h"

namespace ferry {

// The element-wise reductions. For bool tensors only kMin (logical and) and kMax
// (logical or) are defined; kSum and kProduct on bool are kInvalidArgument.
enum class ReduceOp : uint8_t { kSum = 0, kProduct = 1, kMin = 2, kMax = 3 };
// "sum", "product", "min", "max".
const char* reduce_op_name(ReduceOp op);

// Where this rank listens for its peers. The first that is set wins: `interface`, then
// `address`, then the environment variable FERRY_SOCKET_IFNAME, then the address the
// host name resolves to. A named interface that does not exist, or has no IPv4/IPv6
// address, is an error: there is no silent fall-back to loopback, which would split a
// multi-host group. For a group whose ranks all run on this host, "lo" (127.0.0.1).
struct ProcessGroupOptions {
  // A network interface name, e.g. "eth0" or "lo".
  std::string interface;
  // A host name or numeric address of this host to bind, e.g. "10.0.0.7".
  std::string address;
};

// A group of ranks that run collectives together. Thread-safe: any method may be
// called from any thread; collectives from several threads must still reach every
// rank in the same order, so a program usually issues them from one thread.
//
// Ownership: the group shares ownership of its store. Asynchronous operations hold
// their tensors' storage (Tensor copies share it) until they complete; the caller
// must not read or write those tensors until then.
//
// Threads: collectives run one at a time, in call order, on the group's own worker
// thread (Gloo operations on one context must not interleave). Pending isend/irecv
// wait on a pool of at most 64 threads: their messages are posted at once, but at most
// 64 wait at a time and the rest in the order they were posted, so operations that can
// complete only after more than 64 later-posted ones (e.g. 65 irecvs posted before
// the blocking sends they need, sent in reverse) wait until the group's timeout.
// send/recv run on the caller's thread. No user code runs on these threads except
// Work callbacks.
//
// Destruction shuts the group down (see shutdown()).
class ProcessGroup {
 public:
  // Gloo's own default; every blocking step (rendezvous, a collective, a receive)
  // fails when it makes no progress for this long.
  static constexpr std::chrono::milliseconds kDefaultTimeout{std::chrono::seconds(30)};

  // Connects `rank` to the other `world_size - 1` ranks through `store`, where every
  // rank calls create() with the same world size. Blocks until all have connected,
  // or fails after `timeout` (kDeadlineExceeded; also what two processes given the
  // same rank get). Errors: a rank out of range, a world size < 1, or a world size
  // that differs from the first rank's (kInvalidArgument), an interface that cannot be
  // used (see ProcessGroupOptions), a store error.
  //
  // The first create() in a process ignores SIGPIPE (unless the program installed a
  // handler): Gloo's socket writes would otherwise kill the process when a peer dies.
  //
  // Several groups may share one store when every rank creates them in the same
  // order: each rank numbers the groups it creates on a store, and the n-th group of
  // every rank meets under its own key prefix.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> create(std::shared_ptr<Store> store, int rank,
                                                              int world_size,
                                                              std::chrono::milliseconds timeout = kDefaultTimeout,
                                                              const ProcessGroupOptions& options = {});

  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  // This process's rank in the group, or -1 when it is not a member (a handle that
  // new_group() returns to the ranks it leaves out, as torch.distributed does).
  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  bool is_member() const { return rank_ >= 0; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // For a group made by new_group(): the parent's ranks that form it, in group-rank
  // order. For a group made by create(): 0 .. world_size - 1.
  const std::vector<int>& ranks() const { return ranks_; }

  // Every collective has an asynchronous form (`*_async`, returning a Work) and a
  // blocking form (returning the same status the Work would). Tensors may live on the
  // CPU or a CUDA device; tensors of every dtype move, and reductions support every
  // dtype except as ReduceOp says.

  // Copies `tensor` on rank `src` into `tensor` on every other rank. Shapes and dtypes
  // must match across ranks.
  Work broadcast_async(Tensor tensor, int src);
  absl::Status broadcast(Tensor tensor, int src);

  // Reduces `tensor` element-wise across ranks, in place, leaving the result on every
  // rank.
  Work all_reduce_async(Tensor tensor, ReduceOp op = ReduceOp::kSum);
  absl::Status all_reduce(Tensor tensor, ReduceOp op = ReduceOp::kSum);

  // Like all_reduce, but only rank `dst` receives the result; the other ranks'
  // tensors are left unchanged.
  Work reduce_async(Tensor tensor, int dst, ReduceOp op = ReduceOp::kSum);
  absl::Status reduce(Tensor tensor, int dst, ReduceOp op = ReduceOp::kSum);

  // outputs[r] receives rank r's `input`; `outputs` holds world_size() tensors of
  // input's shape and dtype.
  Work all_gather_async(std::vector<Tensor> outputs, Tensor input);
  absl::Status all_gather(std::vector<Tensor> outputs, Tensor input);
  // The same into one tensor of world_size() * input.numel() elements (any shape),
  // rank r's input at element offset r * input.numel(): no per-rank copies.
  Work all_gather_into_tensor_async(Tensor output, Tensor input);
  absl::Status all_gather_into_tensor(Tensor output, Tensor input);

  // gather_list[r] on rank `dst` receives rank r's `input`. gather_list is required on
  // `dst` (world_size() tensors shaped like input) and must be empty elsewhere.
  Work gather_async(Tensor input, std::vector<Tensor> gather_list, int dst);
  absl::Status gather(Tensor input, std::vector<Tensor> gather_list, int dst);

  // `output` on rank r receives scatter_list[r] of rank `src`. scatter_list is required
  // on `src` (world_size() tensors shaped like output) and must be empty elsewhere.
  Work scatter_async(Tensor output, std::vector<Tensor> scatter_list, int src);
  absl::Status scatter(Tensor output, std::vector<Tensor> scatter_list, int src);

  // Completes on a rank once every rank of the group has entered it.
  Work barrier_async();
  absl::Status barrier();

  // Point-to-point: `tensor` goes to rank `dst`, which receives it with a matching
  // recv (same tag). A send completes once the receiver has taken the data. Messages
  // between two ranks with the same tag arrive in the order they were sent. The
  // receiver's tensor must have the sender's dtype and shape; on a mismatch the
  // receive fails (kInvalidArgument, naming both) and the message is consumed (drained
  // through 1 MiB; one over FERRY_MAX_MESSAGE_BYTES is refused with
  // kResourceExhausted and left untaken, so the sender's wait ends at its timeout).
  // A pending send or receive that times out breaks the group (Gloo closes its pairs).
  Work isend(Tensor tensor, int dst, uint32_t tag = 0);
  absl::Status send(Tensor tensor, int dst, uint32_t tag = 0);
  // Receives into `tensor` from rank `src`, or from any other rank when src is empty;
  // the Work's source_rank() (or recv's value) is the sender.
  Work irecv(Tensor tensor, std::optional<int> src = std::nullopt, uint32_t tag = 0);
  absl::StatusOr<int> recv(Tensor tensor, std::optional<int> src = std::nullopt, uint32_t tag = 0);

  // Byte messages of any size (0 included) between two ranks, apart from the tensor
  // messages above: `data` goes to rank `dst`, where a recv_bytes with the same tag
  // takes it. send_bytes returns once the receiver has taken the data; messages from
  // one sender thread to one rank with one tag arrive in order. Up to 64 KiB travel
  // in one Gloo message with their header; larger ones take one round trip more and
  // are never copied on the sending side.
  //
  // `timeout` bounds the wait (default: the group's). As in Gloo, a wait that times
  // out breaks the whole group (Gloo closes every connection); pass kWaitIndefinitely
  // for a receiver that may legitimately sit idle. A peer whose connection is lost
  // fails only the operations with that peer (kUnavailable), unlike the collectives;
  // a receive from any source is not failed by the loss of one peer (Gloo does not
  // tell it), so receive from each peer when losses must be noticed at once.
  // Errors: kInvalidArgument (dst/src out of range or this rank), kFailedPrecondition
  // (shut down, broken, not a member), kCancelled (shut down while waiting),
  // kUnavailable (the peer's connection failed), kDeadlineExceeded,
  // kResourceExhausted (a message over FERRY_MAX_MESSAGE_BYTES: a sender refuses to
  // send it; a receiver refuses one a peer announces, without taking its data).
  static constexpr std::chrono::milliseconds kWaitIndefinitely{std::chrono::hours(24 * 365)};
  struct ReceivedBytes {
    int source_rank = -1;
    Bytes data;
  };
  absl::Status send_bytes(const Bytes& data, int dst, uint32_t tag = 0,
                          std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // Like send_bytes, for a sender that must be able to give up on a peer that stopped
  // reading: the group shares `data` (data over 64 KiB is never copied), so Gloo may go on
  // sending it after this returns. cancel_sends(dst) ends the wait of every such send
  // to `dst` at once with kUnavailable (saying `why`) and without breaking the group,
  // as a Gloo timeout would; the message stays posted, and goes if `dst` takes it later.
  // Sends of the other overload are not cancelled. Thread-safe.
  absl::Status send_bytes(std::shared_ptr<const Bytes> data, int dst, uint32_t tag = 0,
                          std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  void cancel_sends(int dst, std::string_view why);
  // From rank `src`, or from any other rank when src is empty (source_rank says which).
  absl::StatusOr<ReceivedBytes> recv_bytes(std::optional<int> src = std::nullopt, uint32_t tag = 0,
                                           std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // Like recv_bytes from `src`, for a thread that takes everything `src` sends on
  // `tag`: from the first call on, a few receives stay posted for (src, tag), so
  // back-to-back messages land without waiting for this thread to post the next
  // receive (no round trip per message). Messages from `src` on `tag` then go to
  // recv_bytes_stream only, never to recv_bytes. Same errors as recv_bytes.
  absl::StatusOr<ReceivedBytes> recv_bytes_stream(int src, uint32_t tag = 0,
                                                  std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  // Every rank's `data`, in rank order; sizes may differ by rank (and may be 0). A
  // total over any rank's FERRY_MAX_MESSAGE_BYTES fails on every rank
  // (kResourceExhausted, naming it) before anything is allocated.
  // Blocking, like every collective: queued behind earlier asynchronous ones.
  absl::StatusOr<std::vector<Bytes>> all_gather_bytes(const Bytes& data);

  // Every rank's `value`, in rank order, through cereal binary archives. A value that
  // cannot be serialized fails on every rank (kInvalidArgument); bytes that do not
  // deserialize as T fail with kDataLoss naming the rank they came from.
  template <typename T>
  absl::StatusOr<std::vector<T>> all_gather_object(const T& value);

  // Makes a sub-group of the given ranks of this group (group rank i is ranks[i]).
  // Every rank of this group must call new_group, members or not, in the same order
  // and with the same ranks (checked: a mismatch fails on every rank). A rank not in
  // `ranks` gets a handle that is not a member: each of its operations fails with
  // kFailedPrecondition. Errors: empty ranks, duplicates, a rank out of range
  // (kInvalidArgument). The sub-group's timeout defaults to this group's.
  absl::StatusOr<std::unique_ptr<ProcessGroup>> new_group(
      const std::vector<int>& ranks, std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  // Stops the group: collectives queued but not started complete with kCancelled,
  // pending isend/irecv are aborted (kCancelled), a collective already running is
  // allowed to finish (it is bounded by the timeout), then the connections close and
  // every later operation fails with kFailedPrecondition. Peers still using the group
  // see their connection lost. Idempotent; the destructor calls it.
  void shutdown();

 private:
  class Impl;

  ProcessGroup(std::shared_ptr<Store> store, std::string prefix, int rank, int world_size,
               std::chrono::milliseconds timeout, std::vector<int> ranks);

  // all_gather_bytes, where a rank whose local step failed (`local_error` not OK)
  // still takes part, so that every rank fails together instead of waiting for it.
  absl::StatusOr<std::vector<Bytes>> all_gather_bytes_internal(const Bytes& data, const absl::Status& local_error,
                                                               std::string_view op_name);

  std::shared_ptr<Store> store_;
  // The key prefix this group's rendezvous used; sub-groups nest under it.
  std::string prefix_;
  int rank_;
  int world_size_;
  std::chrono::milliseconds timeout_;
  std::vector<int> ranks_;
  // Numbers this group's new_group() calls, which every rank makes in the same order.
  std::atomic<int64_t> next_group_id_{0};
  // Null for a non-member handle.
  std::shared_ptr<Impl> impl_;
};

template <typename T>
absl::StatusOr<std::vector<T>> ProcessGroup::all_gather_object(const T& value) {
  // Encoded with ferry's payload archive, whose reader checks every length against the
  // bytes present: a peer's bytes can fail to decode, never make this rank allocate
  // what they merely claim.
  Bytes bytes;
  absl::Status local = absl::OkStatus();
  try {
    Message m;
    {
      PayloadWriter writer(m, /*inline_threshold=*/SIZE_MAX);
      writer(value);
    }
    if (!m.tensors().empty()) {
      local = absl::InvalidArgumentError(
          "all_gather_object: the value holds a tensor that is not on the CPU; move it to the CPU first");
    } else {
      std::string_view payload = m.payload();
      bytes.assign(payload.begin(), payload.end());
    }
  } catch (const std::exception& e) {
    local = absl::InvalidArgumentError(absl::StrCat("all_gather_object: serializing the value failed: ", e.what()));
  }
  absl::StatusOr<std::vector<Bytes>> all = all_gather_bytes_internal(bytes, local, "all_gather_object");
  if (!all.ok()) return all.status();
  std::vector<T> out;
  out.reserve(all->size());
  for (size_t r = 0; r < all->size(); ++r) {
    const Bytes& b = (*all)[r];
    Message m;
    m.buffer().append(b.begin(), b.end());
    absl::StatusOr<std::tuple<T>> v = read_payload<T>(m, "the value");
    if (!v.ok()) {
      return absl::DataLossError(absl::StrCat("all_gather_object: the ", b.size(), " bytes from rank ", r,
                                              " do not deserialize as the requested type: ", v.status().message()));
    }
    out.push_back(std::move(std::get<0>(*v)));
  }
  return out;
}

}  // namespace ferry
