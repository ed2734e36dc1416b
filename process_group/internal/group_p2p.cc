// ProcessGroup::Impl's point-to-point messages: tensors (post_send/post_recv) and byte
// messages (send_bytes/recv_bytes, recv_bytes_stream), on Gloo slots apart from every
// collective's (see group_impl.h).
#include "process_group/internal/group_impl.h"

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "base/logging.h"

namespace ferry {

namespace internal::pg {
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
using internal::BytesHeader;
constexpr size_t kBytesInline = 64 * 1024 - sizeof(BytesHeader);

inline uint64_t bytes_header_slot(uint32_t tag) { return (kBytesHeaderPrefix << 56) | (static_cast<uint64_t>(tag) << 24); }
inline uint64_t bytes_data_slot(uint32_t tag, uint32_t seq) {
  return (kBytesDataPrefix << 56) | (static_cast<uint64_t>(tag) << 24) | (seq & 0xffffffu);
}

// The bytes header at the front of `head`, received from `sender`. A message that fits
// inline lands in `out` now; a larger one's data follows (recv_bytes_data). A size over
// `limit` is refused before anything is allocated for it, and its data is never taken
// (the sender's wait ends at its timeout, or when it gives up).
absl::StatusOr<BytesHeader> take_bytes_header(const std::string& name, const std::vector<uint8_t>& head, int sender,
                                              uint64_t limit, ProcessGroup::ReceivedBytes& out) {
  FERRY_ASSIGN_OR_RETURN(BytesHeader header, internal::parse_bytes_header(name, head, sender, limit));
  out.source_rank = sender;
  if (header.size <= kBytesInline) {
    out.data.assign(head.begin() + sizeof(BytesHeader),
                    head.begin() + static_cast<std::ptrdiff_t>(sizeof(BytesHeader) + header.size));
  }
  return header;
}

inline uint64_t p2p_header_slot(uint32_t tag) { return (kP2PHeaderPrefix << 56) | (static_cast<uint64_t>(tag) << 24); }
inline uint64_t p2p_data_slot(uint32_t tag, uint32_t seq) {
  return (kP2PDataPrefix << 56) | (static_cast<uint64_t>(tag) << 24) | (seq & 0xffffffu);
}

}  // namespace
}  // namespace internal::pg

absl::StatusOr<std::function<absl::Status()>> ProcessGroup::Impl::post_send(const std::string& name,
                                                                            const Tensor& tensor, int dst,
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
    const size_t n = host.nbytes();
    if (n > 0) {
      op->data_buf = context_->createUnboundBuffer(host.data(), n);
      if (!register_buffer(op->data_buf.get())) return cancelled(name);
      for (size_t off = 0; off < n; off += kDataChunk) {
        op->data_buf->send(dst, p2p_data_slot(tag, op->seq), off, std::min(kDataChunk, n - off));
      }
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
      if (op->data_buf) {
        for (size_t i = chunk_count(op->host.nbytes()); i > 0; --i) {
          FERRY_RETURN_IF_ERROR(wait_send(name, op->data_buf.get()));
        }
      }
      return absl::OkStatus();
    });
    op->release(*this);
    return s;
  };
}

absl::StatusOr<std::function<absl::StatusOr<int>()>> ProcessGroup::Impl::post_recv(const std::string& name,
                                                                                   const Tensor& tensor,
                                                                                   std::optional<int> src,
                                                                                   uint32_t tag) {
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

absl::Status ProcessGroup::Impl::send_bytes(const std::string& name, const Bytes& data, int dst, uint32_t tag,
                                            std::chrono::milliseconds timeout) {
  return send_bytes(name, data.data(), data.size(), nullptr, dst, tag, timeout);
}

absl::Status ProcessGroup::Impl::send_bytes(const std::string& name, const uint8_t* data, size_t size,
                                            std::shared_ptr<const Bytes> keep, int dst, uint32_t tag,
                                            std::chrono::milliseconds timeout) {
  if (size > max_bytes_) {
    // The receiver would refuse it (if it has the same limit): say so here, at once.
    return absl::ResourceExhaustedError(absl::StrCat(name, ": ", size, " bytes, over this process's limit of ",
                                                     max_bytes_, " bytes per message (FERRY_MAX_MESSAGE_BYTES)"));
  }
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
  const BytesHeader header{BytesHeader::kMagic, seq, static_cast<uint64_t>(size)};
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

void ProcessGroup::Impl::cancel_sends(int dst, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  auto it = cancellable_.find(dst);
  if (it == cancellable_.end()) return;
  for (const std::shared_ptr<PendingSend>& op : it->second) {
    if (op->why.ok()) op->why = why;
    if (op->head_buf) op->head_buf->abortWaitSend();
    if (op->data_buf) op->data_buf->abortWaitSend();
  }
}

absl::Status ProcessGroup::Impl::recv_bytes_data(const std::string& name, int sender, uint64_t slot, uint64_t size,
                                                 ReceivedBytes& out,
                                                 std::unique_ptr<gloo::transport::UnboundBuffer>& buf) {
  FERRY_CHECK(size <= max_bytes_);  // take_bytes_header refused larger ones
  out.data.resize(size);
  buf = context_->createUnboundBuffer(out.data.data(), out.data.size());
  if (!register_buffer(buf.get())) return cancelled(name);
  buf->recv(sender, slot);
  // The sender has posted the data already: only the transfer is left to wait for.
  if (!buf->waitRecv(nullptr, timeout_)) return cancelled(name);
  return absl::OkStatus();
}

absl::StatusOr<ProcessGroup::ReceivedBytes> ProcessGroup::Impl::recv_bytes_stream(const std::string& name, int src,
                                                                                  uint32_t tag,
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
    absl::StatusOr<BytesHeader> header = take_bytes_header(name, ring->storage[i], sender, max_bytes_, out);
    // Taken out (a refused one too, so the stream goes on): post it again, then move
    // on to the next one. A peer lost just now fails the re-post: this message still
    // goes out, and the next call says why.
    absl::Status reposted = catch_gloo(name, description_, [&] {
      buf->recv(src, bytes_header_slot(tag));
      return absl::OkStatus();
    });
    if (!reposted.ok()) ring->failed = reposted;
    ring->next = (i + 1) % PostedRing::kDepth;
    FERRY_RETURN_IF_ERROR(header.status());
    if (header->size <= kBytesInline) return absl::OkStatus();
    return recv_bytes_data(name, sender, bytes_data_slot(tag, header->seq), header->size, out, data_buf);
  });
  unregister_buffer(data_buf.get());
  if (!s.ok()) return s;
  return out;
}

