// File: process_group/internal/group_impl.h
//
// The member side of a ProcessGroup: ProcessGroup::Impl holds the Gloo context, the
// worker thread that runs collectives in order, and the bookkeeping of point-to-point
// operations. ProcessGroup's own source files (process_group.cc: creation and
// sub-groups; collectives.cc; point_to_point.cc) include this header and call into it.
//
// Impl's parts live one job to a file:
//   internal/group_impl.cc      mesh connect, usability, shutdown, p2p thread tracking
//   internal/header_exchange.cc the collective queue and the header exchange that
//                               checks every rank's arguments before data moves
//   internal/group_p2p.cc       tensor and byte messages (send/recv, *_bytes)
// and the helpers they share have headers of their own: gloo_errors.h (Gloo's
// exceptions to statuses), arg_checks.h (argument checks), host_staging.h (CUDA
// tensors through host memory). Internal: includes Gloo, never installed.
#pragma once

#include "process_group/process_group.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/status.h"
#include "gloo/context.h"
#include "gloo/transport/buffer.h"
#include "gloo/transport/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "process_group/internal/arg_checks.h"
#include "process_group/internal/gloo_errors.h"
#include "process_group/internal/header.h"
#include "process_group/internal/host_staging.h"
#include "process_group/internal/work_state.h"

namespace ferry {

namespace internal::pg {
// Set on a thread for the length of a blocking collective call (all_reduce, not
// all_reduce_async): enqueue may then run the collective on that thread.
class RunHereIfIdle {
 public:
  RunHereIfIdle() : previous_(flag()) { flag() = true; }
  ~RunHereIfIdle() { flag() = previous_; }
  RunHereIfIdle(const RunHereIfIdle&) = delete;
  RunHereIfIdle& operator=(const RunHereIfIdle&) = delete;
  static bool active() { return flag(); }

 private:
  static bool& flag() {
    thread_local bool on = false;
    return on;
  }
  bool previous_;
};
}  // namespace internal::pg

using namespace internal::pg;  // NOLINT(google-build-using-namespace): this header's own helpers
using internal::CollectiveHeader;
using internal::CollectiveKind;
using internal::WorkState;

// The member side of a group: the Gloo context, the worker thread that runs
// collectives in order, and the bookkeeping of point-to-point operations.
//
// Thread-safe. Threads: the worker (collectives), a pool of at most kMaxP2PWaiters
// that wait for pending isend/irecv, and callers' threads for send/recv. shutdown()
// stops and joins all of them before the context goes, so tasks may use `this` freely.
class ProcessGroup::Impl {
 public:
  Impl(int rank, int size, std::chrono::milliseconds timeout, std::shared_ptr<gloo::transport::Device> device);
  ~Impl();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& description() const { return description_; }
  const std::shared_ptr<gloo::transport::Device>& device() const { return device_; }

  // ---- mesh connect (group_impl.cc) -----------------------------------------------

  // A Gloo context connected to every other rank through `store`.
  absl::StatusOr<std::shared_ptr<gloo::Context>> connect_mesh(const std::shared_ptr<Store>& store);

  // Rendezvous with the other ranks through `store` and connect to each of them:
  // once for the data, and once more for the collective headers (see HeaderSlots).
  absl::Status connect(const std::shared_ptr<Store>& store);

  // ---- collectives (header_exchange.cc) -------------------------------------------

  // What a queued collective does once its turn comes: with every rank's header
  // already checked, moves the data using Gloo tag `tag`.
  using Body = std::function<absl::Status(Impl& impl, uint32_t tag, const std::vector<CollectiveHeader>& headers)>;

  // Queues a collective. `local_error` (this rank's argument check) rides along in
  // the header so every rank fails together.
  // `inline_source`: the tensor whose bytes may ride in this rank's header message (see
  // inline_size): a broadcast root's, an all_gather's input.
  Work enqueue(std::string name, CollectiveHeader header, absl::Status local_error, Body body,
               Tensor inline_source = Tensor());

