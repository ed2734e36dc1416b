#include "agents/process_group/transport.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/future.h"
#include "base/logging.h"
#include "base/status.h"
#include "base/thread_name.h"
#include "serialization/archive.h"

namespace ferry::internal {
namespace {

// The frame: FrameHead, the sender's name, per tensor a TensorEntry and its target's
// characters, the sealed Message, padding to kAlign, then each tensor's bytes, each
// starting at a multiple of kAlign (so a received tensor is aligned for any dtype).
enum class FrameKind : uint8_t { kRequest = 1, kReply = 2, kGoodbye = 3 };
constexpr uint32_t kFrameMagic = 0x46504746;  // "FGPF"
constexpr size_t kAlign = 64;
struct FrameHead {
  uint32_t magic;
  uint8_t kind;
  uint8_t reserved[3];
  uint32_t name_bytes;
  uint32_t num_tensors;
  uint64_t metadata_bytes;
};
struct TensorEntry {
  uint64_t nbytes;
  uint32_t target_bytes;
  uint32_t reserved;
};

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// `opens`: the first frame of a new outgoing link (reserved[0] = 1), so the receiver
// starts a new incoming link for it.
Bytes encode_frame(FrameKind kind, const std::string& sender, const Wire& wire, bool opens = false) {
  size_t table = sizeof(FrameHead) + sender.size();
  for (size_t i = 0; i < wire.tensors.size(); ++i) {
    table += sizeof(TensorEntry) + (i < wire.targets.size() ? wire.targets[i].size() : 0);
  }
  size_t total = align_up(table + wire.metadata.size());
  for (const Tensor& t : wire.tensors) total += align_up(t.nbytes());
  Bytes frame(total);
  uint8_t* p = frame.data();
  FrameHead head{kFrameMagic, static_cast<uint8_t>(kind), {static_cast<uint8_t>(opens ? 1 : 0), 0, 0},
                 static_cast<uint32_t>(sender.size()),
                 static_cast<uint32_t>(wire.tensors.size()), static_cast<uint64_t>(wire.metadata.size())};
  std::memcpy(p, &head, sizeof(head));
  p += sizeof(head);
  std::memcpy(p, sender.data(), sender.size());
  p += sender.size();
  for (size_t i = 0; i < wire.tensors.size(); ++i) {
    const std::string empty;
    const std::string& target = i < wire.targets.size() ? wire.targets[i] : empty;
    TensorEntry entry{static_cast<uint64_t>(wire.tensors[i].nbytes()), static_cast<uint32_t>(target.size()), 0};
    std::memcpy(p, &entry, sizeof(entry));
    p += sizeof(entry);
    std::memcpy(p, target.data(), target.size());
    p += target.size();
  }
  std::memcpy(p, wire.metadata.data(), wire.metadata.size());
  size_t offset = align_up(table + wire.metadata.size());
  for (const Tensor& t : wire.tensors) {
    if (t.nbytes() > 0) std::memcpy(frame.data() + offset, t.data(), t.nbytes());
    offset += align_up(t.nbytes());
  }
  return frame;
}

struct Frame {
  FrameKind kind;
  bool opens = false;
  std::string sender;
  Wire wire;
};

// Reads a frame, bounding every length by what arrived before trusting it. The
// tensors are views into `bytes`, which they keep alive.
absl::StatusOr<Frame> decode_frame(std::shared_ptr<Bytes> bytes) {
  const size_t size = bytes->size();
  const uint8_t* base = bytes->data();
  size_t at = 0;
  auto take = [&](void* out, size_t n, const char* what) -> absl::Status {
    if (n > size - at) {
      return absl::DataLossError(absl::StrCat("frame of ", size, " bytes is cut short in its ", what));
    }
    if (out != nullptr) std::memcpy(out, base + at, n);
    at += n;
    return absl::OkStatus();
  };
  FrameHead head;
  FERRY_RETURN_IF_ERROR(take(&head, sizeof(head), "header"));
  if (head.magic != kFrameMagic) return absl::DataLossError("not a ferry process-group agent frame");
  if (head.kind < 1 || head.kind > 3) return absl::DataLossError(absl::StrCat("unknown frame kind ", head.kind));
  Frame frame;
  frame.kind = static_cast<FrameKind>(head.kind);
  frame.opens = head.reserved[0] == 1;
  if (head.name_bytes > size - at) return absl::DataLossError("frame is cut short in the sender's name");
  frame.sender.assign(reinterpret_cast<const char*>(base + at), head.name_bytes);
  at += head.name_bytes;
  if (head.num_tensors > (size - at) / sizeof(TensorEntry)) {
    return absl::DataLossError(absl::StrCat("frame claims ", head.num_tensors, " tensors in ", size, " bytes"));
  }
  std::vector<uint64_t> lengths;
  lengths.reserve(head.num_tensors);
  frame.wire.targets.reserve(head.num_tensors);
  for (uint32_t i = 0; i < head.num_tensors; ++i) {
    TensorEntry entry;
    FERRY_RETURN_IF_ERROR(take(&entry, sizeof(entry), "tensor table"));
    if (entry.target_bytes > size - at) return absl::DataLossError("frame is cut short in a tensor's target");
    frame.wire.targets.emplace_back(reinterpret_cast<const char*>(base + at), entry.target_bytes);
    at += entry.target_bytes;
    lengths.push_back(entry.nbytes);
  }
  if (head.metadata_bytes > size - at) return absl::DataLossError("frame is cut short in its message");
  frame.wire.metadata.assign(reinterpret_cast<const char*>(base + at), head.metadata_bytes);
  at = align_up(at + head.metadata_bytes);
  frame.wire.tensors.reserve(head.num_tensors);
  for (uint64_t n : lengths) {
    if (at > size || n > size - at) return absl::DataLossError("frame is cut short in a tensor's bytes");
    if (n == 0) {
      FERRY_ASSIGN_OR_RETURN(Tensor empty, Tensor::empty({0}, DType::kUInt8));
      frame.wire.tensors.push_back(std::move(empty));
      continue;
    }
    std::shared_ptr<void> view(bytes, bytes->data() + at);
    FERRY_ASSIGN_OR_RETURN(Tensor t, Tensor::from_blob(std::move(view), {static_cast<int64_t>(n)}, DType::kUInt8));
    frame.wire.tensors.push_back(std::move(t));
    at = align_up(at + n);
  }
  return frame;
}

// A copy of `wire` whose tensors share nothing with the original (messages to self).
absl::StatusOr<Wire> copy_wire(const Wire& wire) {
  Wire out{wire.metadata, {}, wire.targets};
  for (const Tensor& t : wire.tensors) {
    FERRY_ASSIGN_OR_RETURN(Tensor c, t.clone());
    out.tensors.push_back(std::move(c));
  }
  return out;
}

}  // namespace

std::string process_group_address(int rank) { return absl::StrCat("pg:", rank); }

absl::StatusOr<int> rank_of_process_group_address(const std::string& address) {
  int rank = -1;
  if (!absl::StartsWith(address, "pg:") || !absl::SimpleAtoi(address.substr(3), &rank) || rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("\"", address, "\" is not a process-group agent address (expected \"pg:<rank>\")"));
  }
  return rank;
}

