#include "agents/core/lock_order.h"

#include <cstdio>
#include <cstdlib>

namespace ferry::internal {
namespace {

// The ranks this thread holds, in the order taken. The core never nests more than a
// few; a deeper stack is itself a bug worth stopping on.
constexpr int kMaxHeld = 16;
thread_local LockRank held[kMaxHeld];
thread_local int depth = 0;

[[noreturn]] void fail(const char* what, LockRank rank, LockRank other) {
  std::fprintf(stderr, "ferry: lock order violated: %s %s while holding %s (agents/core/lock_order.h)\n", what,
               lock_rank_name(rank), lock_rank_name(other));
  std::abort();
}

}  // namespace

const char* lock_rank_name(LockRank rank) {
  switch (rank) {
    case LockRank::kListeners: return "kListeners";
    case LockRank::kHooks: return "kHooks";
    case LockRank::kChanges: return "kChanges";
    case LockRank::kFates: return "kFates";
    case LockRank::kWatch: return "kWatch";
    case LockRank::kPinging: return "kPinging";
    case LockRank::kLinks: return "kLinks";
    case LockRank::kAccepted: return "kAccepted";
    case LockRank::kFlow: return "kFlow";
    case LockRank::kSession: return "kSession";
  }
  return "an unknown rank";
}

void lock_rank_enter(LockRank rank) {
  for (int i = 0; i < depth; ++i) {
    if (held[i] >= rank) fail("taking", rank, held[i]);
  }
  if (depth == kMaxHeld) fail("taking", rank, held[depth - 1]);
  held[depth++] = rank;
}

void lock_rank_leave(LockRank rank) {
  // Usually the last one taken; scoped locks may end in any order.
  for (int i = depth - 1; i >= 0; --i) {
    if (held[i] == rank) {
      for (int j = i; j + 1 < depth; ++j) held[j] = held[j + 1];
      --depth;
      return;
    }
  }
}

}  // namespace ferry::internal
