#include "process_group/internal/header.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

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

}  // namespace

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

std::string header_shape_string(const CollectiveHeader& h) {
  const int shown = std::min<int>(h.ndim, CollectiveHeader::kMaxDims);
  std::vector<int64_t> dims(h.dims, h.dims + shown);
  if (h.ndim <= CollectiveHeader::kMaxDims) return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
  return absl::StrCat("[", absl::StrJoin(dims, ", "), ", ...] (", h.ndim, " dims)");
}

absl::Status check_headers(const std::vector<CollectiveHeader>& headers, const absl::Status& local_error) {
  if (!local_error.ok()) return local_error;
  for (size_t r = 0; r < headers.size(); ++r) {
    if (headers[r].magic != CollectiveHeader::kMagic) {
      return absl::InternalError(absl::StrCat("collective header from rank ", r, " is corrupt (magic ",
                                              headers[r].magic, ")"));
    }
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