struct ProcessGroupTransport::State : std::enable_shared_from_this<State> {
  // One way of a rank pair: our requests to `rank` and its replies (outgoing), or its
  // requests and our replies. The group's connection itself outlives any Link.
  struct Link final : Connection, std::enable_shared_from_this<Link> {
    Link(std::shared_ptr<Session> session, std::weak_ptr<State> state, int rank, bool outgoing)
        : Connection(std::move(session)), state(std::move(state)), rank(rank), outgoing(outgoing) {}
    void write(Wire wire) override {
      if (closed.load(std::memory_order_acquire)) return;
      std::shared_ptr<State> s = state.lock();
      if (!s) return;
      if (rank == s->rank) {
        s->loop_back(*this, wire);
        return;
      }
      s->enqueue(rank, outgoing ? FrameKind::kRequest : FrameKind::kReply, wire,
                 outgoing && !opened.exchange(true));
    }
    void close() override {
      if (closed.exchange(true)) return;
      if (std::shared_ptr<State> s = state.lock()) s->unlink(this);
    }
    // Frames to a rank leave in order, so what was written goes first anyway.
    void close_after_writes() override {
      if (closed.exchange(true)) return;
      if (std::shared_ptr<State> s = state.lock()) s->unlink(this, /*drop_queued=*/false);
    }
    // One Gloo stream per rank pair carries its requests and our replies' replies both
    // ways, so it is never left unread (two ranks calling each other would wait on each
    // other's replies): a paused link keeps the requests that arrive aside, in order,
    // and the resumer thread hands them over. Only ranks of the group speak here, and a
    // ferry caller sends at most its own cap, which bounds what waits.
    void pause_reads() override { paused.store(true, std::memory_order_seq_cst); }
    void resume_reads() override {
      paused.store(false, std::memory_order_seq_cst);
      if (std::shared_ptr<State> s = state.lock()) s->resume(shared_from_this());
    }
    const std::weak_ptr<State> state;
    const int rank;
    const bool outgoing;
    std::atomic<bool> closed{false};
    std::atomic<bool> reported{false};
    std::atomic<bool> opened{false};  // its first frame is queued
    std::atomic<bool> paused{false};
    std::mutex park_mu;
    std::deque<Wire> parked;  // guarded by park_mu: requests kept aside while paused
    bool draining = false;    // guarded by park_mu: the resumer hands `parked` over
  };
  struct Outgoing {
    FrameKind kind;
    std::shared_ptr<const Bytes> frame;
  };

