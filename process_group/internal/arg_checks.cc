#include "process_group/internal/arg_checks.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace ferry::internal::pg {

std::string ranks_string(const std::vector<int>& ranks) { return absl::StrCat("[", absl::StrJoin(ranks, ", "), "]"); }

absl::Status not_member_error(std::string_view name, const std::vector<int>& ranks) {
  return absl::FailedPreconditionError(absl::StrCat(internal::av(name), ": this process is not a member of the group ",
                                                    ranks_string(ranks),
                                                    " (new_group left it out); only members may use it"));
}

absl::Status check_tensor(std::string_view name, std::string_view what, const Tensor& t) {
  if (!t.defined()) return absl::InvalidArgumentError(absl::StrCat(internal::av(name), ": ", internal::av(what),
                                                                   " is undefined"));
  return absl::OkStatus();
}

absl::Status check_root(std::string_view name, std::string_view what, int root, int size) {
  if (root < 0 || root >= size) {
    return absl::InvalidArgumentError(absl::StrCat(internal::av(name), ": ", internal::av(what), " ", root,
                                                   " is out of range for a group of ", size, " ranks"));
  }
  return absl::OkStatus();
}

absl::Status check_list(std::string_view name, std::string_view list_name, const std::vector<Tensor>& list,
                        const Tensor& like, int size) {
  if (static_cast<int>(list.size()) != size) {
    return absl::InvalidArgumentError(absl::StrCat(internal::av(name), ": ", internal::av(list_name), " has ",
                                                   list.size(), " tensors; expected one per rank (", size, ")"));
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const Tensor& t = list[i];
    if (!t.defined()) {
      return absl::InvalidArgumentError(
          absl::StrCat(internal::av(name), ": ", internal::av(list_name), "[", i, "] is undefined"));
    }
    if (t.dtype() != like.dtype() || t.shape() != like.shape()) {
      return absl::InvalidArgumentError(absl::StrCat(
          internal::av(name), ": ", internal::av(list_name), "[", i, "] is ", dtype_name(t.dtype()), " ",
          internal::shape_string(t.shape()), "; expected ", dtype_name(like.dtype()), " ",
          internal::shape_string(like.shape()), " like the local tensor"));
    }
  }
  return absl::OkStatus();
}

absl::Status check_peer(std::string_view name, std::string_view what, int peer, int rank, int size) {
  FERRY_RETURN_IF_ERROR(check_root(name, what, peer, size));
  if (peer == rank) {
    return absl::InvalidArgumentError(
        absl::StrCat(internal::av(name), ": ", internal::av(what), " ", peer, " is this process's own rank"));
  }
  return absl::OkStatus();
}

}  // namespace ferry::internal::pg
