#include "process_group/process_group.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <list>
#include <set>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
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

namespace ferry {

using internal::CollectiveHeader;
using internal::CollectiveKind;
using internal::WorkState;

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kProduct: return "product";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
  }
  return "unknown";
}

namespace {

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

uint64_t bytes_header_slot(uint32_t tag) { return (kBytesHeaderPrefix << 56) | (static_cast<uint64_t>(tag) << 24); }
uint64_t bytes_data_slot(uint32_t tag, uint32_t seq) {
  return (kBytesDataPrefix << 56) | (static_cast<uint64_t>(tag) << 24) | (seq & 0xffffffu);
}

uint64_t p2p_header_slot(uint32_t tag) { return (kP2PHeaderPrefix << 56) | (static_cast<uint64_t>(tag) << 24); }
uint64_t p2p_data_slot(uint32_t tag, uint32_t seq) {
  return (kP2PDataPrefix << 56) | (static_cast<uint64_t>(tag) << 24) | (seq & 0xffffffu);
}

// Gloo prefixes its messages with "[file:line] " (and EnforceNotMet with
// "[enforce fail at file:line] "); those belong in logs, not in users' errors.
std::string strip_location(std::string_view text) {
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

bool looks_like_timeout(std::string_view text) {
  const std::string lower = absl::AsciiStrToLower(internal::av(text));
  return absl::StrContains(lower, "timed out") || absl::StrContains(lower, "timeout");
}

// The status for an exception thrown by Gloo (or the store adapter) during `what`.
absl::Status status_from_exception(std::string_view what, std::string_view context, std::string_view raw,
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
absl::Status catch_gloo(std::string_view what, std::string_view context, Fn&& fn) {
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
absl::StatusOr<Tensor> host_input(const Tensor& t) { return t.to(Device::cpu()); }

// Host memory for results bound for `t`: itself on the CPU, else fresh host memory.
absl::StatusOr<Tensor> host_output(const Tensor& t) {
  if (t.device().is_cpu()) return t;
  return Tensor::empty(t.shape(), t.dtype(), Device::cpu());
}

// Copies `bytes` of host memory at `src` into `dst`'s storage (any device).
absl::Status copy_from_host(const Tensor& dst, const void* src, size_t bytes) {
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
absl::Status write_back(const Tensor& t, const Tensor& host) { return copy_from_host(t, host.data(), t.nbytes()); }

std::string ranks_string(const std::vector<int>& ranks) { return absl::StrCat("[", absl::StrJoin(ranks, ", "), "]"); }

absl::Status not_member_error(std::string_view name, const std::vector<int>& ranks) {
  return absl::FailedPreconditionError(absl::StrCat(internal::av(name), ": this process is not a member of the group ",
                                                    ranks_string(ranks),
                                                    " (new_group left it out); only members may use it"));
}

}  // namespace

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

  // Rendezvous with the other ranks through `store` and connect to each of them.
  absl::Status connect(const std::shared_ptr<Store>& store) {
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
    context_ = std::move(context);
    worker_ = std::thread([this] { worker_loop(); });
    return absl::OkStatus();
  }

  // ---- collectives ---------------------------------------------------------------

  // What a queued collective does once its turn comes: with every rank's header
  // already checked, moves the data using Gloo tag `tag`.
  using Body = std::function<absl::Status(Impl& impl, uint32_t tag, const std::vector<CollectiveHeader>& headers)>;

  // Queues a collective. `local_error` (this rank's argument check) rides along in
  // the header so every rank fails together.
  Work enqueue(std::string name, CollectiveHeader header, absl::Status local_error, Body body) {
    auto state = std::make_shared<WorkState>(name);
    absl::MutexLock lock(&mu_);
    if (absl::Status s = usable_locked(name); !s.ok()) {
      state->complete(std::move(s));
      return Work(state);
    }
    Task task{std::move(name), state, header, std::move(local_error), std::move(body), next_tag_};
    // Two tags per collective: the header exchange and the operation itself (an
    // all_gather's data would otherwise share the header's Gloo slot).
    next_tag_ += 2;
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
    uint32_t seq = 0;
    {
      absl::MutexLock lock(&mu_);
      seq = bytes_send_seq_[{dst, tag}]++;
    }
    const bool inline_data = data.size() <= kBytesInline;
    const BytesHeader header{kBytesMagic, seq, static_cast<uint64_t>(data.size())};
    std::vector<uint8_t> head(sizeof(BytesHeader) + (inline_data ? data.size() : 0));
    std::memcpy(head.data(), &header, sizeof(header));
    if (inline_data && !data.empty()) std::memcpy(head.data() + sizeof(header), data.data(), data.size());
    std::unique_ptr<gloo::transport::UnboundBuffer> head_buf;
    std::unique_ptr<gloo::transport::UnboundBuffer> data_buf;
    absl::Status s = guarded_p2p(name, [&]() -> absl::Status {
      head_buf = context_->createUnboundBuffer(head.data(), head.size());
      if (!register_buffer(head_buf.get())) return cancelled(name);
      head_buf->send(dst, bytes_header_slot(tag));
      if (!inline_data) {
        // Gloo only reads from it.
        data_buf = context_->createUnboundBuffer(const_cast<uint8_t*>(data.data()), data.size());
        if (!register_buffer(data_buf.get())) return cancelled(name);
        data_buf->send(dst, bytes_data_slot(tag, seq));
      }
      if (!head_buf->waitSend(timeout)) return cancelled(name);
      if (data_buf && !data_buf->waitSend(timeout)) return cancelled(name);
      return absl::OkStatus();
    });
    unregister_buffer(head_buf.get());
    unregister_buffer(data_buf.get());
    return s;
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
      absl::MutexLock lock(&mu_);
      auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return p2p_in_flight_ == 0; };
      mu_.Await(absl::Condition(&idle));
      threads.swap(threads_);
    }
    for (P2PThread& t : threads) t.thread.join();
    // Every user of the context is gone; closing it closes the connections.
    context_.reset();
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
    uint32_t tag;
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
    if (threw) {
      absl::MutexLock lock(&mu_);
      if (broken_.ok()) broken_ = s;
    }
    return s;
  }

  // Like guarded(), for byte messages: a connection lost to one peer fails only that
  // operation (Gloo's pairs are independent), while a timeout breaks the group, since
  // Gloo then closes every connection of the context.
  template <typename Fn>
  absl::Status guarded_p2p(std::string_view name, Fn&& fn) {
    absl::Status s = catch_gloo(name, description_, std::forward<Fn>(fn));
    if (absl::IsDeadlineExceeded(s)) {
      absl::MutexLock lock(&mu_);
      if (broken_.ok()) broken_ = s;
    }
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
    if (h.magic != CollectiveHeader::kMagic || h.kind != kP2PKind || !is_valid_dtype(h.dtype) || h.numel < 0) {
      return absl::InternalError(absl::StrCat(name, ": the message header from rank ", *sender, " is corrupt"));
    }
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
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !queue_.empty() || closed_; };
        mu_.Await(absl::Condition(&ready));
        if (queue_.empty()) return;
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      absl::Status s = usable(task.name);
      if (s.ok()) s = run(task);
      task.state->complete(std::move(s));
    }
  }

  absl::Status run(Task& task) {
    return guarded(task.name, [&]() -> absl::Status {
      // The header exchange: an all-gather of every rank's header. It is also a
      // barrier: no rank passes it before every rank has entered the collective.
      std::vector<CollectiveHeader> headers(size_);
      gloo::AllgatherOptions opts(context_);
      opts.setInput<uint8_t>(reinterpret_cast<uint8_t*>(&task.header), sizeof(CollectiveHeader));
      opts.setOutput<uint8_t>(reinterpret_cast<uint8_t*>(headers.data()), sizeof(CollectiveHeader) * size_);
      opts.setTag(task.tag);
      opts.setTimeout(timeout_);
      gloo::allgather(opts);
      FERRY_RETURN_IF_ERROR(internal::check_headers(headers, task.local_error));
      return task.body(*this, task.tag + 1, headers);
    });
  }

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
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 0;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<int, uint32_t>, uint32_t> send_seq_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<std::pair<int, uint32_t>, uint32_t> bytes_send_seq_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<gloo::transport::UnboundBuffer*> buffers_ ABSL_GUARDED_BY(mu_);
  int p2p_in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  std::list<P2PThread> threads_ ABSL_GUARDED_BY(mu_);
};

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