  std::string name;
  std::shared_ptr<ProcessGroup> group;
  int rank = 0;
  int world = 1;
  int num_threads = 1;
  std::weak_ptr<TransportEvents> events;
  std::atomic<int> self_id{-1};

  absl::Mutex mu;
  absl::CondVar cv;  // sending, queued or closed went down
  std::vector<std::deque<Outgoing>> queues ABSL_GUARDED_BY(mu);  // by rank
  std::vector<std::unique_ptr<absl::CondVar>> queue_cvs;  // by rank: its senders wait on it (with mu)
  int queued ABSL_GUARDED_BY(mu) = 0;  // frames in all queues
  int sending ABSL_GUARDED_BY(mu) = 0;
  bool closing ABSL_GUARDED_BY(mu) = false;  // no new frames
  bool stop_senders ABSL_GUARDED_BY(mu) = false;
  bool closed ABSL_GUARDED_BY(mu) = false;
  absl::flat_hash_map<int, std::string> names_by_rank ABSL_GUARDED_BY(mu);
  // By rank: the current link each way (null: none yet, or closed).
  std::vector<std::shared_ptr<Link>> out_links ABSL_GUARDED_BY(mu);
  std::vector<std::shared_ptr<Link>> in_links ABSL_GUARDED_BY(mu);
  std::vector<std::thread> senders;
  std::vector<std::thread> receivers;
  // By rank: it said goodbye, for good (set under mu, so connect() and departed() agree).
  std::vector<std::unique_ptr<std::atomic<bool>>> said_goodbye;
  // By rank: bumped by disconnect(), which gives up on the sends in flight. A sender
  // whose send failed across a bump leaves the verdict to whoever disconnected.
  std::vector<std::unique_ptr<std::atomic<uint64_t>>> disconnects;

  // The resumer thread: hands over what paused links kept aside once they resume.
  std::thread resumer;
  absl::Mutex resume_mu;
  absl::CondVar resume_cv;
  std::deque<std::weak_ptr<Link>> to_resume ABSL_GUARDED_BY(resume_mu);
  bool stop_resumer ABSL_GUARDED_BY(resume_mu) = false;

