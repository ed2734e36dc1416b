#include "backends/init_failures.h"

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "base/logging.h"
#include "base/status.h"
#include "store/tcp_store.h"

namespace ferry::internal {
namespace {

using Clock = std::chrono::steady_clock;

constexpr char kAttributedPayload[] = "ferry.init/attributed";
constexpr char kVerdictPayload[] = "ferry.init/verdict";

// The record: "<code>\n<message>", the message already naming the rank.
Bytes encode_failure(const absl::Status& status) {
  return to_bytes(absl::StrCat(static_cast<int>(status.code()), "\n", status.message()));
}

std::optional<absl::Status> decode_failure(const Bytes& bytes) {
  std::string text = to_string(bytes);
  size_t newline = text.find('\n');
  int code = 0;
  if (newline == std::string::npos || !absl::SimpleAtoi(text.substr(0, newline), &code) || code <= 0 || code > 16) {
    return std::nullopt;
  }
  return absl::Status(static_cast<absl::StatusCode>(code), text.substr(newline + 1));
}

// Blocking calls go in slices of at most kPollInterval; between slices it looks for the
// published failure and, if there is one, returns it instead of waiting on.
class WatchingStore final : public Store {
 public:
  WatchingStore(std::shared_ptr<Store> base, std::string key, std::shared_ptr<std::atomic<bool>> armed)
      : Store(base->timeout()), base_(std::move(base)), key_(std::move(key)), armed_(std::move(armed)) {}

  using Store::get;
  using Store::multi_get;
  using Store::wait;

  absl::Status set(std::string_view key, const Bytes& value) override { return base_->set(key, value); }
  absl::StatusOr<Bytes> get(std::string_view key, std::optional<std::chrono::milliseconds> timeout) override {
    return sliced<Bytes>(timeout, [&](std::chrono::milliseconds t) { return base_->get(key, t); });
  }
  absl::StatusOr<int64_t> add(std::string_view key, int64_t delta) override { return base_->add(key, delta); }
  absl::StatusOr<Bytes> compare_set(std::string_view key, const Bytes& expected, const Bytes& desired) override {
    return base_->compare_set(key, expected, desired);
  }
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override { return base_->check(keys); }
  absl::Status wait(const std::vector<std::string>& keys, std::optional<std::chrono::milliseconds> timeout) override {
    return sliced<bool>(timeout, [&](std::chrono::milliseconds t) -> absl::StatusOr<bool> {
             FERRY_RETURN_IF_ERROR(base_->wait(keys, t));
             return true;
           })
        .status();
  }
  absl::StatusOr<bool> delete_key(std::string_view key) override { return base_->delete_key(key); }
  absl::StatusOr<int64_t> num_keys() override { return base_->num_keys(); }
  absl::StatusOr<std::vector<Bytes>> multi_get(const std::vector<std::string>& keys,
                                               std::optional<std::chrono::milliseconds> timeout) override {
    return sliced<std::vector<Bytes>>(timeout, [&](std::chrono::milliseconds t) { return base_->multi_get(keys, t); });
  }
  absl::Status multi_set(const std::vector<std::string>& keys, const std::vector<Bytes>& values) override {
    return base_->multi_set(keys, values);
  }

 private:
  template <typename T, typename Call>
  absl::StatusOr<T> sliced(std::optional<std::chrono::milliseconds> timeout, Call call) {
    const std::chrono::milliseconds total = effective(timeout);
    const Clock::time_point deadline = Clock::now() + total;
    while (true) {
      if (!armed_->load()) {
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
        return call(std::max(left, std::chrono::milliseconds(0)));
      }
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      const bool last = left <= InitFailures::kPollInterval;
      absl::StatusOr<T> r = call(last ? std::max(left, std::chrono::milliseconds(0)) : InitFailures::kPollInterval);
      if (r.ok() || r.status().code() != absl::StatusCode::kDeadlineExceeded) return r;
      // Timed out: a failure published meanwhile explains why, and ends the wait.
      if (absl::StatusOr<bool> failed = base_->check({key_}); failed.ok() && *failed) {
        if (absl::StatusOr<Bytes> record = base_->get(key_, std::chrono::seconds(1)); record.ok()) {
          if (std::optional<absl::Status> s = decode_failure(*record)) return *s;
        }
      }
      if (last) {
        return absl::DeadlineExceededError(absl::StrCat(r.status().message(), " (", total.count(), " ms in all)"));
      }
    }
  }

