// File: agents/tensorpipe/address_hold.h (not installed)
//
// Holds a TensorPipe listener's addresses while the listener is replaced. A TensorPipe
// listener that failed one accept fails every later one at once, so the adapter makes
// a new listener (agents/tensorpipe/transport.cc), and the new one must listen where
// peers already look: the same port, the same shm name. TensorPipe's uv transport binds
// on its loop thread and throws there when the bind fails, which ends the process; so
// the adapter takes the addresses here first, and asks TensorPipe only once they are
// free:
//   - "uv" and "ibv" ("127.0.0.1:41234", "[::1]:41234"): a TCP socket with SO_REUSEADDR
//     is bound to the address and left unlistening. The bind succeeds only once the
//     failed listener's socket is closed; while the hold lasts no connect() elsewhere
//     takes the port as its local port, and TensorPipe's own socket (SO_REUSEADDR too)
//     can still bind and listen there.
//   - "shm" (an abstract unix socket name): bound and released at once (a name cannot
//     be shared); if another socket takes the name in between, the shm listener fails
//     its first accept and the adapter tries again.
//
//   FERRY_ASSIGN_OR_RETURN(AddressHold hold, AddressHold::take({"uv://127.0.0.1:41234"}));
//   auto listener = context->listen({"uv://127.0.0.1:41234"});  // then the hold goes
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry::internal {

// Not thread-safe; move-only. Releases what it holds when destroyed.
class AddressHold {
 public:
  // Errors: kUnavailable naming the address when one is still in use (the failed
  // listener has not closed it yet, or another socket took it) or cannot be bound
  // here any more; kInvalidArgument for a URL whose scheme or address it cannot read.
  static absl::StatusOr<AddressHold> take(const std::vector<std::string>& urls);

  AddressHold(AddressHold&& other) noexcept;
  AddressHold& operator=(AddressHold&& other) noexcept;
  AddressHold(const AddressHold&) = delete;
  AddressHold& operator=(const AddressHold&) = delete;
  ~AddressHold();

 private:
  AddressHold() = default;
  void release();

  std::vector<int> fds_;
};

}  // namespace ferry::internal
