// Fuzzes the process-group header checks: the input is up to 8 raw 256-byte headers,
// as an all-gather delivers them from peers. Whatever check_headers accepts must be
// safe to use the way the collectives use it: sizes and byte counts that fit, and an
// all_gather_bytes total within every rank's limit. The input's front is also a byte
// message's header (BytesHeader), whose size must be within the receiver's limit.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>
#include <vector>

#include "process_group/internal/header.h"
#include "tensor/dtype.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using ferry::internal::CollectiveHeader;
  const size_t n = std::min<size_t>(size / sizeof(CollectiveHeader), 8);
  if (n == 0) return 0;
  std::vector<CollectiveHeader> headers(n);
  std::memcpy(headers.data(), data, n * sizeof(CollectiveHeader));
  absl::Status local = size % 2 == 0 ? absl::OkStatus() : absl::InvalidArgumentError("local");
  absl::Status s = ferry::internal::check_headers(headers, local);
  for (size_t r = 0; r < n; ++r) (void)ferry::internal::header_shape_string(headers[r]);
  if (s.ok()) {
    const auto kind = static_cast<ferry::internal::CollectiveKind>(headers[0].kind);
    uint64_t total = 0;
    for (const CollectiveHeader& h : headers) {
      if (kind == ferry::internal::CollectiveKind::kBarrier) continue;  // carries no sizes
      if (h.numel < 0) {
        std::fprintf(stderr, "accepted a negative numel\n");
        std::abort();
      }
      if (kind == ferry::internal::CollectiveKind::kAllGatherBytes) {
        if (__builtin_add_overflow(total, static_cast<uint64_t>(h.numel), &total)) std::abort();
        for (const CollectiveHeader& other : headers) {
          if (!headers[0].has_error && total > other.max_bytes) {
            std::fprintf(stderr, "accepted an all_gather_bytes over a rank's limit\n");
            std::abort();
          }
        }
      } else if (kind != ferry::internal::CollectiveKind::kBarrier && !h.has_error) {
        uint64_t bytes;
        if (__builtin_mul_overflow(static_cast<uint64_t>(h.numel),
                                   ferry::dtype_size(static_cast<ferry::DType>(h.dtype)), &bytes)) {
          std::abort();
        }
      }
    }
  }
  // A byte message's header; the limit varies with the input, as FERRY_MAX_MESSAGE_BYTES may.
  const uint64_t limit = (uint64_t{1} << 20) << (size % 16);
  absl::StatusOr<ferry::internal::BytesHeader> bytes =
      ferry::internal::parse_bytes_header("recv_bytes", std::span<const uint8_t>(data, size), 1, limit);
  if (bytes.ok() && bytes->size > limit) {
    std::fprintf(stderr, "accepted a byte message of %llu bytes over the limit of %llu\n",
                 static_cast<unsigned long long>(bytes->size), static_cast<unsigned long long>(limit));
    std::abort();
  }
  CollectiveHeader p2p;
  std::memcpy(&p2p, data, sizeof(p2p));
  if (ferry::internal::validate_p2p_header(p2p, p2p.kind, 1, "recv").ok()) {
    if (p2p.numel < 0 || !ferry::is_valid_dtype(p2p.dtype)) std::abort();
  }
  return 0;
}