  std::shared_ptr<Store> base_;
  std::string key_;
  std::shared_ptr<std::atomic<bool>> armed_;
};

}  // namespace

absl::Status init_failure(int rank, std::string_view name, absl::StatusCode code, std::string_view why) {
  absl::Status s(code, absl::StrCat("init_rpc failed on rank ", rank, " (worker \"", av(name), "\"): ", av(why)));
  s.SetPayload(kAttributedPayload, absl::Cord());
  return s;
}

absl::Status group_verdict(absl::Status status) {
  if (!status.ok()) status.SetPayload(kVerdictPayload, absl::Cord());
  return status;
}

InitFailures::InitFailures(std::shared_ptr<Store> store, std::string prefix)
    : store_(std::move(store)),
      prefix_(std::move(prefix)),
      key_(prefix_ + "failed"),
      armed_(std::make_shared<std::atomic<bool>>(true)) {
  watched_ = std::make_shared<WatchingStore>(store_, key_, armed_);
}

std::optional<absl::Status> InitFailures::published() const {
  absl::StatusOr<bool> there = store_->check({key_});
  if (!there.ok() || !*there) return std::nullopt;
  absl::StatusOr<Bytes> record = store_->get(key_, std::chrono::seconds(1));
  if (!record.ok()) return std::nullopt;
  return decode_failure(*record);
}

absl::Status InitFailures::conclude(int rank, std::string_view name, const absl::Status& status) {
  if (status.ok()) return status;
  if (std::optional<absl::Status> first = published()) {
    // A wait that ended with it may have wrapped it; anything else is this rank's own.
    if (!absl::StrContains(status.message(), first->message())) FERRY_LOG(WARNING) << "init_rpc on rank " << rank << " also failed: " << status;
    return *first;
  }
  // A rank that timed out waiting blames no one in particular (its message names the
  // ranks that never arrived); the others time out alike. A verdict every rank reaches
  // by itself needs no publishing either.
  if (status.code() == absl::StatusCode::kDeadlineExceeded || status.GetPayload(kVerdictPayload).has_value()) {
    return absl::Status(status.code(), status.message());
  }
  // Already naming the rank that failed (read from its record), or this rank's own.
  absl::Status mine = status.GetPayload(kAttributedPayload).has_value()
                          ? absl::Status(status.code(), status.message())
                          : init_failure(rank, name, status.code(), std::string(status.message()));
  mine.ErasePayload(kAttributedPayload);
  // The first failure published stays: every rank ends with the same one.
  absl::StatusOr<Bytes> now = store_->compare_set(key_, Bytes{}, encode_failure(mine));
  if (!now.ok()) {
    FERRY_LOG(WARNING) << "init_rpc on rank " << rank << ": could not publish its failure in the store: "
                       << now.status();
    return mine;
  }
  std::optional<absl::Status> first = decode_failure(*now);
  return first.has_value() ? *first : mine;
}

void InitFailures::linger(int world_size, std::chrono::milliseconds grace) {
  const std::string all_out = prefix_ + "all_out";
  absl::StatusOr<int64_t> out = store_->add(prefix_ + "out", 1);
  if (!out.ok()) return;  // the store is gone already: nothing to keep up
  if (*out >= world_size) {
    (void)store_->set(all_out, Bytes{'1'});
    return;
  }
  const TCPStore* tcp = tcp_store_of(*store_);
  if (tcp == nullptr || tcp->server() == nullptr) return;
  // A rank that never gets this far (it crashed) costs the grace, no more.
  if (absl::Status all = store_->wait({all_out}, grace); !all.ok()) {
    FERRY_LOG(INFO) << "init failed: stopped waiting for the other ranks to read the failure: " << all;
  }
}

void InitFailures::disarm() { armed_->store(false); }

}  // namespace ferry::internal