// ---- collectives -------------------------------------------------------------------

namespace {

absl::Status check_tensor(std::string_view name, std::string_view what, const Tensor& t) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(internal::av(name), ": ", internal::av(what),
                                                                   " is undefined"));
  return absl::OkStatus();
}

absl::Status check_root(std::string_view name, std::string_view what, int root, int size) {
  if (root < 0 || root >= size) {
    return absl::InvalidArgumentError(absl::StrCat(internal::av(name), ": ", internal::av(what), " ", root,
                                                   " is out of range for a group of ", size, " ranks"));
  }
  return absl::OkStatus();
}

// Checks a list of world-size tensors that must each look like `like`.
absl::Status check_list(std::string_view name, std::string_view list_name, const std::vector<Tensor>& list,
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

}  // namespace

// A non-member handle, a shut-down group or a broken one cannot run anything; the
// collective's own argument checks ride in its header instead (see enqueue).
#define FERRY_PG_MEMBER_OR_RETURN_WORK(name)                                 \
  do {                                                                        \
    if (!is_member()) return Work::completed(name, not_member_error(name, ranks_)); \
  } while (0)

Work ProcessGroup::broadcast_async(Tensor tensor, int src) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("broadcast");
  absl::Status local = check_tensor("broadcast", "the tensor", tensor);
  if (local.ok()) local = check_root("broadcast", "src", src, world_size_);
  CollectiveHeader h = internal::make_header(CollectiveKind::kBroadcast, &tensor, src, ReduceOp::kSum, local);
  return impl_->enqueue("broadcast", h, local, [tensor, src](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
    if (tensor.nbytes() == 0) return absl::OkStatus();
    const bool root = impl.rank() == src;
    FERRY_ASSIGN_OR_RETURN(Tensor host, root ? host_input(tensor) : host_output(tensor));
    gloo::BroadcastOptions opts(impl.context_);
    opts.setRoot(src);
    opts.setOutput<uint8_t>(static_cast<uint8_t*>(host.data()), host.nbytes());
    opts.setTag(tag);
    opts.setTimeout(impl.context_->getTimeout());
    gloo::broadcast(opts);
    return root ? absl::OkStatus() : write_back(tensor, host);
  });
}

