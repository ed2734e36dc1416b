// ProcessGroup's point-to-point messages: tensors (send/recv, isend/irecv) and byte
// messages (send_bytes/recv_bytes); see internal/group_impl.h.
#include "process_group/internal/group_impl.h"

#include "absl/strings/str_cat.h"

namespace ferry {

// ---- point-to-point ----------------------------------------------------------------

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

absl::Status ProcessGroup::send_bytes(std::shared_ptr<const Bytes> data, int dst, uint32_t tag,
                                      std::optional<std::chrono::milliseconds> timeout) {
  if (!is_member()) return not_member_error("send_bytes", ranks_);
  if (data == nullptr) return absl::InvalidArgumentError("send_bytes: the data is null");
  FERRY_RETURN_IF_ERROR(check_peer("send_bytes", "dst", dst, rank_, world_size_));
  if (timeout.has_value() && *timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError(absl::StrCat("send_bytes: timeout ", timeout->count(), " ms must be positive"));
  }
  FERRY_RETURN_IF_ERROR(impl_->begin_p2p("send_bytes"));
  const uint8_t* bytes = data->data();
  const size_t size = data->size();
  absl::Status s = impl_->send_bytes("send_bytes", bytes, size, std::move(data), dst, tag, timeout.value_or(timeout_));
  impl_->end_p2p();
  return s;
}

void ProcessGroup::cancel_sends(int dst, std::string_view why) {
  if (!is_member() || dst < 0 || dst >= world_size_) return;
  impl_->cancel_sends(dst, absl::UnavailableError(absl::StrCat("send_bytes to rank ", dst, " (", impl_->description(),
                                                               ") given up: ", internal::av(why))));
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

absl::StatusOr<ProcessGroup::ReceivedBytes> ProcessGroup::recv_bytes_stream(
    int src, uint32_t tag, std::optional<std::chrono::milliseconds> timeout) {
  if (!is_member()) return not_member_error("recv_bytes_stream", ranks_);
  FERRY_RETURN_IF_ERROR(check_peer("recv_bytes_stream", "src", src, rank_, world_size_));
  if (timeout.has_value() && *timeout <= std::chrono::milliseconds::zero()) {
    return absl::InvalidArgumentError(
        absl::StrCat("recv_bytes_stream: timeout ", timeout->count(), " ms must be positive"));
  }
  FERRY_RETURN_IF_ERROR(impl_->begin_p2p("recv_bytes_stream"));
  absl::StatusOr<ReceivedBytes> r =
      impl_->recv_bytes_stream("recv_bytes_stream", src, tag, timeout.value_or(timeout_));
  impl_->end_p2p();
  return r;
}

}  // namespace ferry
