// File: process_group/internal/group_impl.h
//
// The member side of a ProcessGroup (ProcessGroup::Impl: the Gloo context, the worker
// thread that runs collectives in order, point-to-point bookkeeping) and the helpers
// its three source files share: process_group.cc (creation, sub-groups),
// collectives.cc and point_to_point.cc. Internal: includes Gloo, never installed.
#pragma once

#include "process_group/process_group.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include "absl/base/thread_annotations.h"
#include "absl/cleanup/cleanup.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "base/logging.h"
#include "base/status.h"
#include "gloo/allgather.h"
#include "gloo/allgatherv.h"
#include "gloo/allreduce.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/gather.h"
#include "gloo/reduce.h"
#include "gloo/rendezvous/context.h"
#include "gloo/scatter.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "process_group/internal/gloo_store.h"
#include "process_group/internal/header.h"
#include "process_group/internal/interface.h"
#include "process_group/internal/reduce.h"
#include "process_group/internal/work_state.h"
#include "store/prefix_store.h"
#include "tensor/cuda.h"

namespace ferry::internal::pg {


// Point-to-point messages use slots of their own, apart from every Gloo collective
// prefix (1..8): [prefix:8][tag:32][sequence:24]. A send is a header on the tag's
// header slot, then the data on a slot that carries the sender's sequence number for
// (receiver, tag), so the receiver takes exactly the data its header announced even
// when several receives from one peer are pending.
constexpr uint64_t kP2PHeaderPrefix = 0x40;
constexpr uint64_t kP2PDataPrefix = 0x41;
// The header's kind for a point-to-point message (not a collective).
constexpr uint8_t kP2PKind = 0x20;

// Byte messages (send_bytes/recv_bytes) use two slot prefixes of their own, laid out
// like the tensor messages' ones. A message up to kBytesInline bytes rides behind its
// header in one Gloo message; a larger one follows on its data slot.
constexpr uint64_t kBytesHeaderPrefix = 0x42;
constexpr uint64_t kBytesDataPrefix = 0x43;
struct BytesHeader {
  uint32_t magic;
  uint32_t seq;
  uint64_t size;
};
constexpr uint32_t kBytesMagic = 0x314d4246;  // "FBM1"
constexpr size_t kBytesInline = 64 * 1024 - sizeof(BytesHeader);

inline uint64_t bytes_header_slot(uint32_t tag) { return (kBytesHeaderPrefix << 56) | (static_cast<uint64_t>(tag) << 24); }
inline uint64_t bytes_data_slot(uint32_t tag, uint32_t seq) {
  return (kBytesDataPrefix << 56) | (static_cast<uint64_t>(tag) << 24) | (seq & 0xffffffu);
}

inline uint64_t p2p_header_slot(uint32_t tag) { return (kP2PHeaderPrefix << 56) | (static_cast<uint64_t>(tag) << 24); }
inline uint64_t p2p_data_slot(uint32_t tag, uint32_t seq) {
  return (kP2PDataPrefix << 56) | (static_cast<uint64_t>(tag) << 24) | (seq & 0xffffffu);
}

// Gloo prefixes its messages with "[file:line] " (and EnforceNotMet with
// "[enforce fail at file:line] "); those belong in logs, not in users' errors.
inline std::string strip_location(std::string_view text) {
  std::string out(text);
  while (!out.empty() && out[0] == '[') {
    size_t close = out.find("] ");
    if (close == std::string::npos) break;
    std::string_view inside(out.data() + 1, close - 1);
    if (inside.find(':') == std::string_view::npos) break;
    out.erase(0, close + 2);
  }
  return out;
}

inline bool looks_like_timeout(std::string_view text) {
  const std::string lower = absl::AsciiStrToLower(internal::av(text));
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

// The status for an exception thrown by Gloo (or the store adapter) during `what`.
inline absl::Status status_from_exception(std::string_view what, std::string_view context, std::string_view raw,
                                   bool io_error) {
  FERRY_LOG(INFO) << what << " (" << context << "): gloo error: " << raw;
  std::string text = strip_location(raw);
  absl::StatusCode code = absl::StatusCode::kInternal;
  if (looks_like_timeout(text)) {
    code = absl::StatusCode::kDeadlineExceeded;
  } else if (io_error) {
    code = absl::StatusCode::kUnavailable;
  }
  return absl::Status(code, absl::StrCat(internal::av(what), " (", internal::av(context), "): ", text));
}

// Runs `fn`, turning whatever Gloo throws into a status; no exception leaves here.
template <typename Fn>
inline absl::Status catch_gloo(std::string_view what, std::string_view context, Fn&& fn) {
  try {
    return fn();
  } catch (const gloo::IoException& e) {
    return status_from_exception(what, context, e.what(), /*io_error=*/true);
  } catch (const gloo::EnforceNotMet& e) {
    return status_from_exception(what, context, e.what(), /*io_error=*/false);
  } catch (const std::exception& e) {
    return status_from_exception(what, context, e.what(), /*io_error=*/false);
  } catch (...) {
    return absl::InternalError(absl::StrCat(internal::av(what), " (", internal::av(context),
                                            "): unknown exception from Gloo"));
  }
}

// CUDA staging. This Gloo moves host memory only, so a CUDA tensor is copied to the
// host before an operation and the results copied back into its own storage after.

// The tensor's contents on the host: itself on the CPU, else a host copy.
inline absl::StatusOr<Tensor> host_input(const Tensor& t) { return t.to(Device::cpu()); }

// Host memory for results bound for `t`: itself on the CPU, else fresh host memory.
inline absl::StatusOr<Tensor> host_output(const Tensor& t) {
  if (t.device().is_cpu()) return t;
  return Tensor::empty(t.shape(), t.dtype(), Device::cpu());
}

// Copies `bytes` of host memory at `src` into `dst`'s storage (any device).
inline absl::Status copy_from_host(const Tensor& dst, const void* src, size_t bytes) {
  if (bytes == 0 || dst.data() == src) return absl::OkStatus();
  if (dst.device().is_cpu()) {
    std::memcpy(dst.data(), src, bytes);
    return absl::OkStatus();
  }
  std::shared_ptr<CudaRuntime> runtime = cuda_runtime();
  CudaStream stream{dst.device().index(), nullptr};
  FERRY_RETURN_IF_ERROR(runtime->copy_async(dst.data(), dst.device(), src, Device::cpu(), bytes, stream));
  return runtime->synchronize(stream);
}

// Writes a host result back to `t` when `t` lives elsewhere.
inline absl::Status write_back(const Tensor& t, const Tensor& host) { return copy_from_host(t, host.data(), t.nbytes()); }

inline std::string ranks_string(const std::vector<int>& ranks) { return absl::StrCat("[", absl::StrJoin(ranks, ", "), "]"); }

inline absl::Status not_member_error(std::string_view name, const std::vector<int>& ranks) {
  return absl::FailedPreconditionError(absl::StrCat(internal::av(name), ": this process is not a member of the group ",
                                                    ranks_string(ranks),
                                                    " (new_group left it out); only members may use it"));
}



inline absl::Status check_tensor(std::string_view name, std::string_view what, const Tensor& t) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(internal::av(name), ": ", internal::av(what),
                                                                   " is undefined"));
  return absl::OkStatus();
}