absl::Status ProcessGroup::broadcast(Tensor tensor, int src) { return broadcast_async(std::move(tensor), src).wait(); }

Work ProcessGroup::all_reduce_async(Tensor tensor, ReduceOp op) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("all_reduce");
  absl::Status local = check_tensor("all_reduce", "the tensor", tensor);
  internal::ReduceFn fn = nullptr;
  if (local.ok()) {
    absl::StatusOr<internal::ReduceFn> f = internal::reduce_function(tensor.dtype(), op, "all_reduce");
    if (f.ok()) fn = *f;
    else local = f.status();
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kAllReduce, &tensor, 0, op, local);
  return impl_->enqueue("all_reduce", h, local, [tensor, fn](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
    if (tensor.numel() == 0) return absl::OkStatus();
    FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(tensor));
    gloo::AllreduceOptions opts(impl.context_);
    visit_dtype(host.dtype(), [&]<typename T>() {
      opts.setOutput<T>(static_cast<T*>(host.data()), static_cast<size_t>(host.numel()));
    });
    opts.setReduceFunction(fn);
    opts.setTag(tag);
    opts.setTimeout(impl.context_->getTimeout());
    gloo::allreduce(opts);
    return write_back(tensor, host);
  });
}

absl::Status ProcessGroup::all_reduce(Tensor tensor, ReduceOp op) {
  return all_reduce_async(std::move(tensor), op).wait();
}

