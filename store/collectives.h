// File: store/collectives.h
//
// Collectives over any Store, for start-up steps that run before any faster channel
// exists: each rank writes one key and reads the others'. One round trip per rank for
// the gather, plus one per rank for the barrier; no connection between ranks.
//
//   FERRY_ASSIGN_OR_RETURN(std::vector<Bytes> all,
//                          store_all_gather(*store, "ferry/rpc/1/info", rank, size, mine, timeout));
#pragma once

#include <chrono>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "store/store.h"

namespace ferry {

// Every rank's `mine`, by rank. Keys: "<prefix>/<rank>". Errors: kDeadlineExceeded
// after `timeout`, naming the ranks that never wrote (up to 16 of them); the store's.
absl::StatusOr<std::vector<Bytes>> store_all_gather(Store& store, std::string_view prefix, int rank,
                                                    int world_size, const Bytes& mine,
                                                    std::chrono::milliseconds timeout);

// Returns once all `world_size` ranks have arrived. Keys: "<prefix>/arrived",
// "<prefix>/done". Errors as store_all_gather's, with the count of ranks that arrived.
absl::Status store_barrier(Store& store, std::string_view prefix, int world_size, std::chrono::milliseconds timeout);

}  // namespace ferry
