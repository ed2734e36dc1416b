#include "process_group/internal/header.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "serialization/archive.h"

namespace ferry::internal {
namespace {

uint64_t hash_shape(const std::vector<int64_t>& shape) {
  // FNV-1a over the rank and every dimension: equal shapes hash equally on every rank.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(shape.size());
  for (int64_t d : shape) mix(static_cast<uint64_t>(d));
  return h;
}

bool uses_root(CollectiveKind kind) {
  return kind == CollectiveKind::kBroadcast || kind == CollectiveKind::kReduce || kind == CollectiveKind::kGather ||
         kind == CollectiveKind::kScatter;
}

bool uses_reduce_op(CollectiveKind kind) {
  return kind == CollectiveKind::kAllReduce || kind == CollectiveKind::kReduce;
}

bool uses_tensor(CollectiveKind kind) {
  return kind != CollectiveKind::kBarrier && kind != CollectiveKind::kAllGatherBytes;
}

const char* root_name(CollectiveKind kind) {
  return kind == CollectiveKind::kReduce || kind == CollectiveKind::kGather ? "dst" : "src";
}

std::string kind_name(uint8_t kind) {
  if (kind >= 1 && kind <= 8) return collective_name(static_cast<CollectiveKind>(kind));
  return absl::StrCat("an unknown collective (", kind, ")");
}

std::string header_error(const CollectiveHeader& h) {
  return std::string(h.error, strnlen(h.error, CollectiveHeader::kMaxError));
}

// The tensor fields: dtype, ndim, dims, numel and the byte count.
absl::Status validate_tensor_fields(const CollectiveHeader& h, const std::string& from) {
  auto bad = [&](std::string_view what) {
    return absl::DataLossError(absl::StrCat("corrupt collective header from ", from, ": ", std::string(what)));
  };
  if (!is_valid_dtype(h.dtype)) return bad(absl::StrCat("dtype ", h.dtype, " is not a dtype"));
  if (h.ndim < 0 || h.ndim > kMaxHeaderDims) {
    return bad(absl::StrCat(h.ndim, " dimensions (expected 0 to ", kMaxHeaderDims, ")"));
  }
  if (h.numel < 0) return bad(absl::StrCat("numel ", h.numel, " is negative"));
  const int shown = std::min<int>(h.ndim, CollectiveHeader::kMaxDims);
  int64_t product = 1;
  bool overflow = false;
  for (int i = 0; i < shown; ++i) {
    if (h.dims[i] < 0) return bad(absl::StrCat("dimension ", i, " is ", h.dims[i]));
    if (h.dims[i] != 0 && product > INT64_MAX / h.dims[i]) {
      overflow = true;
    } else {
      product *= h.dims[i];
    }
  }
  for (int i = shown; i < CollectiveHeader::kMaxDims; ++i) {
    if (h.dims[i] != 0) return bad(absl::StrCat("dimension ", i, " is set beyond ndim ", h.ndim));
  }
  // With every dimension recorded, their product is the element count; with more, the
  // count must still be a multiple of the recorded ones' product (0 counts as any).
  const bool undefined_tensor = h.ndim == 0 && h.numel == 0;
  if (undefined_tensor) return absl::OkStatus();
  if (h.ndim <= CollectiveHeader::kMaxDims ? (overflow || product != h.numel)
                                           : (!overflow && product != 0 && h.numel % product != 0)) {
    return bad(absl::StrCat("numel ", h.numel, " does not match shape ", header_shape_string(h)));
  }
  const int64_t size = static_cast<int64_t>(dtype_size(static_cast<DType>(h.dtype)));
  if (h.numel > INT64_MAX / size) {
    return bad(absl::StrCat(h.numel, " elements of ", dtype_name(static_cast<DType>(h.dtype)),
                            " overflow a byte count"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status validate_header(const CollectiveHeader& h, size_t rank, size_t group_size) {
  const std::string from = absl::StrCat("rank ", rank);
  auto bad = [&](std::string_view what) {
    return absl::DataLossError(absl::StrCat("corrupt collective header from ", from, ": ", std::string(what)));
  };
  if (h.magic != CollectiveHeader::kMagic) return bad(absl::StrCat("magic ", h.magic));
  if (h.kind < 1 || h.kind > 8) return bad(absl::StrCat("unknown collective ", h.kind));
  if (h.has_error > 1) return bad(absl::StrCat("error flag ", h.has_error));
  if (h.has_error) return absl::OkStatus();
  const auto kind = static_cast<CollectiveKind>(h.kind);
  if (uses_root(kind) && (h.root < 0 || static_cast<size_t>(h.root) >= group_size)) {
    return bad(absl::StrCat(root_name(kind), " ", h.root, " is outside the group of ", group_size));
  }
  if (uses_reduce_op(kind) && h.reduce_op > static_cast<uint8_t>(ReduceOp::kMax)) {
    return bad(absl::StrCat("reduce op ", h.reduce_op, " is not a reduce op"));
  }
  if (kind == CollectiveKind::kAllGatherBytes && (h.numel < 0 || h.numel > kMaxGatherBytes)) {
    return bad(absl::StrCat("a contribution of ", h.numel, " bytes (expected 0 to ", kMaxGatherBytes, ")"));
  }
  if (uses_tensor(kind)) return validate_tensor_fields(h, from);
  return absl::OkStatus();
}

absl::Status validate_p2p_header(const CollectiveHeader& h, uint8_t p2p_kind, int sender, std::string_view what) {
  const std::string from = absl::StrCat("rank ", sender, " (", std::string(what), ")");
  if (h.magic != CollectiveHeader::kMagic || h.kind != p2p_kind) {
    return absl::DataLossError(absl::StrCat("corrupt message header from ", from, ": magic ", h.magic, ", kind ",
                                            h.kind));
  }
  return validate_tensor_fields(h, from);
}

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kReduce: return "reduce";
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kGather: return "gather";
    case CollectiveKind::kScatter: return "scatter";
    case CollectiveKind::kBarrier: return "barrier";
    case CollectiveKind::kAllGatherBytes: return "all_gather_bytes";
  }
  return "unknown collective";
}

CollectiveHeader make_header(CollectiveKind kind, const Tensor* tensor, int root, ReduceOp op,
                             const absl::Status& local_error, int64_t numel) {
  CollectiveHeader h;
  h.kind = static_cast<uint8_t>(kind);
  h.reduce_op = static_cast<uint8_t>(op);
  h.root = root;
  h.numel = numel;
  h.max_bytes = max_message_bytes();
  if (tensor != nullptr && tensor->defined()) {
    h.dtype = static_cast<uint8_t>(tensor->dtype());
    h.ndim = static_cast<int32_t>(tensor->dim());
    h.numel = tensor->numel();
    h.shape_hash = hash_shape(tensor->shape());
    for (int i = 0; i < std::min<int>(h.ndim, CollectiveHeader::kMaxDims); ++i) h.dims[i] = tensor->shape()[i];
  }
  if (!local_error.ok()) {
    h.has_error = 1;
    std::string msg(local_error.message());
    if (msg.size() >= CollectiveHeader::kMaxError) {
      msg.resize(CollectiveHeader::kMaxError - 4);
      msg += "...";
    }
    std::memcpy(h.error, msg.data(), msg.size());
  }
  return h;
}

absl::StatusOr<BytesHeader> parse_bytes_header(std::string_view what, std::span<const uint8_t> head, int sender,
                                               uint64_t limit) {
  const std::string name(what);
  BytesHeader header;
  if (head.size() < sizeof(header)) {
    return absl::DataLossError(absl::StrCat(name, ": the message header from rank ", sender, " is truncated"));
  }
  std::memcpy(&header, head.data(), sizeof(header));
  if (header.magic != BytesHeader::kMagic) {
    return absl::DataLossError(absl::StrCat(name, ": the message header from rank ", sender, " is corrupt"));
  }
  if (header.size > limit) {
    return absl::ResourceExhaustedError(absl::StrCat(
        name, ": rank ", sender, " announced a message of ", header.size, " bytes, over this process's limit of ",
        limit, " bytes per message (FERRY_MAX_MESSAGE_BYTES); refused without receiving it"));
  }
  return header;
}

uint64_t signature(const CollectiveHeader& h) {
  uint64_t x = 1469598103934665603ull;
  auto mix = [&x](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      x ^= (v >> (8 * i)) & 0xff;
      x *= 1099511628211ull;
    }
  };
  mix(h.kind);
  mix(h.has_error);
  if (h.kind < 1 || h.kind > 8 || h.has_error) return x;
  const auto kind = static_cast<CollectiveKind>(h.kind);
  if (uses_root(kind)) mix(static_cast<uint64_t>(static_cast<uint32_t>(h.root)));
  if (uses_reduce_op(kind)) mix(h.reduce_op);
  if (uses_tensor(kind)) {
    mix(h.dtype);
    mix(static_cast<uint64_t>(static_cast<uint32_t>(h.ndim)));
    mix(static_cast<uint64_t>(h.numel));
    mix(h.shape_hash);
  }
  return x;
}

bool moves_data(const CollectiveHeader& h) {
  if (h.has_error || h.kind < 1 || h.kind > 8) return false;
  return uses_tensor(static_cast<CollectiveKind>(h.kind)) && h.numel > 0;
}

uint32_t data_tag(uint64_t signature, uint32_t seq) {
  // Fold the whole hash into 24 bits, so no part of it is lost.
  const uint64_t folded = signature ^ (signature >> 24) ^ (signature >> 48);
  return static_cast<uint32_t>((folded & 0xffffffu) << 8) | (seq & 0xffu);
}

std::string header_shape_string(const CollectiveHeader& h) {
  const int shown = std::clamp<int>(h.ndim, 0, CollectiveHeader::kMaxDims);
  std::vector<int64_t> dims(h.dims, h.dims + shown);
  if (h.ndim <= CollectiveHeader::kMaxDims) return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
  return absl::StrCat("[", absl::StrJoin(dims, ", "), ", ...] (", h.ndim, " dims)");
}

absl::Status check_headers(const std::vector<CollectiveHeader>& headers, const absl::Status& local_error) {
  if (!local_error.ok()) return local_error;
  for (size_t r = 0; r < headers.size(); ++r) {
    absl::Status valid = validate_header(headers[r], r, headers.size());
    if (!valid.ok()) return valid;
  }
  const CollectiveHeader& base = headers[0];
  // A different collective first: every other comparison would be meaningless.
  for (size_t r = 1; r < headers.size(); ++r) {
    if (headers[r].kind != base.kind) {
      return absl::InvalidArgumentError(absl::StrCat(
          "collective mismatch: rank ", r, " called ", kind_name(headers[r].kind), " while rank 0 called ",
          kind_name(base.kind), " (every rank must call the same collectives in the same order)"));
    }
  }
  const auto kind = static_cast<CollectiveKind>(base.kind);
  const std::string name = collective_name(kind);
  for (size_t r = 0; r < headers.size(); ++r) {
    if (headers[r].has_error) {
      return absl::InvalidArgumentError(absl::StrCat(name, " failed on rank ", r, ": ", header_error(headers[r])));
    }
  }
  if (kind == CollectiveKind::kAllGatherBytes) {
    // Every rank allocates the total: it must fit every rank's limit. Each
    // contribution is at most kMaxGatherBytes (validate_header); the sum saturates.
    uint64_t total = 0;
    size_t largest = 0;
    size_t strictest = 0;
    for (size_t r = 0; r < headers.size(); ++r) {
      const auto c = static_cast<uint64_t>(headers[r].numel);
      total = c > UINT64_MAX - total ? UINT64_MAX : total + c;
      if (headers[r].numel > headers[largest].numel) largest = r;
      if (headers[r].max_bytes < headers[strictest].max_bytes) strictest = r;
    }
    if (total > headers[strictest].max_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          name, ": the contributions total ", total, " bytes (the largest, ", headers[largest].numel,
          " bytes, from rank ", largest, "), over rank ", strictest, "'s limit of ", headers[strictest].max_bytes,
          " bytes per message (FERRY_MAX_MESSAGE_BYTES)"));
    }
  }
  for (size_t r = 1; r < headers.size(); ++r) {
    const CollectiveHeader& h = headers[r];
    if (uses_root(kind) && h.root != base.root) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": ", root_name(kind), " ", h.root, " on rank ", r,
                                                     " differs from ", base.root, " on rank 0"));
    }
    if (uses_reduce_op(kind) && h.reduce_op != base.reduce_op) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": reduce op ",
                                                     reduce_op_name(static_cast<ReduceOp>(h.reduce_op)), " on rank ",
                                                     r, " differs from ",
                                                     reduce_op_name(static_cast<ReduceOp>(base.reduce_op)),
                                                     " on rank 0"));
    }
    if (uses_tensor(kind)) {
      if (h.dtype != base.dtype) {
        return absl::InvalidArgumentError(
            absl::StrCat(name, ": tensor dtype ", dtype_name(static_cast<DType>(h.dtype)), " on rank ", r,
                         " differs from ", dtype_name(static_cast<DType>(base.dtype)), " on rank 0"));
      }
      if (h.shape_hash != base.shape_hash || h.numel != base.numel || h.ndim != base.ndim) {
        return absl::InvalidArgumentError(absl::StrCat(name, ": tensor shape ", header_shape_string(h), " on rank ", r,
                                                       " differs from ", header_shape_string(base), " on rank 0"));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry::internal