Work ProcessGroup::reduce_async(Tensor tensor, int dst, ReduceOp op) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("reduce");
  absl::Status local = check_tensor("reduce", "the tensor", tensor);
  if (local.ok()) local = check_root("reduce", "dst", dst, world_size_);
  internal::ReduceFn fn = nullptr;
  if (local.ok()) {
    absl::StatusOr<internal::ReduceFn> f = internal::reduce_function(tensor.dtype(), op, "reduce");
    if (f.ok()) fn = *f;
    else local = f.status();
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kReduce, &tensor, dst, op, local);
  return impl_->enqueue("reduce", h, local, [tensor, dst, fn](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
    if (tensor.numel() == 0) return absl::OkStatus();
    const bool root = impl.rank() == dst;
    FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(tensor));
    // Gloo's reduce uses its output as scratch on every rank: give the other ranks a
    // scratch output, so their tensors stay as they were.
    Tensor scratch;
    if (!root) {
      FERRY_ASSIGN_OR_RETURN(scratch, Tensor::empty(host.shape(), host.dtype(), Device::cpu()));
    }
    gloo::ReduceOptions opts(impl.context_);
    const size_t n = static_cast<size_t>(host.numel());
    visit_dtype(host.dtype(), [&]<typename T>() {
      if (root) {
        opts.setOutput<T>(static_cast<T*>(host.data()), n);
      } else {
        opts.setInput<T>(static_cast<T*>(host.data()), n);
        opts.setOutput<T>(static_cast<T*>(scratch.data()), n);
      }
    });
    opts.setRoot(dst);
    opts.setReduceFunction(fn);
    opts.setTag(tag);
    opts.setTimeout(impl.context_->getTimeout());
    gloo::reduce(opts);
    return root ? write_back(tensor, host) : absl::OkStatus();
  });
}

absl::Status ProcessGroup::reduce(Tensor tensor, int dst, ReduceOp op) {
  return reduce_async(std::move(tensor), dst, op).wait();
}

namespace {

// All-gathers `input` (host) into `flat` (host, world * input.nbytes() bytes).
void gloo_all_gather(const std::shared_ptr<gloo::Context>& context, const Tensor& input, void* flat, uint32_t tag) {
  gloo::AllgatherOptions opts(context);
  opts.setInput<uint8_t>(static_cast<uint8_t*>(input.data()), input.nbytes());
  opts.setOutput<uint8_t>(static_cast<uint8_t*>(flat), input.nbytes() * context->size);
  opts.setTag(tag);
  opts.setTimeout(context->getTimeout());
  gloo::allgather(opts);
}

}  // namespace

Work ProcessGroup::all_gather_async(std::vector<Tensor> outputs, Tensor input) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("all_gather");
  absl::Status local = check_tensor("all_gather", "the input tensor", input);
  if (local.ok()) local = check_list("all_gather", "outputs", outputs, input, world_size_);
  CollectiveHeader h = internal::make_header(CollectiveKind::kAllGather, &input, 0, ReduceOp::kSum, local);
  return impl_->enqueue("all_gather", h, local,
                        [outputs = std::move(outputs), input](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
                          const size_t n = input.nbytes();
                          if (n == 0) return absl::OkStatus();
                          FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(input));
                          FERRY_ASSIGN_OR_RETURN(
                              Tensor flat, Tensor::empty({static_cast<int64_t>(n) * impl.size()}, DType::kUInt8));
                          gloo_all_gather(impl.context_, host, flat.data(), tag);
                          for (int r = 0; r < impl.size(); ++r) {
                            FERRY_RETURN_IF_ERROR(
                                copy_from_host(outputs[r], static_cast<const uint8_t*>(flat.data()) + r * n, n));
                          }
                          return absl::OkStatus();
                        });
}