inline absl::Status check_root(std::string_view name, std::string_view what, int root, int size) {
  if (root < 0 || root >= size) {
    return absl::InvalidArgumentError(absl::StrCat(internal::av(name), ": ", internal::av(what), " ", root,
                                                   " is out of range for a group of ", size, " ranks"));
  }
  return absl::OkStatus();
}

// Checks a list of world-size tensors that must each look like `like`.
inline absl::Status check_list(std::string_view name, std::string_view list_name, const std::vector<Tensor>& list,
                        const Tensor& like, int size) {
  if (static_cast<int>(list.size()) != size) {
    return absl::InvalidArgumentError(absl::StrCat(internal::av(name), ": ", internal::av(list_name), " has ",
                                                   list.size(), " tensors; expected one per rank (", size, ")"));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const Tensor& t = list[i];
    if (!t.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat(internal::av(name), ": ", internal::av(list_name), "[", i, "] is undefined"));
    }
    if (t.dtype() != like.dtype() || t.shape() != like.shape()) {
      return absl::InvalidArgumentError(absl::StrCat(
          internal::av(name), ": ", internal::av(list_name), "[", i, "] is ", dtype_name(t.dtype()), " ",
          internal::shape_string(t.shape()), "; expected ", dtype_name(like.dtype()), " ",
          internal::shape_string(like.shape()), " like the local tensor"));
    }
  }
  return absl::OkStatus();
}



inline absl::Status check_peer(std::string_view name, std::string_view what, int peer, int rank, int size) {
  FERRY_RETURN_IF_ERROR(check_root(name, what, peer, size));
  if (peer == rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(internal::av(name), ": ", internal::av(what), " ", peer, " is this process's own rank"));
  }
  return absl::OkStatus();
}


}  // namespace ferry::internal::pg

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
// Thread-safe. Threads: the worker (collectives), one thread per pending isend/irecv,
// and callers' threads for send/recv. shutdown() stops and joins all of them before
// the context goes, so tasks may use `this` freely.
class ProcessGroup::Impl {
 public:
  Impl(int rank, int size, std::chrono::milliseconds timeout, std::shared_ptr<gloo::transport::Device> device)
      : rank_(rank), size_(size), timeout_(timeout), device_(std::move(device)),
        description_(absl::StrCat("rank ", rank, " of ", size)) {}

  ~Impl() { shutdown(); }

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& description() const { return description_; }
  const std::shared_ptr<gloo::transport::Device>& device() const { return device_; }

  // A Gloo context connected to every other rank through `store`.
  absl::StatusOr<std::shared_ptr<gloo::Context>> connect_mesh(const std::shared_ptr<Store>& store) {
    auto context = std::make_shared<gloo::rendezvous::Context>(rank_, size_);
    context->setTimeout(timeout_);
    internal::GlooStore gloo_store(store);
    absl::Status s = catch_gloo("process group rendezvous", description_, [&] {
      context->connectFullMesh(gloo_store, device_);
      return absl::OkStatus();
    });
    // A store error comes back as the store's own status, not as Gloo's text.
    if (absl::Status from_store = gloo_store.last_error(); !s.ok() && !from_store.ok()) {
      s = absl::Status(from_store.code(),
                       absl::StrCat("process group rendezvous (", description_, "): ", from_store.message()));
    }
    if (absl::IsDeadlineExceeded(s)) {
      // The usual causes, which a key name alone does not suggest.
      return absl::DeadlineExceededError(absl::StrCat(
          s.message(), " (is every rank of 0..", size_ - 1,
          " running, each with its own rank, the same world size and the same store?)"));
    }
    FERRY_RETURN_IF_ERROR(s);
    return context;
  }