  // ---- point-to-point (group_p2p.cc) ----------------------------------------------

  // Posts a send and returns a function that waits for it; the two halves let isend
  // post on the caller's thread (keeping call order) and wait elsewhere.
  absl::StatusOr<std::function<absl::Status()>> post_send(const std::string& name, const Tensor& tensor, int dst,
                                                          uint32_t tag);

  // Posts the header receive; the returned function waits for the header, then
  // receives the data it announces (into `tensor`, or drained on a mismatch).
  absl::StatusOr<std::function<absl::StatusOr<int>()>> post_recv(const std::string& name, const Tensor& tensor,
                                                                 std::optional<int> src, uint32_t tag);

  // A byte message (see ProcessGroup::send_bytes): posts the header (with the data
  // when it is small) and the data, then waits until the receiver has both.
  absl::Status send_bytes(const std::string& name, const Bytes& data, int dst, uint32_t tag,
                          std::chrono::milliseconds timeout);

  // `keep` (may be null) owns the data: with it, cancel_sends(dst) may end the wait,
  // and the message, still posted, is kept (parked_) until the context goes.
  absl::Status send_bytes(const std::string& name, const uint8_t* data, size_t size, std::shared_ptr<const Bytes> keep,
                          int dst, uint32_t tag, std::chrono::milliseconds timeout);

  // Ends the wait of every cancellable send to `dst` with `why` (see send_bytes).
  void cancel_sends(int dst, const absl::Status& why);

  // recv_bytes_stream: receives stay posted for (src, tag) in a ring, consumed in
  // order (Gloo fills posted receives of one slot and peer in the order they were
  // posted), each re-posted as soon as its message is taken out.
  absl::StatusOr<ReceivedBytes> recv_bytes_stream(const std::string& name, int src, uint32_t tag,
                                                  std::chrono::milliseconds timeout);

  absl::StatusOr<ReceivedBytes> recv_bytes(const std::string& name, std::optional<int> src, uint32_t tag,
                                           std::chrono::milliseconds timeout);
  // The data part (`size` bytes on `slot`) of a bytes message too large to ride behind
  // its header, which `sender` has posted already; `buf` is registered for shutdown.
  absl::Status recv_bytes_data(const std::string& name, int sender, uint64_t slot, uint64_t size,
                               ReceivedBytes& out, std::unique_ptr<gloo::transport::UnboundBuffer>& buf);

  // ---- threads, usability and shutdown (group_impl.cc) ----------------------------

  // Runs `fn` (an isend/irecv's wait) on the pool, in the order posted; false once
  // the group is closed (the caller runs it then). Gloo has no completion callbacks,
  // so a wait holds a thread: the pool bounds them at kMaxP2PWaiters, and the
  // operations past that wait their turn (their messages are posted already).
  bool spawn(std::function<void()> fn);
  static constexpr size_t kMaxP2PWaiters = 64;

  // Counts a point-to-point operation in flight, so shutdown() waits for it before
  // the context goes. Fails when the group cannot be used.
  absl::Status begin_p2p(std::string_view name);
  void end_p2p();

  absl::Status usable(std::string_view name);

  // Cancels queued collectives, aborts pending point-to-point waits, joins every
  // thread and closes the connections. Safe to call twice or concurrently: a second
  // call returns once the first has finished.
  void shutdown();

 private:
  struct Task {
    std::string name;
    std::shared_ptr<WorkState> state;
    CollectiveHeader header;
    absl::Status local_error;
    Body body;
    uint32_t seq;  // the collective's number in this group: the same on every rank
    Tensor inline_source;  // see enqueue
  };

