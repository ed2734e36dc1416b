// ProcessGroup::Impl's life: connecting the mesh, the usability checks every call
// makes, tracking point-to-point threads, and shutdown (see group_impl.h).
#include "process_group/internal/group_impl.h"

#include "absl/strings/str_cat.h"
#include "base/thread_name.h"
#include "gloo/rendezvous/context.h"
#include "process_group/internal/gloo_store.h"
#include "serialization/archive.h"
#include "store/prefix_store.h"

namespace ferry {

ProcessGroup::Impl::Impl(int rank, int size, std::chrono::milliseconds timeout,
                         std::shared_ptr<gloo::transport::Device> device)
    : rank_(rank),
      size_(size),
      timeout_(timeout),
      max_bytes_(max_message_bytes()),
      device_(std::move(device)),
      description_(absl::StrCat("rank ", rank, " of ", size)) {}

ProcessGroup::Impl::~Impl() { shutdown(); }

absl::StatusOr<std::shared_ptr<gloo::Context>> ProcessGroup::Impl::connect_mesh(const std::shared_ptr<Store>& store) {
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

absl::Status ProcessGroup::Impl::connect(const std::shared_ptr<Store>& store) {
  FERRY_ASSIGN_OR_RETURN(context_, connect_mesh(store));
  if (size_ > 1) {
    FERRY_ASSIGN_OR_RETURN(header_context_, connect_mesh(std::make_shared<PrefixStore>("headers", store)));
    // No other thread exists yet.
    FERRY_RETURN_IF_ERROR(catch_gloo(kExchangeName, description_, [&] { return make_header_slots(); }));
  }
  worker_ = std::thread([this] {
    internal::name_this_thread("ferry-pg-work");
    worker_loop();
  });
  return absl::OkStatus();
}

bool ProcessGroup::Impl::spawn(std::function<void()> fn) {
  absl::MutexLock lock(&mu_);
  if (closed_) return false;
  p2p_queue_.push_back(std::move(fn));
  if (p2p_queue_.size() > p2p_idle_ && p2p_threads_.size() < kMaxP2PWaiters) {
    p2p_threads_.emplace_back([this] {
      internal::name_this_thread("ferry-pg-p2p");
      p2p_loop();
    });
  }
  return true;
}

void ProcessGroup::Impl::p2p_loop() {
  mu_.Lock();
  for (;;) {
    ++p2p_idle_;
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !p2p_queue_.empty() || closed_; };
    mu_.Await(absl::Condition(&ready));
    --p2p_idle_;
    // Once closed, the waits still queued run too (their buffers are aborted, so they
    // end at once): each ends its operation's count in p2p_in_flight_.
    if (p2p_queue_.empty()) break;
    std::function<void()> fn = std::move(p2p_queue_.front());
    p2p_queue_.pop_front();
    mu_.Unlock();
    fn();
    mu_.Lock();
  }
  mu_.Unlock();
}

absl::Status ProcessGroup::Impl::begin_p2p(std::string_view name) {
  absl::MutexLock lock(&mu_);
  FERRY_RETURN_IF_ERROR(usable_locked(name));
  ++p2p_in_flight_;
  return absl::OkStatus();
}

void ProcessGroup::Impl::end_p2p() {
  absl::MutexLock lock(&mu_);
  --p2p_in_flight_;
}

absl::Status ProcessGroup::Impl::usable(std::string_view name) {
  absl::MutexLock lock(&mu_);
  return usable_locked(name);
}

void ProcessGroup::Impl::shutdown() {
  std::deque<Task> cancelled_tasks;
  std::vector<std::thread> threads;
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
    threads.swap(p2p_threads_);
    rings.swap(rings_);
  }
  for (std::thread& t : threads) t.join();
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

absl::Status ProcessGroup::Impl::usable_locked(std::string_view name) const {
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

absl::Status ProcessGroup::Impl::cancelled(std::string_view name) const {
  return absl::CancelledError(
      absl::StrCat(internal::av(name), ": the process group (", description_, ") was shut down"));
}

absl::Status ProcessGroup::Impl::break_group(absl::Status s) {
  absl::MutexLock lock(&mu_);
  if (broken_.ok()) broken_ = s;
  return s;
}

absl::Status ProcessGroup::Impl::fail_group(std::string_view name, const absl::Status& why) {
  return break_group(
      absl::Status(why.code(), absl::StrCat(internal::av(name), " (", description_, "): ", why.message())));
}

bool ProcessGroup::Impl::register_buffer(gloo::transport::UnboundBuffer* buf) {
  absl::MutexLock lock(&mu_);
  if (closed_) return false;
  buffers_.insert(buf);
  return true;
}

void ProcessGroup::Impl::unregister_buffer(gloo::transport::UnboundBuffer* buf) {
  if (buf == nullptr) return;
  absl::MutexLock lock(&mu_);
  buffers_.erase(buf);
}

}  // namespace ferry