  // Rendezvous with the other ranks through `store` and connect to each of them:
  // once for the data, and once more for the collective headers (see HeaderSlots).
  absl::Status connect(const std::shared_ptr<Store>& store) {
    FERRY_ASSIGN_OR_RETURN(context_, connect_mesh(store));
    if (size_ > 1) {
      FERRY_ASSIGN_OR_RETURN(header_context_, connect_mesh(std::make_shared<PrefixStore>("headers", store)));
      // No other thread exists yet.
      FERRY_RETURN_IF_ERROR(catch_gloo(kExchangeName, description_, [&] { return make_header_slots(); }));
    }
    worker_ = std::thread([this] { worker_loop(); });
    return absl::OkStatus();
  }

  // ---- collectives ---------------------------------------------------------------

  // What a queued collective does once its turn comes: with every rank's header
  // already checked, moves the data using Gloo tag `tag`.
  using Body = std::function<absl::Status(Impl& impl, uint32_t tag, const std::vector<CollectiveHeader>& headers)>;

  // Queues a collective. `local_error` (this rank's argument check) rides along in
  // the header so every rank fails together.
  // `inline_source`: the tensor whose bytes may ride in this rank's header message (see
  // inline_size): a broadcast root's, an all_gather's input.
  Work enqueue(std::string name, CollectiveHeader header, absl::Status local_error, Body body,
               Tensor inline_source = Tensor()) {
    auto state = std::make_shared<WorkState>(name);
    absl::MutexLock lock(&mu_);
    if (absl::Status s = usable_locked(name); !s.ok()) {
      state->complete(std::move(s));
      return Work(state);
    }
    Task task{std::move(name), state, header, std::move(local_error), std::move(body), next_seq_++,
              std::move(inline_source)};
    if (RunHereIfIdle::active() && queue_.empty() && !busy_) {
      // A blocking call with nothing ahead of it: run it on the caller's thread, which
      // saves two thread switches; the worker waits until it is done.
      busy_ = true;
      mu_.Unlock();
      absl::Status s = usable(task.name);
      if (s.ok()) s = run(task);
      state->complete(std::move(s));
      mu_.Lock();
      busy_ = false;
      return Work(state);
    }
    queue_.push_back(std::move(task));
    return Work(state);
  }

  // ---- point-to-point ------------------------------------------------------------