  // Where collective headers land (see run()): for each peer, kHeaderRing Gloo buffers
  // bound to fixed slots each way, made once at connect. A bound buffer's message is
  // written straight into place on arrival, with no per-message handshake, where an
  // unbound one costs a "ready to receive" message as well: half the messages a
  // header exchange sends. Collective `seq` uses ring entry seq % kHeaderRing.
  //
  // They live on connections of their own (header_context_): Gloo's first send from
  // a bound buffer sets the socket's send buffer to that message's size (a few KiB
  // after the kernel's minimum) for good, which would throttle the data that follows
  // on the same connection.
  //
  // A message is the header, then the data of a small broadcast (from its root) or
  // all_gather (inline_bytes), then a trailer: the collective's seq + 1. The transport writes
  // a message in order, so a trailer in place means the whole message is in. A slot is
  // cleared once its collective has ended (clear_inbox).
  static constexpr size_t kInlineBytes = 16 * 1024;
  static constexpr size_t kSlotBytes = sizeof(CollectiveHeader) + kInlineBytes + sizeof(uint64_t);
  struct HeaderSlots {
    std::vector<uint8_t> inbox;   // kSlotBytes each, [peer * kHeaderRing + entry]
    std::vector<uint8_t> outbox;  // kSlotBytes each, [entry]
    std::vector<std::unique_ptr<gloo::transport::Buffer>> recv;  // like inbox; none for this rank
    std::vector<std::unique_ptr<gloo::transport::Buffer>> send;  // like inbox; none for this rank
  };

  // The receives recv_bytes_stream keeps posted for one (rank, tag).
  struct PostedRing {
    static constexpr size_t kDepth = 4;
    std::mutex mu;  // one consumer at a time; guards the rest
    std::vector<std::vector<uint8_t>> storage;
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> bufs;
    size_t next = 0;
    absl::Status failed;  // a re-post that failed: every later call returns it
  };

  // A byte message being sent. The buffers are declared last, so they go first.
  struct PendingSend {
    std::vector<uint8_t> head;          // the header, and the data when it is inline
    std::shared_ptr<const Bytes> keep;  // owns larger data, for a cancellable send
    absl::Status why;                   // set by cancel_sends (under mu_)
    std::unique_ptr<gloo::transport::UnboundBuffer> head_buf;
    std::unique_ptr<gloo::transport::UnboundBuffer> data_buf;
  };

  // A tensor message's data moves in chunks of this many bytes (Gloo messages on one
  // slot, matched in order), so a receiver that must discard it (a mismatch) drains
  // it through one chunk of memory instead of allocating what the sender announced.
  static constexpr size_t kDataChunk = size_t{1} << 20;
  static size_t chunk_count(size_t bytes) { return (bytes + kDataChunk - 1) / kDataChunk; }

  // One pending send or receive: its Gloo buffers and what they point at.
  struct P2POp {
    CollectiveHeader header;
    Tensor host;
    uint32_t seq = 0;
    std::unique_ptr<gloo::transport::UnboundBuffer> header_buf;
    std::unique_ptr<gloo::transport::UnboundBuffer> data_buf;
    std::vector<uint8_t> drain;

    void release(Impl& impl) {
      impl.unregister_buffer(header_buf.get());
      impl.unregister_buffer(data_buf.get());
    }
  };

  // ---- usability and errors (group_impl.cc) ---------------------------------------

