// File: process_group/internal/header.h
//
// The small fixed-size header every rank contributes before a collective moves any
// data. All ranks all-gather their headers and run the same check over the same
// headers, so a mismatch (another collective, shape, dtype, root or reduce op), or a
// rank whose own arguments were rejected, fails every rank at once with one message
// instead of a hang or undefined behaviour inside Gloo.
//
//   CollectiveHeader h = make_header(CollectiveKind::kAllReduce, &tensor, 0, ReduceOp::kSum, absl::OkStatus());
//   std::vector<CollectiveHeader> all = ...;   // all-gathered
//   FERRY_RETURN_IF_ERROR(check_headers(all, local_error));
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "process_group/process_group.h"
#include "tensor/tensor.h"

namespace ferry::internal {

enum class CollectiveKind : uint8_t {
  kBroadcast = 1,
  kAllReduce = 2,
  kReduce = 3,
  kAllGather = 4,
  kGather = 5,
  kScatter = 6,
  kBarrier = 7,
  kAllGatherBytes = 8,
};
const char* collective_name(CollectiveKind kind);

// Trivially copyable; travels as raw bytes between ranks of one build.
struct CollectiveHeader {
  static constexpr uint32_t kMagic = 0x46505247;  // "FPRG"
  static constexpr int kMaxDims = 8;
  static constexpr size_t kMaxError = 152;

  uint32_t magic = kMagic;
  uint8_t kind = 0;
  uint8_t dtype = 0;
  uint8_t reduce_op = 0;
  uint8_t has_error = 0;
  int32_t root = 0;
  int32_t ndim = 0;
  int64_t numel = 0;
  uint64_t shape_hash = 0;
  int64_t dims[kMaxDims] = {};
  // The sending rank's FERRY_MAX_MESSAGE_BYTES: an all_gather_bytes whose total is
  // over any rank's limit fails on every rank alike, before anything is allocated.
  uint64_t max_bytes = 0;
  char error[kMaxError] = {};
};
static_assert(sizeof(CollectiveHeader) == 256);

// The header for this rank. `tensor` may be null (barrier, bytes); for
// kAllGatherBytes, `numel` carries the byte count instead. A non-OK `local_error` is
// carried (truncated) so the other ranks can say which rank failed and why.
// `max_bytes` is this process's max_message_bytes().
CollectiveHeader make_header(CollectiveKind kind, const Tensor* tensor, int root, ReduceOp op,
                             const absl::Status& local_error, int64_t numel = 0);

// Largest dimension count a header may announce (tensors record their first kMaxDims
// dimensions, and count the rest).
inline constexpr int32_t kMaxHeaderDims = 64;
// Largest byte count one rank may contribute to an all_gather_bytes (1 TiB).
inline constexpr int64_t kMaxGatherBytes = int64_t{1} << 40;

// Whether a header that came from group rank `rank` of `group_size` ranks is
// well-formed, checked before any field is used: the magic, a known collective, a
// valid dtype and reduce op, a root inside the group, 0 <= ndim <= kMaxHeaderDims,
// non-negative dimensions whose product is numel, and a byte count (numel times the
// dtype's size) that fits in int64. kDataLoss naming the rank and the field otherwise.
// Headers that carry an error are checked only as far as their kind.
absl::Status validate_header(const CollectiveHeader& h, size_t rank, size_t group_size);

// The same checks for a point-to-point message header (its kind is `p2p_kind`, its
// root the sender's sequence number, not a rank) from `sender`; `what` names the
// operation for the error ("recv").
absl::Status validate_p2p_header(const CollectiveHeader& h, uint8_t p2p_kind, int sender, std::string_view what);

// The outcome every rank reaches from the same headers (index = group rank). Each
// header is validated first (validate_header). A rank
// whose own arguments failed gets its own error back; the others get an error naming
// the first such rank. Otherwise fields that must agree are compared with rank 0's.
// An all_gather_bytes whose contributions total more than the smallest max_bytes of
// any rank fails with kResourceExhausted naming the total, the largest contributor
// and the rank whose limit it exceeds.
absl::Status check_headers(const std::vector<CollectiveHeader>& headers, const absl::Status& local_error);

// A hash of the fields check_headers compares (the collective, and as the kind uses
// them: root, reduce op, dtype, shape). Headers that check_headers accepts have equal
// signatures; headers it rejects for a mismatch differ, but for a hash collision.
uint64_t signature(const CollectiveHeader& h);

// Whether a rank with header `h` moves data in its collective: no local error, a
// collective with data (not barrier or all_gather_bytes) and at least one element.
// Ranks run such a collective before the headers are checked (see group_impl.h).
bool moves_data(const CollectiveHeader& h);

// The Gloo tag of collective number `seq`'s data: the signature's low 24 bits and the
// sequence number's low 8. Ranks whose arguments differ use different slots, so Gloo
// never matches messages of different sizes; 256 collectives of one group never run
// at once (a rank completes one only after every rank has entered it).
uint32_t data_tag(uint64_t signature, uint32_t seq);

// The header in front of a byte message (send_bytes): its size says how much data
// follows. Trivially copyable, like CollectiveHeader.
struct BytesHeader {
  static constexpr uint32_t kMagic = 0x314d4246;  // "FBM1"
  uint32_t magic;
  uint32_t seq;   // the sender's message number for (receiver, tag): names the data's slot
  uint64_t size;  // the data's length in bytes
};

// The header at the front of `head` (at least sizeof(BytesHeader) bytes), received
// from `sender` by operation `what`: the one place a byte message's size is read from
// the wire. kDataLoss for a bad magic; kResourceExhausted, naming the size, the sender
// and the limit, for a size over `limit` (the receiver's FERRY_MAX_MESSAGE_BYTES).
absl::StatusOr<BytesHeader> parse_bytes_header(std::string_view what, std::span<const uint8_t> head, int sender,
                                               uint64_t limit);

// "[4, 3]"; for more than kMaxDims dimensions, the first ones and a count.
std::string header_shape_string(const CollectiveHeader& h);

}  // namespace ferry::internal