  std::atomic<uint64_t> frames_sent{0};
  std::atomic<uint64_t> frames_received{0};
  std::atomic<uint64_t> bytes_sent{0};
  std::atomic<uint64_t> bytes_received{0};

  void enqueue(int to_rank, FrameKind kind, const Wire& wire, bool opens = false) ABSL_LOCKS_EXCLUDED(mu) {
    auto frame = std::make_shared<const Bytes>(encode_frame(kind, name, wire, opens));
    absl::MutexLock lock(&mu);
    if (closing) return;  // the core fails what is pending when it shuts down
    queues[static_cast<size_t>(to_rank)].push_back(Outgoing{kind, std::move(frame)});
    ++queued;
    queue_cvs[static_cast<size_t>(to_rank)]->Signal();
  }

  bool drained() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return queued == 0 && sending == 0; }

  // Waits on cv until drained() or `deadline`.
  void wait_drained(absl::Time deadline) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    while (!drained() && !cv.WaitWithDeadline(&mu, deadline)) {
    }
  }

  std::string name_of(int r) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    auto it = names_by_rank.find(r);
    return it == names_by_rank.end() ? absl::StrCat("rank ", r) : absl::StrCat("\"", it->second, "\" (rank ", r, ")");
  }
  bool is_closing() ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    return closing;
  }

  // The connection to rank `r` failed: both its links end.
  void lost(int r, const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu) {
    if (is_closing()) return;
    std::shared_ptr<Link> out;
    std::shared_ptr<Link> in;
    {
      absl::MutexLock lock(&mu);
      out = std::move(out_links[static_cast<size_t>(r)]);
      in = std::move(in_links[static_cast<size_t>(r)]);
    }
    absl::Status status = absl::UnavailableError(why.message());
    if (out) report(out, status);
    if (in) report(in, status);
  }

  // What a link to or from rank `r`, which said goodbye, ends with; `more` is added.
  absl::Status goodbye_status(int r, const char* more = "") const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = names_by_rank.find(r);
    const std::string who = it == names_by_rank.end() ? absl::StrCat("rank ", r)
                                                      : absl::StrCat("\"", it->second, "\" (rank ", r, ")");
    return absl::UnavailableError(absl::StrCat("worker ", who, " shut down: it said goodbye", more));
  }

  // Rank `r` said goodbye (its transport closed): both its links end, as a closed
  // connection does on the other transports, so the core hears that it went (left,
  // once join() saw every worker arrive). The frames before the goodbye were delivered first, so a
  // call it answered is not failed. A goodbye while we close ourselves reports nothing
  // (the core is shutting down, and fails what is pending itself).
  void departed(int r, const std::string& sender) ABSL_LOCKS_EXCLUDED(mu) {
    std::shared_ptr<Link> out;
    std::shared_ptr<Link> in;
    absl::Status why;
    {
      absl::MutexLock lock(&mu);
      // Under mu, as connect() reads it: a link it registers before this is ended
      // here, and one it makes after is refused there.
      said_goodbye[static_cast<size_t>(r)]->store(true);
      if (!sender.empty()) names_by_rank.try_emplace(r, sender);
      if (closing) return;
      out = std::move(out_links[static_cast<size_t>(r)]);
      in = std::move(in_links[static_cast<size_t>(r)]);
      why = goodbye_status(r);
    }
    if (out) report(out, why);
    if (in) report(in, why);
  }

  void report(const std::shared_ptr<Link>& link, absl::Status why) {
    if (link->reported.exchange(true)) return;
    link->closed.store(true, std::memory_order_release);
    if (std::shared_ptr<TransportEvents> e = events.lock()) e->on_closed(link, std::move(why));
  }

  // A link closed by the core: later frames of that kind from its rank start a new one.
  void unlink(Link* link, bool drop_queued = true) ABSL_LOCKS_EXCLUDED(mu) {
    const size_t r = static_cast<size_t>(link->rank);
    {
      absl::MutexLock lock(&mu);
      std::vector<std::shared_ptr<Link>>& links = link->outgoing ? out_links : in_links;
      if (links[r].get() == link) links[r].reset();
      if (!link->outgoing || link->rank == rank || !drop_queued) return;
      // What is queued for it is for calls the core fails now.
      std::deque<Outgoing>& queue = queues[r];
      queued -= static_cast<int>(queue.size());
      queue.clear();
      disconnects[r]->fetch_add(1);
    }
    cv.SignalAll();
    // Senders stuck on a rank that stopped reading return; the group stays whole.
    group->cancel_sends(link->rank, absl::StrCat("worker ", name_of(link->rank), " was disconnected"));
  }

  // Delivers one message on `link` (on_header, then on_message), or keeps it aside
  // while the link is paused or still has earlier ones aside. Requests come from one
  // thread per rank, so the resumer and that thread never deliver on a link at once.
  void hand_over(const std::shared_ptr<Link>& link, Wire wire, TransportEvents& e) {
    if (!link->outgoing) {
      std::lock_guard<std::mutex> lock(link->park_mu);
      if (link->paused.load(std::memory_order_seq_cst) || link->draining || !link->parked.empty()) {
        link->parked.push_back(std::move(wire));
        return;
      }
    }
    deliver_now(link, std::move(wire), e);
  }

  void deliver_now(const std::shared_ptr<Link>& link, Wire wire, TransportEvents& e) {
    std::vector<uint64_t> lengths;
    for (const Tensor& t : wire.tensors) lengths.push_back(t.nbytes());
    // The frame is whole already (Gloo received it); the check still ends a peer that
    // breaks the handshake's or the message size's rules.
    if (absl::Status fits = e.on_header(*link, wire.metadata.size(), lengths); !fits.ok()) {
      link->close();
      report(link, std::move(fits));
      return;
    }
    e.on_message(link, std::move(wire));
  }

  // Any thread (Link::resume_reads): has the resumer hand over what `link` kept aside.
  void resume(const std::shared_ptr<Link>& link) ABSL_LOCKS_EXCLUDED(resume_mu) {
    {
      std::lock_guard<std::mutex> lock(link->park_mu);
      if (link->parked.empty() || link->draining) return;
      link->draining = true;
    }
    absl::MutexLock lock(&resume_mu);
    to_resume.push_back(link);
    resume_cv.Signal();
  }

  void resume_loop() ABSL_LOCKS_EXCLUDED(resume_mu) {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    for (;;) {
      std::shared_ptr<Link> link;
      {
        absl::MutexLock lock(&resume_mu);
        while (to_resume.empty() && !stop_resumer) resume_cv.Wait(&resume_mu);
        if (stop_resumer) return;
        link = to_resume.front().lock();
        to_resume.pop_front();
      }
      std::shared_ptr<TransportEvents> e = events.lock();
      if (!link) continue;
      for (;;) {
        Wire next;
        {
          std::lock_guard<std::mutex> lock(link->park_mu);
          if (!e || link->reported.load() || link->paused.load(std::memory_order_seq_cst) || link->parked.empty()) {
            link->draining = false;
            break;
          }
          next = std::move(link->parked.front());
          link->parked.pop_front();
        }
        deliver_now(link, std::move(next), *e);
      }
    }
  }

  // A message to ourselves: served on a copy, as a remote worker would get it.
  void loop_back(const Link& from, const Wire& wire) ABSL_LOCKS_EXCLUDED(mu) {
    std::shared_ptr<Link> to;
    {
      absl::MutexLock lock(&mu);
      to = from.outgoing ? in_links[static_cast<size_t>(rank)] : out_links[static_cast<size_t>(rank)];
    }
    if (!to) return;
    absl::StatusOr<Wire> copy = copy_wire(wire);
    if (!copy.ok()) {
      FERRY_LOG(WARNING) << name << ": message to self not delivered: " << copy.status();
      return;
    }
    TransportThreadScope transport_thread;
    if (std::shared_ptr<TransportEvents> e = events.lock()) hand_over(to, *std::move(copy), *e);
  }

  // One of rank `r`'s senders: frames to other ranks never wait behind a rank that
  // stopped reading. Sends carry no Gloo timeout (one would break the group for every
  // rank); a send to a rank that does not drain waits until disconnect() or close()
  // gives up on it, and the core's call timeouts and heartbeat decide when.
  void send_loop(int r) ABSL_LOCKS_EXCLUDED(mu) {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    absl::CondVar& queue_cv = *queue_cvs[static_cast<size_t>(r)];
    std::atomic<uint64_t>& disconnected = *disconnects[static_cast<size_t>(r)];
    for (;;) {
      Outgoing out;
      {
        absl::MutexLock lock(&mu);
        std::deque<Outgoing>& queue = queues[static_cast<size_t>(r)];
        while (queue.empty() && !stop_senders) queue_cv.Wait(&mu);
        if (queue.empty()) return;
        out = std::move(queue.front());
        queue.pop_front();
        --queued;
        ++sending;
      }
      const uint64_t generation = disconnected.load();
      const size_t size = out.frame->size();
      absl::Status s = group->send_bytes(std::move(out.frame), r, kProcessGroupAgentTag, ProcessGroup::kWaitIndefinitely);
      if (s.ok()) {
        frames_sent.fetch_add(1, std::memory_order_relaxed);
        bytes_sent.fetch_add(size, std::memory_order_relaxed);
      } else if (disconnected.load() != generation) {
        FERRY_LOG(INFO) << name << ": gave up a frame to " << name_of(r) << ": " << s;
      } else if (out.kind == FrameKind::kRequest) {
        lost(r, s);
      } else if (out.kind == FrameKind::kReply) {
        FERRY_LOG(INFO) << name << ": reply to " << name_of(r) << " not delivered: " << s;
      }
      {
        absl::MutexLock lock(&mu);
        --sending;
      }
      cv.SignalAll();
    }
  }

  void receive_loop(int r) {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    for (;;) {
      absl::StatusOr<ProcessGroup::ReceivedBytes> got =
          group->recv_bytes_stream(r, kProcessGroupAgentTag, ProcessGroup::kWaitIndefinitely);
      if (!got.ok()) {
        lost(r, got.status());  // unless we are closing: then the group was shut down under us
        return;
      }
      frames_received.fetch_add(1, std::memory_order_relaxed);
      bytes_received.fetch_add(got->data.size(), std::memory_order_relaxed);
      if (!deliver(r, std::make_shared<Bytes>(std::move(got->data)))) return;
    }
  }

  // Hands one frame from rank `r` to the core; false once `r` said goodbye.
  bool deliver(int r, std::shared_ptr<Bytes> bytes) ABSL_LOCKS_EXCLUDED(mu) {
    std::shared_ptr<TransportEvents> e = events.lock();
    absl::StatusOr<Frame> frame = decode_frame(std::move(bytes));
    if (!frame.ok()) {
      FERRY_LOG(WARNING) << name << ": dropping a frame from " << name_of(r) << ": " << frame.status();
      return true;
    }
    if (frame->kind == FrameKind::kGoodbye) {
      departed(r, frame->sender);
      return false;
    }
    if (!e) return true;
    const bool request = frame->kind == FrameKind::kRequest;
    std::shared_ptr<Link> previous;
    std::shared_ptr<Link> link;
    bool fresh = false;
    {
      absl::MutexLock lock(&mu);
      std::shared_ptr<Link>& slot = request ? in_links[static_cast<size_t>(r)] : out_links[static_cast<size_t>(r)];
      if (request && frame->opens && slot != nullptr) {
        // The rank opened a new link (it reconnected): the old one is over.
        previous = std::move(slot);
      }
      if (slot == nullptr && request) {
        slot = std::make_shared<Link>(nullptr, weak_from_this(), r, /*outgoing=*/false);
        fresh = true;
      }
      link = slot;
    }
    if (previous) report(previous, absl::CancelledError("the peer opened a new connection"));
    if (link == nullptr) return true;  // a reply on a link the core closed
    if (fresh) e->on_accepted(link);
    hand_over(link, std::move(frame->wire), *e);
    return true;
  }
};