absl::Status ProcessGroup::all_gather(std::vector<Tensor> outputs, Tensor input) {
  return all_gather_async(std::move(outputs), std::move(input)).wait();
}

Work ProcessGroup::all_gather_into_tensor_async(Tensor output, Tensor input) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("all_gather_into_tensor");
  absl::Status local = check_tensor("all_gather_into_tensor", "the input tensor", input);
  if (local.ok()) local = check_tensor("all_gather_into_tensor", "the output tensor", output);
  if (local.ok() && (output.dtype() != input.dtype() || output.numel() != input.numel() * world_size_)) {
    local = absl::InvalidArgumentError(absl::StrCat(
        "all_gather_into_tensor: the output is ", dtype_name(output.dtype()), " with ", output.numel(),
        " elements; expected ", dtype_name(input.dtype()), " with ", input.numel() * world_size_,
        " (world size x the input's ", input.numel(), ")"));
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kAllGather, &input, 0, ReduceOp::kSum, local);
  return impl_->enqueue("all_gather_into_tensor", h, local,
                        [output, input](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
                          if (input.nbytes() == 0) return absl::OkStatus();
                          FERRY_ASSIGN_OR_RETURN(Tensor host_in, host_input(input));
                          FERRY_ASSIGN_OR_RETURN(Tensor host_out, host_output(output));
                          gloo_all_gather(impl.context_, host_in, host_out.data(), tag);
                          return write_back(output, host_out);
                        });
}

absl::Status ProcessGroup::all_gather_into_tensor(Tensor output, Tensor input) {
  return all_gather_into_tensor_async(std::move(output), std::move(input)).wait();
}

Work ProcessGroup::gather_async(Tensor input, std::vector<Tensor> gather_list, int dst) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("gather");
  absl::Status local = check_tensor("gather", "the input tensor", input);
  if (local.ok()) local = check_root("gather", "dst", dst, world_size_);
  if (local.ok()) {
    if (rank_ == dst) {
      if (gather_list.empty()) {
        local = absl::InvalidArgumentError("gather: gather_list is a required argument in gather destination");
      } else {
        local = check_list("gather", "gather_list", gather_list, input, world_size_);
      }
    } else if (!gather_list.empty()) {
      local = absl::InvalidArgumentError(absl::StrCat(
          "gather: non-empty gather_list can be given only to gather destination (dst is ", dst, ", this is rank ",
          rank_, ")"));
    }
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kGather, &input, dst, ReduceOp::kSum, local);
  return impl_->enqueue(
      "gather", h, local,
      [input, gather_list = std::move(gather_list), dst](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
        const size_t n = input.nbytes();
        if (n == 0) return absl::OkStatus();
        FERRY_ASSIGN_OR_RETURN(Tensor host, host_input(input));
        const bool root = impl.rank() == dst;
        Tensor flat;
        if (root) {
          FERRY_ASSIGN_OR_RETURN(flat, Tensor::empty({static_cast<int64_t>(n) * impl.size()}, DType::kUInt8));
        }
        gloo::GatherOptions opts(impl.context_);
        opts.setInput<uint8_t>(static_cast<uint8_t*>(host.data()), n);
        if (root) opts.setOutput<uint8_t>(static_cast<uint8_t*>(flat.data()), n * impl.size());
        opts.setRoot(dst);
        opts.setTag(tag);
        opts.setTimeout(impl.context_->getTimeout());
        gloo::gather(opts);
        if (root) {
          for (int r = 0; r < impl.size(); ++r) {
            FERRY_RETURN_IF_ERROR(copy_from_host(gather_list[r], static_cast<const uint8_t*>(flat.data()) + r * n, n));
          }
        }
        return absl::OkStatus();
      });
}