  // OK, or why `name` cannot run now. Called with mu_ held.
  absl::Status usable_locked(std::string_view name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Status cancelled(std::string_view name) const;

  // Runs a Gloo step; an exception from it means the transport is in an unknown state
  // (Gloo's own advice: recreate the pairs), so it breaks the group for later calls.
  template <typename Fn>
  absl::Status guarded(std::string_view name, Fn&& fn);

  // Like guarded(), for byte messages: a connection lost to one peer fails only that
  // operation (Gloo's pairs are independent), while a timeout breaks the group, since
  // Gloo then closes every connection of the context.
  template <typename Fn>
  absl::Status guarded_p2p(std::string_view name, Fn&& fn);

  // Breaks the group with `s`, unless an earlier error already did, and returns `s`.
  absl::Status break_group(absl::Status s);

  // Breaks the group with `why` (the first error wins) and returns it, naming `name`.
  absl::Status fail_group(std::string_view name, const absl::Status& why);

  // Buffers that shutdown() aborts; registering fails once the group is closed.
  bool register_buffer(gloo::transport::UnboundBuffer* buf);
  void unregister_buffer(gloo::transport::UnboundBuffer* buf);

  // ---- point-to-point (group_p2p.cc) ----------------------------------------------

  absl::Status wait_send(std::string_view name, gloo::transport::UnboundBuffer* buf);
  absl::Status wait_recv(std::string_view name, gloo::transport::UnboundBuffer* buf, int* sender);
  absl::Status finish_recv(const std::string& name, P2POp& op, const Tensor& tensor, uint32_t tag, int* sender);

  // ---- collectives and the header exchange (header_exchange.cc) -------------------

  void worker_loop();

  // A pool thread: runs spawned waits until the group is closed and none is left.
  void p2p_loop();

  // A collective. Every rank sends its header to every other rank's landing slot for
  // it (slots_), waits for theirs, and every rank runs check_headers on the same
  // headers and reaches the same verdict.
  //
  // The steady path costs no round trip and no other thread: when this rank's
  // signature equals the one every rank agreed on in the group's last data collective
  // (agreed_), it runs its Gloo operation at once, on a tag that carries the signature
  // (data_tag), and checks the headers after it; they left before the data, so they
  // are usually there already. Otherwise (the first call, new arguments,
  // an argument error, a barrier) it waits for the headers first.
  //
  // A mismatch cannot leave a rank waiting: every rank agreed on agreed_, so all ranks
  // that went ahead run the same operation on the same tag, and every other rank
  // (none of which moved data: it waited for the headers) takes part in it with scratch
  // buffers (run_stand_in) before reporting the mismatch; that lets the operation of
  // the ranks that went ahead end, and they report the same mismatch from the same
  // headers. Their outputs then hold unspecified values.
  //
  // The wait for the headers is bounded by the group's timeout; past it the collective
  // fails with kDeadlineExceeded and the group is broken, as after a Gloo timeout.
  absl::Status run(Task& task);

  // Waits for every other rank's header of the running collective, number `seq` (in
  // ring entry current_entry_), and copies it into `headers`, and for this rank's to
  // have gone out, within the group's timeout (the pairs' own, set at connect).
  absl::Status wait_headers(const std::string& name, uint32_t seq, std::vector<CollectiveHeader>& headers);

  static constexpr std::string_view kExchangeName = "collective header exchange";
  // How many collectives' headers the ring holds. Two suffice: a rank sends collective
  // k+2's header only after every rank's header of k+1 reached it, so every rank has
  // started k+1 and has taken k's headers out of its slots.
  static constexpr size_t kHeaderRing = 2;

  size_t slot_index(int peer, size_t entry) const { return static_cast<size_t>(peer) * kHeaderRing + entry; }

  // How many bytes of data ride in `sender`'s message with header `h` (see
  // inline_size): all of them for an all_gather, the root's for a broadcast.
  static size_t inline_bytes(const CollectiveHeader& h, int sender);

 public:
  // The size of the tensor a broadcast or an all_gather with header `h` moves when it
  // fits kInlineBytes, else 0. Such a collective needs no Gloo operation: the data rides
  // in the header messages (a broadcast's root's; every all_gather input).
  static size_t inline_size(const CollectiveHeader& h);
  static bool is_inline(const CollectiveHeader& h) { return inline_size(h) > 0; }

  // The bytes that rode in `sender`'s message of the running collective (is_inline);
  // the thread running the collective reads them from its body.
  const uint8_t* inline_data(int sender) const {
    return &slots_.inbox[slot_index(sender, current_entry_) * kSlotBytes + sizeof(CollectiveHeader)];
  }

 private:
  // The trailer of a message from `sender` in a slot (see HeaderSlots); 0 when the
  // header there is not whole.
  uint64_t trailer_of(const uint8_t* in, int sender) const;

  // Clears ring entry `entry` of every peer's inbox, once its collective has ended: a
  // later message of another length must not find a stale trailer (or stale bytes that
  // look like one) where its own goes.
  void clear_inbox(size_t entry, const std::vector<CollectiveHeader>& headers);

  // Makes slots_ (see HeaderSlots). Every rank takes the same slot numbers from the
  // context. On each connection, messages to the higher rank and those to the lower
  // one use different slots: destroying any buffer of a slot makes Gloo forget that
  // slot's receive buffer on the pair.
  absl::Status make_header_slots();

  // Runs the data operation a rank with header `h` runs, on tag `tag`, with scratch
  // buffers (collectives.cc).
  absl::Status run_stand_in(const CollectiveHeader& h, uint32_t tag);

  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
  // FERRY_MAX_MESSAGE_BYTES, the agents' limit: no size a peer announces makes this
  // rank allocate more (see take_bytes_header and finish_recv).
  const uint64_t max_bytes_;
  std::shared_ptr<gloo::transport::Device> device_;
  const std::string description_;

 public:
  // Set by connect() before any other thread exists, cleared by shutdown() after all
  // have gone; the operation bodies use it.
  std::shared_ptr<gloo::Context> context_;

 private:
  std::thread worker_;
  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  uint32_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // a collective is running (worker or caller)
  // The header slots, and the signature every rank agreed on in the last collective
  // when it moved data (see run()). Only the thread running a collective uses them
  // (busy_ keeps that to one), and shutdown() once none runs; connect() sets them up
  // before any other thread exists.
  std::shared_ptr<gloo::Context> header_context_;
  HeaderSlots slots_;
  size_t current_entry_ = 0;  // the ring entry of the running collective
  std::optional<uint64_t> agreed_;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<int, uint32_t>, uint32_t> send_seq_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<int, uint32_t>, uint32_t> bytes_send_seq_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<gloo::transport::UnboundBuffer*> buffers_ ABSL_GUARDED_BY(mu_);
  int p2p_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> p2p_threads_ ABSL_GUARDED_BY(mu_);  // the pool (spawn)
  std::deque<std::function<void()>> p2p_queue_ ABSL_GUARDED_BY(mu_);
  size_t p2p_idle_ ABSL_GUARDED_BY(mu_) = 0;  // pool threads waiting for a task
  absl::flat_hash_map<std::pair<int, uint32_t>, std::shared_ptr<PostedRing>> rings_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, std::set<std::shared_ptr<PendingSend>>> cancellable_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<PendingSend>> parked_ ABSL_GUARDED_BY(mu_);
};

template <typename Fn>
absl::Status ProcessGroup::Impl::guarded(std::string_view name, Fn&& fn) {
  bool threw = true;
  absl::Status s = catch_gloo(name, description_, [&] {
    absl::Status r = fn();
    threw = false;
    return r;
  });
  return threw ? break_group(std::move(s)) : s;
}

template <typename Fn>
absl::Status ProcessGroup::Impl::guarded_p2p(std::string_view name, Fn&& fn) {
  absl::Status s = catch_gloo(name, description_, std::forward<Fn>(fn));
  return absl::IsDeadlineExceeded(s) ? break_group(std::move(s)) : s;
}

// A non-member handle, a shut-down group or a broken one cannot run anything; the
// collective's own argument checks ride in its header instead (see enqueue).
#define FERRY_PG_MEMBER_OR_RETURN_WORK(name)                                 \
  do {                                                                        \
    if (!is_member()) return Work::completed(name, not_member_error(name, ranks_)); \
  } while (0)

}  // namespace ferry
