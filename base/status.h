// File: base/status.h
//
// ferry's error conventions (STYLE.md 2.4): every layer returns absl::Status or
// absl::StatusOr<T>; only the synchronous edge (rpc_sync, Future::wait) throws, and
// what it throws is ferry::RpcError, which carries the Status.
//
//   absl::StatusOr<Tensor> scaled(const Tensor& t) {
//     FERRY_ASSIGN_OR_RETURN(Tensor copy, t.to(Device::cpu()));
//     FERRY_RETURN_IF_ERROR(copy.fill(1.0));
//     return copy;
//   }
#pragma once

#include <stdexcept>
#include <string_view>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry {

// The one exception type ferry throws. Thread-safe to copy and read.
class RpcError : public std::runtime_error {
 public:
  explicit RpcError(absl::Status status)
      : std::runtime_error(status.ToString()), status_(std::move(status)) {}

  const absl::Status& status() const noexcept { return status_; }
  absl::StatusCode code() const noexcept { return status_.code(); }

 private:
  absl::Status status_;
};

// Throws RpcError when `status` is not OK; for the synchronous edge only.
inline void throw_if_error(const absl::Status& status) {
  if (!status.ok()) throw RpcError(status);
}

// Returns the value of `result` or throws RpcError with its status.
template <typename T>
T value_or_throw(absl::StatusOr<T> result) {
  if (!result.ok()) throw RpcError(std::move(result).status());
  return *std::move(result);
}

}  // namespace ferry

#define FERRY_INTERNAL_CONCAT_INNER(a, b) a##b
#define FERRY_INTERNAL_CONCAT(a, b) FERRY_INTERNAL_CONCAT_INNER(a, b)

// Returns the status from the enclosing function when `expr` is not OK.
#define FERRY_RETURN_IF_ERROR(expr)                  \
  do {                                               \
    ::absl::Status ferry_status_ = (expr);           \
    if (!ferry_status_.ok()) return ferry_status_;   \
  } while (0)

// `lhs` = the value of the StatusOr `expr`, or returns its status.
#define FERRY_ASSIGN_OR_RETURN(lhs, expr) \
  FERRY_INTERNAL_ASSIGN_OR_RETURN(FERRY_INTERNAL_CONCAT(ferry_statusor_, __LINE__), lhs, expr)
#define FERRY_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, expr) \
  auto tmp = (expr);                                    \
  if (!tmp.ok()) return std::move(tmp).status();        \
  lhs = *std::move(tmp)

namespace ferry::internal {
// Debian's Abseil is built with its own absl::string_view (not std::string_view), so
// absl::StrCat and friends need this bridge for std::string_view arguments.
inline absl::string_view av(std::string_view s) { return absl::string_view(s.data(), s.size()); }
}  // namespace ferry::internal