absl::Status ProcessGroup::gather(Tensor input, std::vector<Tensor> gather_list, int dst) {
  return gather_async(std::move(input), std::move(gather_list), dst).wait();
}

Work ProcessGroup::scatter_async(Tensor output, std::vector<Tensor> scatter_list, int src) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("scatter");
  absl::Status local = check_tensor("scatter", "the output tensor", output);
  if (local.ok()) local = check_root("scatter", "src", src, world_size_);
  if (local.ok()) {
    if (rank_ == src) {
      if (scatter_list.empty()) {
        local = absl::InvalidArgumentError("scatter: scatter_list is a required argument in scatter source");
      } else {
        local = check_list("scatter", "scatter_list", scatter_list, output, world_size_);
      }
    } else if (!scatter_list.empty()) {
      local = absl::InvalidArgumentError(absl::StrCat(
          "scatter: non-empty scatter_list can be given only to scatter source (src is ", src, ", this is rank ",
          rank_, ")"));
    }
  }
  CollectiveHeader h = internal::make_header(CollectiveKind::kScatter, &output, src, ReduceOp::kSum, local);
  return impl_->enqueue(
      "scatter", h, local,
      [output, scatter_list = std::move(scatter_list), src](Impl& impl, uint32_t tag, const auto&) -> absl::Status {
        const size_t n = output.nbytes();
        if (n == 0) return absl::OkStatus();
        const bool root = impl.rank() == src;
        FERRY_ASSIGN_OR_RETURN(Tensor host_out, host_output(output));
        std::vector<Tensor> host_in;
        std::vector<uint8_t*> ptrs;
        if (root) {
          for (const Tensor& t : scatter_list) {
            FERRY_ASSIGN_OR_RETURN(Tensor h, host_input(t));
            // Gloo copies the root's own part with memcpy: it must not overlap the output.
            if (h.data() == host_out.data()) {
              FERRY_ASSIGN_OR_RETURN(h, h.clone());
            }
            ptrs.push_back(static_cast<uint8_t*>(h.data()));
            host_in.push_back(std::move(h));
          }
        }
        gloo::ScatterOptions opts(impl.context_);
        if (root) opts.setInputs<uint8_t>(ptrs, n);
        opts.setOutput<uint8_t>(static_cast<uint8_t*>(host_out.data()), n);
        opts.setRoot(src);
        opts.setTag(tag);
        opts.setTimeout(impl.context_->getTimeout());
        gloo::scatter(opts);
        return write_back(output, host_out);
      });
}

absl::Status ProcessGroup::scatter(Tensor output, std::vector<Tensor> scatter_list, int src) {
  return scatter_async(std::move(output), std::move(scatter_list), src).wait();
}

Work ProcessGroup::barrier_async() {
  FERRY_PG_MEMBER_OR_RETURN_WORK("barrier");
  CollectiveHeader h = internal::make_header(CollectiveKind::kBarrier, nullptr, 0, ReduceOp::kSum, absl::OkStatus());
  // The header exchange is itself the barrier (see Impl::run).
  return impl_->enqueue("barrier", h, absl::OkStatus(),
                        [](Impl&, uint32_t, const auto&) { return absl::OkStatus(); });
}

absl::Status ProcessGroup::barrier() { return barrier_async().wait(); }

absl::StatusOr<std::vector<Bytes>> ProcessGroup::all_gather_bytes(const Bytes& data) {
  return all_gather_bytes_internal(data, absl::OkStatus(), "all_gather_bytes");
}