absl::StatusOr<ProcessGroup::ReceivedBytes> ProcessGroup::Impl::recv_bytes(const std::string& name,
                                                                           std::optional<int> src, uint32_t tag,
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
    FERRY_ASSIGN_OR_RETURN(BytesHeader header, take_bytes_header(name, head, sender, max_bytes_, out));
    if (header.size <= kBytesInline) return absl::OkStatus();
    return recv_bytes_data(name, sender, bytes_data_slot(tag, header.seq), header.size, out, data_buf);
  });
  unregister_buffer(head_buf.get());
  unregister_buffer(data_buf.get());
  if (!s.ok()) return s;
  return out;
}

absl::Status ProcessGroup::Impl::wait_send(std::string_view name, gloo::transport::UnboundBuffer* buf) {
  if (!buf->waitSend(timeout_)) return cancelled(name);
  return absl::OkStatus();
}

absl::Status ProcessGroup::Impl::wait_recv(std::string_view name, gloo::transport::UnboundBuffer* buf, int* sender) {
  if (!buf->waitRecv(sender, timeout_)) return cancelled(name);
  return absl::OkStatus();
}

absl::Status ProcessGroup::Impl::finish_recv(const std::string& name, P2POp& op, const Tensor& tensor, uint32_t tag,
                                             int* sender) {
  FERRY_RETURN_IF_ERROR(wait_recv(name, op.header_buf.get(), sender));
  const CollectiveHeader& h = op.header;
  FERRY_RETURN_IF_ERROR(internal::validate_p2p_header(h, kP2PKind, *sender, name));
  // validate_p2p_header bounded it to int64.
  const auto incoming = static_cast<uint64_t>(h.numel) * dtype_size(static_cast<DType>(h.dtype));
  const CollectiveHeader mine =
      internal::make_header(CollectiveKind::kBroadcast, &tensor, 0, ReduceOp::kSum, absl::OkStatus());
  const bool matches = h.dtype == mine.dtype && h.ndim == mine.ndim && h.numel == mine.numel &&
                       h.shape_hash == mine.shape_hash;
  if (!matches && incoming > max_bytes_) {
    // Too large even to drain: left untaken (the sender's wait ends at its timeout).
    return absl::ResourceExhaustedError(absl::StrCat(
        name, ": rank ", *sender, " announced a tensor of ", incoming, " bytes (", dtype_name(static_cast<DType>(h.dtype)),
        " ", internal::header_shape_string(h), ") that does not match the receiving tensor (",
        dtype_name(tensor.dtype()), " ", internal::shape_string(tensor.shape()), "), over this process's limit of ",
        max_bytes_, " bytes per message (FERRY_MAX_MESSAGE_BYTES); refused without receiving it"));
  }
  Tensor host;
  if (matches) {
    FERRY_ASSIGN_OR_RETURN(host, host_output(tensor));
  }
  if (incoming > 0) {
    // A mismatch is taken anyway, so the sender completes and the next message from
    // it is not stuck behind this one: every chunk lands in the same drain chunk.
    if (!matches) op.drain.resize(std::min<size_t>(incoming, kDataChunk));
    op.data_buf = matches ? context_->createUnboundBuffer(host.data(), incoming)
                          : context_->createUnboundBuffer(op.drain.data(), op.drain.size());
    if (!register_buffer(op.data_buf.get())) return cancelled(name);
    const uint64_t slot = p2p_data_slot(tag, static_cast<uint32_t>(h.root));
    for (size_t off = 0; off < incoming; off += kDataChunk) {
      const size_t len = std::min<size_t>(kDataChunk, incoming - off);
      op.data_buf->recv(*sender, slot, matches ? off : 0, len);
    }
    for (size_t i = chunk_count(incoming); i > 0; --i) {
      FERRY_RETURN_IF_ERROR(wait_recv(name, op.data_buf.get(), nullptr));
    }
  }
  if (!matches) {
    return absl::InvalidArgumentError(absl::StrCat(
        name, ": the tensor from rank ", *sender, " is ", dtype_name(static_cast<DType>(h.dtype)), " ",
        internal::header_shape_string(h), " but the receiving tensor is ", dtype_name(tensor.dtype()), " ",
        internal::shape_string(tensor.shape())));
  }
  return write_back(tensor, host);
}

}  // namespace ferry
