// File: process_group/internal/arg_checks.h
//
// The argument checks ProcessGroup's calls share. Each returns OK or an error naming
// the call (`name`) and the argument, e.g.
//
//   check_root("broadcast", "src", 3, 2)
//   // InvalidArgument "broadcast: src 3 is out of range for a group of 2 ranks"
//
// A collective's check rides in its header rather than failing at once, so every rank
// fails together (see ProcessGroup::Impl::enqueue). Internal, never installed.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "tensor/tensor.h"

namespace ferry::internal::pg {

// "[0, 2, 3]".
std::string ranks_string(const std::vector<int>& ranks);

// Why a handle of a group this process is not a member of cannot run `name`.
absl::Status not_member_error(std::string_view name, const std::vector<int>& ranks);

absl::Status check_tensor(std::string_view name, std::string_view what, const Tensor& t);

// `root` (called `what`) names a rank of a group of `size`.
absl::Status check_root(std::string_view name, std::string_view what, int root, int size);

// Checks a list of world-size tensors that must each look like `like`.
absl::Status check_list(std::string_view name, std::string_view list_name, const std::vector<Tensor>& list,
                        const Tensor& like, int size);

// Like check_root, and `peer` is not this process's own `rank`.
absl::Status check_peer(std::string_view name, std::string_view what, int peer, int rank, int size);

}  // namespace ferry::internal::pg