  // Posts a send and returns a function that waits for it; the two halves let isend
  // post on the caller's thread (keeping call order) and wait elsewhere.
  absl::StatusOr<std::function<absl::Status()>> post_send(const std::string& name, const Tensor& tensor, int dst,
                                                          uint32_t tag) {
    FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(tensor));
    auto op = std::make_shared<P2POp>();
    op->host = host;
    {
      absl::MutexLock lock(&mu_);
      op->seq = send_seq_[{dst, tag}]++;
    }
    op->header = internal::make_header(CollectiveKind::kBroadcast, &host, static_cast<int>(op->seq), ReduceOp::kSum,
                                       absl::OkStatus());
    op->header.kind = kP2PKind;
    absl::Status posted = guarded(name, [&] {
      op->header_buf = context_->createUnboundBuffer(&op->header, sizeof(CollectiveHeader));
      if (!register_buffer(op->header_buf.get())) return cancelled(name);
      op->header_buf->send(dst, p2p_header_slot(tag));
      if (host.nbytes() > 0) {
        op->data_buf = context_->createUnboundBuffer(host.data(), host.nbytes());
        if (!register_buffer(op->data_buf.get())) return cancelled(name);
        op->data_buf->send(dst, p2p_data_slot(tag, op->seq));
      }
      return absl::OkStatus();
    });
    if (!posted.ok()) {
      op->release(*this);
      return posted;
    }
    return [this, op, name]() -> absl::Status {
      absl::Status s = guarded(name, [&] {
        FERRY_RETURN_IF_ERROR(wait_send(name, op->header_buf.get()));
        if (op->data_buf) FERRY_RETURN_IF_ERROR(wait_send(name, op->data_buf.get()));
        return absl::OkStatus();
      });
      op->release(*this);
      return s;
    };
  }

  // Posts the header receive; the returned function waits for the header, then
  // receives the data it announces (into `tensor`, or drained on a mismatch).
  absl::StatusOr<std::function<absl::StatusOr<int>()>> post_recv(const std::string& name, const Tensor& tensor,
                                                                 std::optional<int> src, uint32_t tag) {
    auto op = std::make_shared<P2POp>();
    absl::Status posted = guarded(name, [&] {
      op->header_buf = context_->createUnboundBuffer(&op->header, sizeof(CollectiveHeader));
      if (!register_buffer(op->header_buf.get())) return cancelled(name);
      if (src.has_value()) {
        op->header_buf->recv(*src, p2p_header_slot(tag));
      } else {
        std::vector<int> others;
        for (int r = 0; r < size_; ++r) {
          if (r != rank_) others.push_back(r);
        }
        op->header_buf->recv(others, p2p_header_slot(tag));
      }
      return absl::OkStatus();
    });
    if (!posted.ok()) {
      op->release(*this);
      return posted;
    }
    return [this, op, name, tensor, tag]() -> absl::StatusOr<int> {
      int sender = -1;
      absl::Status s = guarded(name, [&] { return finish_recv(name, *op, tensor, tag, &sender); });
      op->release(*this);
      if (!s.ok()) return s;
      return sender;
    };
  }

  // A byte message (see ProcessGroup::send_bytes): posts the header (with the data
  // when it is small) and the data, then waits until the receiver has both.
  absl::Status send_bytes(const std::string& name, const Bytes& data, int dst, uint32_t tag,
                          std::chrono::milliseconds timeout) {
    return send_bytes(name, data.data(), data.size(), nullptr, dst, tag, timeout);
  }

  // `keep` (may be null) owns the data: with it, cancel_sends(dst) may end the wait,
  // and the message, still posted, is kept (parked_) until the context goes.
  absl::Status send_bytes(const std::string& name, const uint8_t* data, size_t size, std::shared_ptr<const Bytes> keep,
                          int dst, uint32_t tag, std::chrono::milliseconds timeout) {
    auto op = std::make_shared<PendingSend>();
    const bool cancellable = keep != nullptr;
    op->keep = std::move(keep);
    uint32_t seq = 0;
    {
      absl::MutexLock lock(&mu_);
      seq = bytes_send_seq_[{dst, tag}]++;
      if (cancellable) cancellable_[dst].insert(op);
    }
    const bool inline_data = size <= kBytesInline;
    const BytesHeader header{kBytesMagic, seq, static_cast<uint64_t>(size)};
    op->head.resize(sizeof(BytesHeader) + (inline_data ? size : 0));
    std::memcpy(op->head.data(), &header, sizeof(header));
    if (inline_data && size > 0) std::memcpy(op->head.data() + sizeof(header), data, size);
    // cancel_sends() reads the buffers under mu_: they are stored under it, and one
    // made after a cancel is aborted at once (its wait then ends at once).
    auto store = [&](std::unique_ptr<gloo::transport::UnboundBuffer>& slot,
                    std::unique_ptr<gloo::transport::UnboundBuffer> buffer) {
      absl::MutexLock lock(&mu_);
      slot = std::move(buffer);
      if (!op->why.ok()) slot->abortWaitSend();
      return slot.get();
    };
    absl::Status s = guarded_p2p(name, [&]() -> absl::Status {
      gloo::transport::UnboundBuffer* head =
          store(op->head_buf, context_->createUnboundBuffer(op->head.data(), op->head.size()));
      if (!register_buffer(head)) return cancelled(name);
      head->send(dst, bytes_header_slot(tag));
      if (!inline_data) {
        // Gloo only reads from it.
        gloo::transport::UnboundBuffer* body =
            store(op->data_buf, context_->createUnboundBuffer(const_cast<uint8_t*>(data), size));
        if (!register_buffer(body)) return cancelled(name);
        body->send(dst, bytes_data_slot(tag, seq));
      }
      if (!op->head_buf->waitSend(timeout)) return cancelled(name);
      if (op->data_buf && !op->data_buf->waitSend(timeout)) return cancelled(name);
      return absl::OkStatus();
    });
    unregister_buffer(op->head_buf.get());
    unregister_buffer(op->data_buf.get());
    absl::MutexLock lock(&mu_);
    if (cancellable) {
      auto it = cancellable_.find(dst);
      if (it != cancellable_.end()) {
        it->second.erase(op);
        if (it->second.empty()) cancellable_.erase(it);
      }
    }
    if (!s.ok() && !op->why.ok()) {
      // Cancelled: Gloo may still read the buffers, until the peer takes the message
      // or the context goes.
      parked_.push_back(op);
      return op->why;
    }
    return s;
  }

  // Ends the wait of every cancellable send to `dst` with `why` (see send_bytes).
  void cancel_sends(int dst, const absl::Status& why) {
    absl::MutexLock lock(&mu_);
    auto it = cancellable_.find(dst);
    if (it == cancellable_.end()) return;
    for (const std::shared_ptr<PendingSend>& op : it->second) {
      if (op->why.ok()) op->why = why;
      if (op->head_buf) op->head_buf->abortWaitSend();
      if (op->data_buf) op->data_buf->abortWaitSend();
    }
  }

  // recv_bytes_stream: receives stay posted for (src, tag) in a ring, consumed in
  // order (Gloo fills posted receives of one slot and peer in the order they were
  // posted), each re-posted as soon as its message is taken out.
  absl::StatusOr<ReceivedBytes> recv_bytes_stream(const std::string& name, int src, uint32_t tag,
                                                  std::chrono::milliseconds timeout) {
    std::shared_ptr<PostedRing> ring;
    {
      absl::MutexLock lock(&mu_);
      std::shared_ptr<PostedRing>& slot = rings_[{src, tag}];
      if (slot == nullptr) slot = std::make_shared<PostedRing>();
      ring = slot;
    }
    std::lock_guard<std::mutex> consumer(ring->mu);
    ReceivedBytes out;
    std::unique_ptr<gloo::transport::UnboundBuffer> data_buf;
    absl::Status s = guarded_p2p(name, [&]() -> absl::Status {
      if (ring->bufs.empty()) {
        ring->storage.resize(PostedRing::kDepth);
        for (std::vector<uint8_t>& bytes : ring->storage) {
          bytes.resize(sizeof(BytesHeader) + kBytesInline);
          ring->bufs.push_back(context_->createUnboundBuffer(bytes.data(), bytes.size()));
          if (!register_buffer(ring->bufs.back().get())) return cancelled(name);
          ring->bufs.back()->recv(src, bytes_header_slot(tag));
        }
      }
      if (!ring->failed.ok()) return ring->failed;
      const size_t i = ring->next;
      gloo::transport::UnboundBuffer* buf = ring->bufs[i].get();
      int sender = -1;
      if (!buf->waitRecv(&sender, timeout)) return cancelled(name);
      const std::vector<uint8_t>& head = ring->storage[i];
      BytesHeader header;
      std::memcpy(&header, head.data(), sizeof(header));
      if (header.magic != kBytesMagic) {
        return absl::DataLossError(absl::StrCat(name, ": the message header from rank ", sender, " is corrupt"));
      }
      out.source_rank = sender;
      const bool inline_data = header.size <= kBytesInline;
      if (inline_data) {
        out.data.assign(head.begin() + sizeof(BytesHeader),
                        head.begin() + static_cast<std::ptrdiff_t>(sizeof(BytesHeader) + header.size));
      }
      // Taken out: post it again, then move on to the next one. A peer lost just now
      // fails the re-post: this message still goes out, and the next call says why.
      absl::Status reposted = catch_gloo(name, description_, [&] {
        buf->recv(src, bytes_header_slot(tag));
        return absl::OkStatus();
      });
      if (!reposted.ok()) ring->failed = reposted;
      ring->next = (i + 1) % PostedRing::kDepth;
      if (inline_data) return absl::OkStatus();
      out.data.resize(header.size);
      data_buf = context_->createUnboundBuffer(out.data.data(), out.data.size());
      if (!register_buffer(data_buf.get())) return cancelled(name);
      data_buf->recv(sender, bytes_data_slot(tag, header.seq));
      if (!data_buf->waitRecv(nullptr, timeout_)) return cancelled(name);
      return absl::OkStatus();
    });
    unregister_buffer(data_buf.get());
    if (!s.ok()) return s;
    return out;
  }

  absl::StatusOr<ReceivedBytes> recv_bytes(const std::string& name, std::optional<int> src, uint32_t tag,
                                           std::chrono::milliseconds timeout) {
    std::vector<uint8_t> head(sizeof(BytesHeader) + kBytesInline);
    std::unique_ptr<gloo::transport::UnboundBuffer> head_buf;
    std::unique_ptr<gloo::transport::UnboundBuffer> data_buf;
    ReceivedBytes out;
    absl::Status s = guarded_p2p(name, [&]() -> absl::Status {
      head_buf = context_->createUnboundBuffer(head.data(), head.size());
      if (!register_buffer(head_buf.get())) return cancelled(name);
      if (src.has_value()) {
        head_buf->recv(*src, bytes_header_slot(tag));
      } else {
        std::vector<int> others;
        for (int r = 0; r < size_; ++r) {
          if (r != rank_) others.push_back(r);
        }
        head_buf->recv(others, bytes_header_slot(tag));
      }
      int sender = -1;
      if (!head_buf->waitRecv(&sender, timeout)) return cancelled(name);
      BytesHeader header;
      std::memcpy(&header, head.data(), sizeof(header));
      if (header.magic != kBytesMagic) {
        return absl::DataLossError(absl::StrCat(name, ": the message header from rank ", sender, " is corrupt"));
      }
      out.source_rank = sender;
      if (header.size <= kBytesInline) {
        out.data.assign(head.begin() + sizeof(BytesHeader),
                        head.begin() + static_cast<std::ptrdiff_t>(sizeof(BytesHeader) + header.size));
        return absl::OkStatus();
      }
      out.data.resize(header.size);
      data_buf = context_->createUnboundBuffer(out.data.data(), out.data.size());
      if (!register_buffer(data_buf.get())) return cancelled(name);
      data_buf->recv(sender, bytes_data_slot(tag, header.seq));
      // The sender has posted the data already: only the transfer is left to wait for.
      if (!data_buf->waitRecv(nullptr, timeout_)) return cancelled(name);
      return absl::OkStatus();
    });
    unregister_buffer(head_buf.get());
    unregister_buffer(data_buf.get());
    if (!s.ok()) return s;
    return out;
  }

  // Runs `fn` on a thread of its own (isend/irecv waiting), tracked for shutdown.
  bool spawn(std::function<void()> fn) {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    // Join the threads that have finished, so a long-lived group does not pile them up.
    for (auto it = threads_.begin(); it != threads_.end();) {
      if (it->done->load()) {
        it->thread.join();
        it = threads_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    threads_.push_back(P2PThread{std::thread([fn = std::move(fn), done] {
                                   fn();
                                   done->store(true);
                                 }),
                                 done});
    return true;
  }

  // Counts a point-to-point operation in flight, so shutdown() waits for it before
  // the context goes. Fails when the group cannot be used.
  absl::Status begin_p2p(std::string_view name) {
    absl::MutexLock lock(&mu_);
    FERRY_RETURN_IF_ERROR(usable_locked(name));
    ++p2p_in_flight_;
    return absl::OkStatus();
  }
  void end_p2p() {
    absl::MutexLock lock(&mu_);
    --p2p_in_flight_;
  }

  absl::Status usable(std::string_view name) {
    absl::MutexLock lock(&mu_);
    return usable_locked(name);
  }

  void shutdown() {
    std::deque<Task> cancelled_tasks;
    std::list<P2PThread> threads;
    absl::flat_hash_map<std::pair<int, uint32_t>, std::shared_ptr<PostedRing>> rings;
    {
      absl::MutexLock lock(&mu_);
      if (closed_) {
        // A concurrent shutdown() is doing the work; wait for it to finish.
        mu_.Await(absl::Condition(&shut_down_));
        return;
      }
      closed_ = true;
      cancelled_tasks.swap(queue_);
      for (gloo::transport::UnboundBuffer* buf : buffers_) {
        buf->abortWaitSend();
        buf->abortWaitRecv();
      }
    }
    for (Task& task : cancelled_tasks) {
      task.state->complete(absl::CancelledError(
          absl::StrCat(task.name, ": the process group (", description_, ") was shut down before it ran")));
    }
    if (worker_.joinable()) worker_.join();
    {
      // A collective running on a blocking caller's thread (enqueue) ends too: its
      // Gloo operation and its wait for headers (which cannot be aborted: see
      // HeaderSlots) are bounded by the timeout.
      absl::MutexLock lock(&mu_);
      auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !busy_; };
      mu_.Await(absl::Condition(&idle));
    }
    // No collective runs any more: the header slots go, before the pairs they name.
    slots_ = HeaderSlots{};
    header_context_.reset();
    {
      absl::MutexLock lock(&mu_);
      auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return p2p_in_flight_ == 0; };
      mu_.Await(absl::Condition(&idle));
      threads.swap(threads_);
      rings.swap(rings_);
    }
    for (P2PThread& t : threads) t.thread.join();
    for (auto& [key, ring] : rings) {
      for (auto& buf : ring->bufs) unregister_buffer(buf.get());
    }
    rings.clear();
    // Every user of the context is gone; closing it closes the connections. Cancelled
    // sends' buffers hold the transport context too: they go with it.
    std::vector<std::shared_ptr<PendingSend>> parked;
    {
      absl::MutexLock lock(&mu_);
      parked.swap(parked_);
    }
    context_.reset();
    parked.clear();
    absl::MutexLock lock(&mu_);
    shut_down_ = true;
  }

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

  struct P2PThread {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };

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

  // OK, or why `name` cannot run now. Called with mu_ held.
  absl::Status usable_locked(std::string_view name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (closed_) {
      return absl::FailedPreconditionError(
          absl::StrCat(internal::av(name), ": the process group (", description_, ") was shut down"));
    }
    if (!broken_.ok()) {
      return absl::FailedPreconditionError(absl::StrCat(internal::av(name), ": the process group (", description_,
                                                        ") is broken by an earlier error: ", broken_.message()));
    }
    return absl::OkStatus();
  }

  absl::Status cancelled(std::string_view name) const {
    return absl::CancelledError(
        absl::StrCat(internal::av(name), ": the process group (", description_, ") was shut down"));
  }

  // Runs a Gloo step; an exception from it means the transport is in an unknown state
  // (Gloo's own advice: recreate the pairs), so it breaks the group for later calls.
  template <typename Fn>
  absl::Status guarded(std::string_view name, Fn&& fn) {
    bool threw = true;
    absl::Status s = catch_gloo(name, description_, [&] {
      absl::Status r = fn();
      threw = false;
      return r;
    });
    return threw ? break_group(std::move(s)) : s;
  }

  // Like guarded(), for byte messages: a connection lost to one peer fails only that
  // operation (Gloo's pairs are independent), while a timeout breaks the group, since
  // Gloo then closes every connection of the context.
  template <typename Fn>
  absl::Status guarded_p2p(std::string_view name, Fn&& fn) {
    absl::Status s = catch_gloo(name, description_, std::forward<Fn>(fn));
    return absl::IsDeadlineExceeded(s) ? break_group(std::move(s)) : s;
  }

  // Breaks the group with `s`, unless an earlier error already did, and returns `s`.
  absl::Status break_group(absl::Status s) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = s;
    return s;
  }

  bool register_buffer(gloo::transport::UnboundBuffer* buf) {
    absl::MutexLock lock(&mu_);
    if (closed_) return false;
    buffers_.insert(buf);
    return true;
  }
  void unregister_buffer(gloo::transport::UnboundBuffer* buf) {
    if (buf == nullptr) return;
    absl::MutexLock lock(&mu_);
    buffers_.erase(buf);
  }

  absl::Status wait_send(std::string_view name, gloo::transport::UnboundBuffer* buf) {
    if (!buf->waitSend(timeout_)) return cancelled(name);
    return absl::OkStatus();
  }
  absl::Status wait_recv(std::string_view name, gloo::transport::UnboundBuffer* buf, int* sender) {
    if (!buf->waitRecv(sender, timeout_)) return cancelled(name);
    return absl::OkStatus();
  }

  absl::Status finish_recv(const std::string& name, P2POp& op, const Tensor& tensor, uint32_t tag, int* sender) {
    FERRY_RETURN_IF_ERROR(wait_recv(name, op.header_buf.get(), sender));
    const CollectiveHeader& h = op.header;
    FERRY_RETURN_IF_ERROR(internal::validate_p2p_header(h, kP2PKind, *sender, name));
    const size_t incoming = static_cast<size_t>(h.numel) * dtype_size(static_cast<DType>(h.dtype));
    const CollectiveHeader mine =
        internal::make_header(CollectiveKind::kBroadcast, &tensor, 0, ReduceOp::kSum, absl::OkStatus());
    const bool matches = h.dtype == mine.dtype && h.ndim == mine.ndim && h.numel == mine.numel &&
                         h.shape_hash == mine.shape_hash;
    Tensor host;
    void* target = nullptr;
    if (matches) {
      FERRY_ASSIGN_OR_RETURN(host, host_output(tensor));
      target = host.data();
    } else {
      // Take the data anyway, so the sender completes and the next message from it
      // is not stuck behind this one.
      op.drain.resize(std::max<size_t>(incoming, 1));
      target = op.drain.data();
    }
    if (incoming > 0) {
      op.data_buf = context_->createUnboundBuffer(target, incoming);
      if (!register_buffer(op.data_buf.get())) return cancelled(name);
      op.data_buf->recv(*sender, p2p_data_slot(tag, static_cast<uint32_t>(h.root)));
      FERRY_RETURN_IF_ERROR(wait_recv(name, op.data_buf.get(), nullptr));
    }
    if (!matches) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": the tensor from rank ", *sender, " is ", dtype_name(static_cast<DType>(h.dtype)), " ",
          internal::header_shape_string(h), " but the receiving tensor is ", dtype_name(tensor.dtype()), " ",
          internal::shape_string(tensor.shape())));
    }
    return write_back(tensor, host);
  }

  void worker_loop() {
    for (;;) {
      Task task;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return (!queue_.empty() && !busy_) || closed_; };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
        busy_ = true;
      }
      absl::Status s = usable(task.name);
      if (s.ok()) s = run(task);
      task.state->complete(std::move(s));
      absl::MutexLock lock(&mu_);
      busy_ = false;
    }
  }

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
  absl::Status run(Task& task) {
    const uint64_t sig = signature(task.header);
    const uint32_t tag = internal::data_tag(sig, task.seq);
    if (size_ == 1) {
      FERRY_RETURN_IF_ERROR(internal::check_headers({task.header}, task.local_error));
      return guarded(task.name, [&] { return task.body(*this, tag, {task.header}); });
    }
    // Only the thread running a collective (one at a time) touches slots_ and agreed_;
    // shutdown() clears them once none runs.
    if (slots_.send.empty()) return cancelled(task.name);
    current_entry_ = task.seq % kHeaderRing;
    const size_t entry = current_entry_;
    const std::optional<uint64_t> agreed = agreed_;
    agreed_.reset();  // set again below once every rank's headers agree
    // A collective whose data rides in the header messages moves no data through Gloo:
    // it never goes ahead, and is never agreed on as a signature to go ahead with.
    const bool moves_gloo_data = moves_data(task.header) && !is_inline(task.header);
    const bool early = moves_gloo_data && agreed == sig;
    std::vector<CollectiveHeader> headers(size_);
    headers[rank_] = task.header;
    absl::Cleanup cleared = [&] { clear_inbox(entry, headers); };
    const size_t inline_size = inline_bytes(task.header, rank_);
    uint8_t* out = &slots_.outbox[entry * kSlotBytes];
    std::memcpy(out, &task.header, sizeof(CollectiveHeader));
    if (inline_size > 0) {
      absl::StatusOr<Tensor> host = host_input(task.inline_source);
      // The header already promises the bytes: without them this rank cannot take part.
      if (!host.ok()) return fail_group(task.name, host.status());
      std::memcpy(out + sizeof(CollectiveHeader), host->data(), inline_size);
    }
    const uint64_t trailer = uint64_t{task.seq} + 1;
    std::memcpy(out + sizeof(CollectiveHeader) + inline_size, &trailer, sizeof(trailer));
    absl::Status s = guarded(task.name, [&] {
      for (int r = 0; r < size_; ++r) {
        if (r != rank_) {
          slots_.send[slot_index(r, entry)]->send(0, sizeof(CollectiveHeader) + inline_size + sizeof(trailer));
        }
      }
      return absl::OkStatus();
    });
    absl::Status data;
    if (early && s.ok()) data = guarded(task.name, [&] { return task.body(*this, tag, {}); });
    if (s.ok()) s = wait_headers(task.name, task.seq, headers);
    if (!s.ok()) {
      if (early && !data.ok()) return data;
      return s;
    }
    absl::Status verdict = internal::check_headers(headers, task.local_error);
    if (!early && agreed.has_value()) {
      // Ranks that went ahead are waiting in their operation: take part in it.
      for (int r = 0; r < size_; ++r) {
        const CollectiveHeader& h = headers[r];
        if (r == rank_ || !internal::validate_header(h, static_cast<size_t>(r), static_cast<size_t>(size_)).ok() ||
            !moves_data(h) || is_inline(h) || signature(h) != *agreed) {
          continue;
        }
        absl::Status stand_in =
            guarded(task.name, [&] { return run_stand_in(h, internal::data_tag(*agreed, task.seq)); });
        if (!stand_in.ok()) {
          FERRY_LOG(INFO) << task.name << " (" << description_ << "): standing in for a mismatched rank: " << stand_in;
        }
        break;
      }
    }
    if (!verdict.ok()) return verdict;
    if (moves_gloo_data) agreed_ = sig;
    if (early) return data;
    return guarded(task.name, [&] { return task.body(*this, tag, headers); });
  }

  // Breaks the group with `why` (the first error wins) and returns it, naming `name`.
  absl::Status fail_group(std::string_view name, const absl::Status& why) {
    return break_group(
        absl::Status(why.code(), absl::StrCat(internal::av(name), " (", description_, "): ", why.message())));
  }

  // Waits for every other rank's header of the running collective, number `seq` (in
  // ring entry current_entry_), and copies it into `headers`, and for this rank's to
  // have gone out, within the group's timeout (the pairs' own, set at connect).
  absl::Status wait_headers(const std::string& name, uint32_t seq, std::vector<CollectiveHeader>& headers) {
    const size_t entry = current_entry_;
    const uint64_t expected = uint64_t{seq} + 1;
    bool timed_out = false;
    absl::Status s = catch_gloo(name, description_, [&]() -> absl::Status {
      try {
        for (int r = 0; r < size_; ++r) {
          if (r == rank_) continue;
          const uint8_t* in = &slots_.inbox[slot_index(r, entry) * kSlotBytes];
          try {
            slots_.recv[slot_index(r, entry)]->waitRecv();
          } catch (const gloo::IoException&) {
            // Gloo's wait reports a connection's end even when the message arrived
            // before it (a peer that finished this collective and exited): a whole
            // message still counts.
            if (trailer_of(in, r) != expected) throw;
          }
          if (const uint64_t got = trailer_of(in, r); got != expected) {
            return absl::InternalError(absl::StrCat(name, " (", description_, "): rank ", r,
                                                    " sent the header of collective ", got - 1, " where ", seq,
                                                    " was due"));
          }
          std::memcpy(&headers[r], in, sizeof(CollectiveHeader));
        }
        for (int r = 0; r < size_; ++r) {
          if (r != rank_) slots_.send[slot_index(r, entry)]->waitSend();
        }
      } catch (const gloo::IoException& e) {
        timed_out = looks_like_timeout(e.what());
        throw;
      }
      return absl::OkStatus();
    });
    if (s.ok()) return s;
    if (timed_out) {
      s = absl::DeadlineExceededError(absl::StrCat(name, " (", description_, "): timed out after ", timeout_.count(),
                                                   " ms waiting for every rank's arguments (has every rank called it?)"));
    }
    return break_group(std::move(s));
  }

  static constexpr std::string_view kExchangeName = "collective header exchange";
  // How many collectives' headers the ring holds. Two suffice: a rank sends collective
  // k+2's header only after every rank's header of k+1 reached it, so every rank has
  // started k+1 and has taken k's headers out of its slots.
  static constexpr size_t kHeaderRing = 2;

  size_t slot_index(int peer, size_t entry) const { return static_cast<size_t>(peer) * kHeaderRing + entry; }

  // How many bytes of data ride in `sender`'s message with header `h` (see
  // inline_size): all of them for an all_gather, the root's for a broadcast.
  static size_t inline_bytes(const CollectiveHeader& h, int sender) {
    if (h.kind == static_cast<uint8_t>(CollectiveKind::kBroadcast) && h.root != sender) return 0;
    return inline_size(h);
  }

 public:
  // The size of the tensor a broadcast or an all_gather with header `h` moves when it
  // fits kInlineBytes, else 0. Such a collective needs no Gloo operation: the data rides
  // in the header messages (a broadcast's root's; every all_gather input).
  static size_t inline_size(const CollectiveHeader& h) {
    if (h.magic != CollectiveHeader::kMagic || h.has_error != 0 ||
        (h.kind != static_cast<uint8_t>(CollectiveKind::kBroadcast) &&
         h.kind != static_cast<uint8_t>(CollectiveKind::kAllGather)) ||
        !is_valid_dtype(h.dtype) || h.numel <= 0 || static_cast<uint64_t>(h.numel) > kInlineBytes) {
      return 0;
    }
    const uint64_t n = static_cast<uint64_t>(h.numel) * dtype_size(static_cast<DType>(h.dtype));
    return n <= kInlineBytes ? static_cast<size_t>(n) : 0;
  }
  static bool is_inline(const CollectiveHeader& h) { return inline_size(h) > 0; }

  // The bytes that rode in `sender`'s message of the running collective (is_inline);
  // the thread running the collective reads them from its body.
  const uint8_t* inline_data(int sender) const {
    return &slots_.inbox[slot_index(sender, current_entry_) * kSlotBytes + sizeof(CollectiveHeader)];
  }

 private:
  // The trailer of a message from `sender` in a slot (see HeaderSlots); 0 when the
  // header there is not whole.
  uint64_t trailer_of(const uint8_t* in, int sender) const {
    CollectiveHeader h;
    std::memcpy(&h, in, sizeof(h));
    uint64_t trailer;
    std::memcpy(&trailer, in + sizeof(CollectiveHeader) + inline_bytes(h, sender), sizeof(trailer));
    return trailer;
  }

  // Clears ring entry `entry` of every peer's inbox, once its collective has ended: a
  // later message of another length must not find a stale trailer (or stale bytes that
  // look like one) where its own goes.
  void clear_inbox(size_t entry, const std::vector<CollectiveHeader>& headers) {
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      uint8_t* in = &slots_.inbox[slot_index(r, entry) * kSlotBytes];
      std::memset(in, 0, sizeof(CollectiveHeader) + inline_bytes(headers[r], r) + sizeof(uint64_t));
    }
  }

  // Makes slots_ (see HeaderSlots). Every rank takes the same slot numbers from the
  // context. On each connection, messages to the higher rank and those to the lower
  // one use different slots: destroying any buffer of a slot makes Gloo forget that
  // slot's receive buffer on the pair.
  absl::Status make_header_slots() {
    const int up = header_context_->nextSlot(2 * kHeaderRing);  // slots of headers sent to a higher rank
    const int down = up + static_cast<int>(kHeaderRing);  // and to a lower one
    const size_t n = static_cast<size_t>(size_) * kHeaderRing;
    slots_.inbox.resize(n * kSlotBytes);
    slots_.outbox.resize(kHeaderRing * kSlotBytes);
    slots_.recv.resize(n);
    slots_.send.resize(n);
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const std::unique_ptr<gloo::transport::Pair>& pair = header_context_->getPair(r);
      for (size_t e = 0; e < kHeaderRing; ++e) {
        const size_t i = slot_index(r, e);
        const int offset = static_cast<int>(e);
        slots_.recv[i] =
            pair->createRecvBuffer((r < rank_ ? up : down) + offset, &slots_.inbox[i * kSlotBytes], kSlotBytes);
        slots_.send[i] =
            pair->createSendBuffer((r > rank_ ? up : down) + offset, &slots_.outbox[e * kSlotBytes], kSlotBytes);
      }
    }
    return absl::OkStatus();
  }

  // Runs the data operation a rank with header `h` runs, on tag `tag`, with scratch
  // buffers (collectives.cc).
  absl::Status run_stand_in(const CollectiveHeader& h, uint32_t tag);

  const int rank_;
  const int size_;
  const std::chrono::milliseconds timeout_;
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
  std::list<P2PThread> threads_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<int, uint32_t>, std::shared_ptr<PostedRing>> rings_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<int, std::set<std::shared_ptr<PendingSend>>> cancellable_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<PendingSend>> parked_ ABSL_GUARDED_BY(mu_);
};

// A non-member handle, a shut-down group or a broken one cannot run anything; the
// collective's own argument checks ride in its header instead (see enqueue).
#define FERRY_PG_MEMBER_OR_RETURN_WORK(name)                                 \
  do {                                                                        \
    if (!is_member()) return Work::completed(name, not_member_error(name, ranks_)); \
  } while (0)

}  // namespace ferry
