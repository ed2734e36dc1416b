// ProcessGroup::Impl's collectives: the queue the worker thread runs in order, and the
// header exchange that checks every rank's arguments before (or, on the steady path,
// while) the data moves (see group_impl.h, Impl::run).
#include "process_group/internal/group_impl.h"

#include <cstring>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "base/logging.h"
#include "gloo/transport/pair.h"

namespace ferry {

Work ProcessGroup::Impl::enqueue(std::string name, CollectiveHeader header, absl::Status local_error, Body body,
                                 Tensor inline_source) {
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

void ProcessGroup::Impl::worker_loop() {
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

absl::Status ProcessGroup::Impl::run(Task& task) {
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

absl::Status ProcessGroup::Impl::wait_headers(const std::string& name, uint32_t seq,
                                              std::vector<CollectiveHeader>& headers) {
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

size_t ProcessGroup::Impl::inline_bytes(const CollectiveHeader& h, int sender) {
  if (h.kind == static_cast<uint8_t>(CollectiveKind::kBroadcast) && h.root != sender) return 0;
  return inline_size(h);
}

size_t ProcessGroup::Impl::inline_size(const CollectiveHeader& h) {
  if (h.magic != CollectiveHeader::kMagic || h.has_error != 0 ||
      (h.kind != static_cast<uint8_t>(CollectiveKind::kBroadcast) &&
       h.kind != static_cast<uint8_t>(CollectiveKind::kAllGather)) ||
      !is_valid_dtype(h.dtype) || h.numel <= 0 || static_cast<uint64_t>(h.numel) > kInlineBytes) {
    return 0;
  }
  const uint64_t n = static_cast<uint64_t>(h.numel) * dtype_size(static_cast<DType>(h.dtype));
  return n <= kInlineBytes ? static_cast<size_t>(n) : 0;
}

uint64_t ProcessGroup::Impl::trailer_of(const uint8_t* in, int sender) const {
  CollectiveHeader h;
  std::memcpy(&h, in, sizeof(h));
  uint64_t trailer;
  std::memcpy(&trailer, in + sizeof(CollectiveHeader) + inline_bytes(h, sender), sizeof(trailer));
  return trailer;
}

void ProcessGroup::Impl::clear_inbox(size_t entry, const std::vector<CollectiveHeader>& headers) {
  for (int r = 0; r < size_; ++r) {
    if (r == rank_) continue;
    uint8_t* in = &slots_.inbox[slot_index(r, entry) * kSlotBytes];
    std::memset(in, 0, sizeof(CollectiveHeader) + inline_bytes(headers[r], r) + sizeof(uint64_t));
  }
}

absl::Status ProcessGroup::Impl::make_header_slots() {
  const int up = header_context_->nextSlot(2 * kHeaderRing);  // slots of headers sent to a higher rank
  const int down = up + static_cast<int>(kHeaderRing);        // and to a lower one
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

}  // namespace ferry
