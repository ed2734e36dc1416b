#include "store/collectives.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status.h"

namespace ferry {

absl::StatusOr<std::vector<Bytes>> store_all_gather(Store& store, std::string_view prefix, int rank,
                                                    int world_size, const Bytes& mine,
                                                    std::chrono::milliseconds timeout) {
  FERRY_RETURN_IF_ERROR(store.set(absl::StrCat(internal::av(prefix), "/", rank), mine));
  std::vector<std::string> keys;
  keys.reserve(static_cast<size_t>(world_size));
  for (int r = 0; r < world_size; ++r) keys.push_back(absl::StrCat(internal::av(prefix), "/", r));
  absl::StatusOr<std::vector<Bytes>> all = store.multi_get(keys, timeout);
  if (all.ok() || all.status().code() != absl::StatusCode::kDeadlineExceeded) return all;
  std::vector<int> missing;
  for (int r = 0; r < world_size && missing.size() < 16; ++r) {
    absl::StatusOr<bool> there = store.check({keys[static_cast<size_t>(r)]});
    if (there.ok() && !*there) missing.push_back(r);
  }
  return absl::DeadlineExceededError(absl::StrCat("after ", timeout.count(), " ms, rank(s) ",
                                                  absl::StrJoin(missing, ", "), " of ", world_size,
                                                  " had not arrived at ", internal::av(prefix)));
}

absl::Status store_barrier(Store& store, std::string_view prefix, int world_size, std::chrono::milliseconds timeout) {
  std::string done = absl::StrCat(internal::av(prefix), "/done");
  FERRY_ASSIGN_OR_RETURN(int64_t arrived, store.add(absl::StrCat(internal::av(prefix), "/arrived"), 1));
  if (arrived == world_size) FERRY_RETURN_IF_ERROR(store.set(done, to_bytes("1")));
  absl::Status all = store.wait({done}, timeout);
  if (all.ok() || all.code() != absl::StatusCode::kDeadlineExceeded) return all;
  absl::StatusOr<int64_t> now = store.add(absl::StrCat(internal::av(prefix), "/arrived"), 0);
  return absl::DeadlineExceededError(absl::StrCat("after ", timeout.count(), " ms, only ", now.ok() ? *now : -1,
                                                  " of ", world_size, " rank(s) had arrived at ",
                                                  internal::av(prefix)));
}

}  // namespace ferry
