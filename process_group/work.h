// File: process_group/work.h
//
// Work: the handle of one asynchronous process-group operation (a collective, an
// isend or an irecv). It completes exactly once, with OK or an error; waiting on it
// any number of times returns that same status.
//
//   ferry::Work work = group->all_reduce_async(tensor, ferry::ReduceOp::kSum);
//   ...                                   // overlap other work with the all-reduce
//   FERRY_RETURN_IF_ERROR(work.wait());   // tensor now holds the sum of every rank's
//
// Completion can also be awaited by callback or Future (see future()):
//
//   work.add_callback([](const absl::Status& s) { if (!s.ok()) FERRY_LOG(WARNING) << s; });
//
// A Work shares the operation's state: copies of it are handles to the same
// operation, and dropping every copy does not cancel the operation (it still runs, in
// order, on every rank).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "base/future.h"

namespace ferry {

namespace internal {
class WorkState;
}  // namespace internal

// Thread-safe: any thread may wait on or poll a Work, several at once.
class Work {
 public:
  // Waits until the operation completes and returns its status. With a timeout,
  // returns kDeadlineExceeded if it has not completed by then; the operation itself
  // goes on (it is bounded by its group's timeout, which is what fails it when a peer
  // is lost). Without one, waits for completion, which the group's timeout bounds.
  //
  // Completion codes: kInvalidArgument (arguments rejected, on this or another rank),
  // kDeadlineExceeded (a peer did not take part within the group timeout),
  // kUnavailable (a peer's connection was lost), kFailedPrecondition (the group is not
  // usable: shut down, broken by an earlier error, or this rank is not a member),
  // kCancelled (the group was shut down before the operation ran).
  absl::Status wait(std::optional<std::chrono::milliseconds> timeout = std::nullopt) const;

  // Whether the operation has completed (successfully or not). Never blocks.
  bool is_completed() const;

  // For a completed receive: the rank the tensor came from (what a receive from any
  // rank reports). Empty for other operations, and before completion.
  std::optional<int> source_rank() const;

  // The operation as a Future: OK with the sender's rank for a receive (-1 for every
  // other operation), or the operation's error. Its callbacks (and add_callback's) run
  // on the thread that completes the operation — the group's worker thread for a
  // collective (a blocking collective may run on its caller's thread; its Work is not
  // handed out), a thread of the group's isend/irecv pool for those — or at once on the calling
  // thread when it is complete already. Keep them short: a callback that waits for
  // another collective of the same group blocks the worker thread that would run it.
  Future<int> future() const;
  void add_callback(std::function<void(const absl::Status&)> callback) const;

  // The operation's name, as in its error messages ("all_reduce", "irecv").
  const std::string& name() const;

  // A Work that is already complete with `status` (used for arguments rejected
  // before anything was sent, and by tests).
  static Work completed(std::string name, absl::Status status);

 private:
  friend class ProcessGroup;
  explicit Work(std::shared_ptr<internal::WorkState> state) : state_(std::move(state)) {}

  std::shared_ptr<internal::WorkState> state_;
};

}  // namespace ferry