ProcessGroupTransport::ProcessGroupTransport(std::shared_ptr<State> state) : state_(std::move(state)) {}

ProcessGroupTransport::~ProcessGroupTransport() { close(); }

absl::StatusOr<std::unique_ptr<ProcessGroupTransport>> ProcessGroupTransport::create(
    std::string name, std::shared_ptr<ProcessGroup> group, int sender_threads) {
  if (group == nullptr) return absl::InvalidArgumentError("the process group is null");
  if (!group->is_member()) return absl::InvalidArgumentError("this process is not a member of the process group");
  if (sender_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_worker_threads (the sender threads) must be at least 1, got ", sender_threads));
  }
  auto state = std::make_shared<State>();
  state->name = std::move(name);
  state->rank = group->rank();
  state->world = group->world_size();
  state->num_threads = sender_threads;
  state->group = std::move(group);
  {
    absl::MutexLock lock(&state->mu);  // not shared yet; for the analysis
    state->queues.resize(static_cast<size_t>(state->world));
    state->out_links.resize(static_cast<size_t>(state->world));
    state->in_links.resize(static_cast<size_t>(state->world));
  }
  for (int r = 0; r < state->world; ++r) state->queue_cvs.push_back(std::make_unique<absl::CondVar>());
  for (int r = 0; r < state->world; ++r) {
    state->said_goodbye.push_back(std::make_unique<std::atomic<bool>>(false));
    state->disconnects.push_back(std::make_unique<std::atomic<uint64_t>>(0));
  }
  return std::unique_ptr<ProcessGroupTransport>(new ProcessGroupTransport(std::move(state)));
}

