// File: agents/cuda_ipc/cuda_ipc.h
//
// The cuda_ipc device channel (agents/core/device_channel.h): CUDA tensors between
// workers on one host cross as device-to-device copies, their bytes never touching the
// transport. The core chooses it for a peer whose record has a ring line the ring
// reaches (CudaIpcOptions::ring_reaches: same host, same network namespace) when this
// worker's CUDA runtime can export its pools; otherwise, and for a peer that
// refused to import or whose connection cannot pass descriptors, staging carries the
// tensors (or, with cuda_ipc required, by AgentOptions::device_channel or for that peer
// by device_channel_by_peer, the call fails saying why).
//
// Once per peer and device, over the connection's Unix socket (ChannelPort::
// pass_descriptor, SCM_RIGHTS; no ptrace, no fabric handles, no shared PID namespace):
// - the device's pool as a POSIX descriptor (CudaRuntime::export_pool), imported once;
// - this worker's inter-process events of that device (64, reused round robin).
// Per message and device, the sender's channel stream waits for the producer's stream
// and records one of its events; per tensor only the pool's export-pointer data, the
// event's index and a token travel, in the tensor's target (a 0-byte placeholder takes
// the tensor's place in the message). The receiver opens the pointer, makes its own
// channel stream wait on the sender's event, copies the bytes into a tensor of its own
// pool with one device-to-device copy, releases the pointer, records one of its own
// events and tells the sender (a kNotice naming the tokens and that event). The sender
// then makes the tensors' default stream wait on that event and drops them: their
// memory returns to the pool only after the receiver's copy, and no host thread waits
// for a copy anywhere. A lost peer's held tensors are dropped, and what was imported
// from it is released.
//
// A tensor passed to rpc_async must not be written to until the call completes: the
// receiver reads it in place, after the producer's work queued before the call.
//
// Small messages take staging even on one host (CudaIpcOptions::min_bytes): the
// channel's fixed cost per message (its event's record and wait on each side, and the
// notice back) exceeds staging's copies of a few KiB. The per-peer counters
// (device_tensors.<peer>.staging) count them as staged, which they are; with cuda_ipc
// required, every message takes it whatever its size.
//
//   AgentOptions options;
//   options.device_channels.push_back(ferry::make_cuda_ipc_channel());
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "agents/core/device_channel.h"

namespace ferry {

// Where a CUDA echo over cuda_ipc overtakes staging on the emulated runtime
// (docs/cuda.md has the table and the command that measures it on a GPU).
inline constexpr size_t kCudaIpcMinBytes = size_t{64} << 10;

struct CudaIpcOptions {
  // A message whose device tensors to a peer total fewer bytes than this takes the
  // staging channel (0: every message takes cuda_ipc where it can). Ignored towards a
  // peer cuda_ipc is required for (ChannelPort::required_channel_to).
  size_t min_bytes = kCudaIpcMinBytes;
  // Whether the ring reaches the worker whose address record is given (same boot of
  // the same host, same network namespace): the pool travels over that connection, so
  // only such a peer can take cuda_ipc. The backends set the ring's own test
  // (ring_reaches, agents/ring/factory.h); unset, a record with a ring line is taken
  // to be reachable, and a peer elsewhere falls back when its connection cannot pass
  // the pool. Called on calling threads; must be thread-safe.
  std::function<bool(const std::string& record)> ring_reaches;

  // The defaults, min_bytes changed by FERRY_CUDA_IPC_MIN_BYTES (bytes). A malformed
  // value is an error naming the variable and what was expected.
  static absl::StatusOr<CudaIpcOptions> from_environment();
};

// A cuda_ipc channel over the process's CUDA runtime (cuda_runtime()). Thread-safe.
std::shared_ptr<DeviceChannel> make_cuda_ipc_channel(CudaIpcOptions options = {});

}  // namespace ferry