absl::StatusOr<std::vector<Bytes>> ProcessGroup::all_gather_bytes_internal(const Bytes& data,
                                                                           const absl::Status& local_error,
                                                                           std::string_view op_name) {
  const std::string name(op_name);
  if (!is_member()) return not_member_error(name, ranks_);
  // The headers carry every rank's size, so the data moves in one allgatherv.
  CollectiveHeader h = internal::make_header(CollectiveKind::kAllGatherBytes, nullptr, 0, ReduceOp::kSum, local_error,
                                             static_cast<int64_t>(data.size()));
  auto result = std::make_shared<std::vector<Bytes>>();
  Work work = impl_->enqueue(
      name, h, local_error,
      [&data, result](Impl& impl, uint32_t tag, const std::vector<CollectiveHeader>& headers) -> absl::Status {
        std::vector<size_t> counts;
        size_t total = 0;
        for (const CollectiveHeader& hh : headers) {
          counts.push_back(static_cast<size_t>(hh.numel));
          total += counts.back();
        }
        std::vector<uint8_t> flat(total);
        if (total > 0) {
          // Gloo wants a real pointer even for an empty contribution.
          uint8_t dummy = 0;
          gloo::AllgathervOptions opts(impl.context_);
          opts.setInput<uint8_t>(data.empty() ? &dummy : const_cast<uint8_t*>(data.data()), data.size());
          opts.setOutput<uint8_t>(flat.data(), counts);
          opts.setTag(tag);
          opts.setTimeout(impl.context_->getTimeout());
          gloo::allgatherv(opts);
        }
        size_t offset = 0;
        for (size_t c : counts) {
          result->emplace_back(flat.begin() + offset, flat.begin() + offset + c);
          offset += c;
        }
        return absl::OkStatus();
      });
  // Blocking: `data` stays alive (it is captured by reference) until this returns.
  FERRY_RETURN_IF_ERROR(work.wait());
  return std::move(*result);
}

// ---- point-to-point ----------------------------------------------------------------

namespace {

absl::Status check_peer(std::string_view name, std::string_view what, int peer, int rank, int size) {
  FERRY_RETURN_IF_ERROR(check_root(name, what, peer, size));
  if (peer == rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(internal::av(name), ": ", internal::av(what), " ", peer, " is this process's own rank"));
  }
  return absl::OkStatus();
}

}  // namespace

Work ProcessGroup::isend(Tensor tensor, int dst, uint32_t tag) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("isend");
  if (absl::Status s = check_tensor("isend", "the tensor", tensor); !s.ok()) return Work::completed("isend", s);
  if (absl::Status s = check_peer("isend", "dst", dst, rank_, world_size_); !s.ok()) return Work::completed("isend", s);
  if (absl::Status s = impl_->begin_p2p("isend"); !s.ok()) return Work::completed("isend", s);
  absl::StatusOr<std::function<absl::Status()>> wait = impl_->post_send("isend", tensor, dst, tag);
  if (!wait.ok()) {
    impl_->end_p2p();
    return Work::completed("isend", wait.status());
  }
  auto state = std::make_shared<WorkState>("isend");
  Impl* impl = impl_.get();
  auto run = [state, impl, wait = *std::move(wait)] {
    state->complete(wait());
    impl->end_p2p();
  };
  if (!impl_->spawn(run)) run();
  return Work(state);
}

absl::Status ProcessGroup::send(Tensor tensor, int dst, uint32_t tag) {
  if (!is_member()) return not_member_error("send", ranks_);
  FERRY_RETURN_IF_ERROR(check_tensor("send", "the tensor", tensor));
  FERRY_RETURN_IF_ERROR(check_peer("send", "dst", dst, rank_, world_size_));
  FERRY_RETURN_IF_ERROR(impl_->begin_p2p("send"));
  absl::StatusOr<std::function<absl::Status()>> wait = impl_->post_send("send", tensor, dst, tag);
  absl::Status s = wait.ok() ? (*wait)() : wait.status();
  impl_->end_p2p();
  return s;
}