absl::StatusOr<std::string> ProcessGroupTransport::listen(std::weak_ptr<TransportEvents> events) {
  State& s = *state_;
  s.events = std::move(events);
  for (int r = 0; r < s.world; ++r) {
    if (r == s.rank) continue;
    // One sender per rank: frames to a rank must arrive in the order written (the
    // core's hello comes first), and Gloo keeps the order of one sender's messages.
    s.senders.emplace_back([state = state_, r] {
      name_this_thread("ferry-pg-send");
      state->send_loop(r);
    });
    s.receivers.emplace_back([state = state_, r] {
      name_this_thread("ferry-pg-recv");
      state->receive_loop(r);
    });
  }
  s.resumer = std::thread([state = state_] {
    name_this_thread("ferry-pg-resume");
    state->resume_loop();
  });
  return process_group_address(s.rank);
}

std::shared_ptr<Connection> ProcessGroupTransport::connect(std::shared_ptr<Session> session,
                                                           const std::string& peer_name, const std::string& address) {
  State& s = *state_;
  absl::StatusOr<int> rank = rank_of_process_group_address(address);
  if (rank.ok() && *rank >= s.world) {
    rank = absl::InvalidArgumentError(absl::StrCat("rank ", *rank, " of address \"", address,
                                                   "\" is outside the process group of ", s.world, " ranks"));
  }
  auto link = std::make_shared<State::Link>(std::move(session), state_, rank.ok() ? *rank : -1, /*outgoing=*/true);
  if (!rank.ok()) {
    link->closed.store(true);
    s.report(link, absl::InvalidArgumentError(absl::StrCat("worker \"", peer_name, "\": ", rank.status().message())));
    return link;
  }
  std::shared_ptr<State::Link> loop;
  absl::Status gone;
  {
    absl::MutexLock lock(&s.mu);
    s.names_by_rank[*rank] = peer_name;
    if (s.said_goodbye[static_cast<size_t>(*rank)]->load()) {
      // Its group is shut down and a group's mesh is fixed: it cannot come back, so
      // nothing is queued for it.
      gone = s.goodbye_status(*rank, " earlier, and a process group cannot reconnect to a rank that left");
    } else {
      s.out_links[static_cast<size_t>(*rank)] = link;
    }
    if (*rank == s.rank) {
      // To ourselves: the other end is a link of our own, served without the network.
      loop = std::make_shared<State::Link>(nullptr, state_, s.rank, /*outgoing=*/false);
      s.in_links[static_cast<size_t>(s.rank)] = loop;
    }
  }
  if (!gone.ok()) {
    link->closed.store(true);
    s.report(link, std::move(gone));
    return link;
  }
  if (loop) {
    TransportThreadScope transport_thread;
    if (std::shared_ptr<TransportEvents> e = s.events.lock()) e->on_accepted(loop);
  }
  return link;
}

void ProcessGroupTransport::close() {
  State& s = *state_;
  {
    absl::MutexLock lock(&s.mu);
    if (s.closing) {
      while (!s.closed) s.cv.Wait(&s.mu);
      return;
    }
    // What is queued still goes (replies to requests served before the end), then a
    // goodbye to every rank that has not said goodbye to us, in parallel. A rank that
    // does not drain (stopped) is given up on after the group's timeout.
    s.wait_drained(absl::Now() + absl::FromChrono(s.group->timeout()));
    s.closing = true;
    if (!s.senders.empty()) {
      Wire bye;
      auto frame = std::make_shared<const Bytes>(encode_frame(FrameKind::kGoodbye, s.name, bye));
      for (int r = 0; r < s.world; ++r) {
        if (r == s.rank || s.said_goodbye[static_cast<size_t>(r)]->load()) continue;
        s.queues[static_cast<size_t>(r)].push_back(State::Outgoing{FrameKind::kGoodbye, frame});
        ++s.queued;
      }
    }
    s.stop_senders = true;
    for (auto& queue_cv : s.queue_cvs) queue_cv->SignalAll();
    s.wait_drained(absl::Now() + absl::FromChrono(std::min(s.group->timeout(), std::chrono::milliseconds(5000))));
    for (auto& queue : s.queues) queue.clear();
    s.queued = 0;
  }
  s.cv.SignalAll();
  // Give up on what is still in flight. A sender may be between taking its frame and
  // posting it when the cancel comes, so cancel again until every sender is done.
  for (;;) {
    for (int r = 0; r < s.world; ++r) {
      if (r != s.rank) s.group->cancel_sends(r, "the agent is shutting down");
    }
    absl::MutexLock lock(&s.mu);
    const absl::Time until = absl::Now() + absl::Milliseconds(50);
    while (s.sending != 0 && !s.cv.WaitWithDeadline(&s.mu, until)) {
    }
    if (s.sending == 0) break;
  }
  for (std::thread& t : s.senders) t.join();
  // The only way to end a Gloo receive: shut the group down.
  s.group->shutdown();
  for (std::thread& t : s.receivers) t.join();
  {
    absl::MutexLock lock(&s.resume_mu);
    s.stop_resumer = true;
    s.resume_cv.SignalAll();
  }
  if (s.resumer.joinable()) s.resumer.join();
  {
    absl::MutexLock lock(&s.mu);
    s.closed = true;
  }
  s.cv.SignalAll();
}

std::map<std::string, std::string> ProcessGroupTransport::debug_info() const {
  const State& s = *state_;
  return {{"transport", "process_group"},
          {"rank", std::to_string(s.rank)},
          {"process_group_size", std::to_string(s.world)},
          {"sender_threads", std::to_string(s.num_threads)},
          {"frames_sent", std::to_string(s.frames_sent.load())},
          {"frames_received", std::to_string(s.frames_received.load())},
          {"bytes_sent", std::to_string(s.bytes_sent.load())},
          {"bytes_received", std::to_string(s.bytes_received.load())}};
}

ProcessGroup& ProcessGroupTransport::group() { return *state_->group; }

}  // namespace ferry::internal