Work ProcessGroup::irecv(Tensor tensor, std::optional<int> src, uint32_t tag) {
  FERRY_PG_MEMBER_OR_RETURN_WORK("irecv");
  if (absl::Status s = check_tensor("irecv", "the tensor", tensor); !s.ok()) return Work::completed("irecv", s);
  if (src.has_value()) {
    if (absl::Status s = check_peer("irecv", "src", *src, rank_, world_size_); !s.ok()) {
      return Work::completed("irecv", s);
    }
  } else if (world_size_ < 2) {
    return Work::completed("irecv", absl::InvalidArgumentError("irecv: there is no other rank to receive from"));
  }
  if (absl::Status s = impl_->begin_p2p("irecv"); !s.ok()) return Work::completed("irecv", s);
  absl::StatusOr<std::function<absl::StatusOr<int>()>> wait = impl_->post_recv("irecv", tensor, src, tag);
  if (!wait.ok()) {
    impl_->end_p2p();
    return Work::completed("irecv", wait.status());
  }
  auto state = std::make_shared<WorkState>("irecv");
  Impl* impl = impl_.get();
  auto run = [state, impl, wait = *std::move(wait)] {
    absl::StatusOr<int> sender = wait();
    if (sender.ok()) {
      state->complete(absl::OkStatus(), *sender);
    } else {
      state->complete(sender.status());
    }
    impl->end_p2p();
  };
  if (!impl_->spawn(run)) run();
  return Work(state);
}

absl::StatusOr<int> ProcessGroup::recv(Tensor tensor, std::optional<int> src, uint32_t tag) {
  if (!is_member()) return not_member_error("recv", ranks_);
  FERRY_RETURN_IF_ERROR(check_tensor("recv", "the tensor", tensor));
  if (src.has_value()) {
    FERRY_RETURN_IF_ERROR(check_peer("recv", "src", *src, rank_, world_size_));
  } else if (world_size_ < 2) {
    return absl::InvalidArgumentError("recv: there is no other rank to receive from");
  }
  FERRY_RETURN_IF_ERROR(impl_->begin_p2p("recv"));
  absl::StatusOr<std::function<absl::StatusOr<int>()>> wait = impl_->post_recv("recv", tensor, src, tag);
  absl::StatusOr<int> sender = wait.ok() ? (*wait)() : absl::StatusOr<int>(wait.status());
  impl_->end_p2p();
  return sender;
}

absl::Status ProcessGroup::send_bytes(const Bytes& data, int dst, uint32_t tag,
                                      std::optional<std::chrono::milliseconds> timeout) {
  if (!is_member()) return not_member_error("send_bytes", ranks_);
  FERRY_RETURN_IF_ERROR(check_peer("send_bytes", "dst", dst, rank_, world_size_));
  if (timeout.has_value() && *timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError(absl::StrCat("send_bytes: timeout ", timeout->count(), " ms must be positive"));
  }
  FERRY_RETURN_IF_ERROR(impl_->begin_p2p("send_bytes"));
  absl::Status s = impl_->send_bytes("send_bytes", data, dst, tag, timeout.value_or(timeout_));
  impl_->end_p2p();
  return s;
}

absl::StatusOr<ProcessGroup::ReceivedBytes> ProcessGroup::recv_bytes(std::optional<int> src, uint32_t tag,
                                                                     std::optional<std::chrono::milliseconds> timeout) {
  if (!is_member()) return not_member_error("recv_bytes", ranks_);
  if (src.has_value()) {
    FERRY_RETURN_IF_ERROR(check_peer("recv_bytes", "src", *src, rank_, world_size_));
  } else if (world_size_ < 2) {
    return absl::InvalidArgumentError("recv_bytes: there is no other rank to receive from");
  }
  if (timeout.has_value() && *timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError(absl::StrCat("recv_bytes: timeout ", timeout->count(), " ms must be positive"));
  }
  FERRY_RETURN_IF_ERROR(impl_->begin_p2p("recv_bytes"));
  absl::StatusOr<ReceivedBytes> r = impl_->recv_bytes("recv_bytes", src, tag, timeout.value_or(timeout_));
  impl_->end_p2p();
  return r;
}

#undef FERRY_PG_MEMBER_OR_RETURN_WORK

}  // namespace ferry
