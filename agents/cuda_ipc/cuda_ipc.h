// File: agents/cuda_ipc/cuda_ipc.h
//
// The cuda_ipc device channel (agents/core/device_channel.h): CUDA tensors between
// workers on one host cross as device-to-device copies, their bytes never touching the
// transport. The core chooses it for a peer whose record has a ring line (same host)
// when this worker's CUDA runtime can export its pools; otherwise, and for a peer that
// refused to import or whose connection cannot pass descriptors, staging carries the
// tensors (or, with AgentOptions::device_channel = "cuda_ipc", the call fails saying
// why).
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
//   AgentOptions options;
//   options.device_channels.push_back(ferry::make_cuda_ipc_channel());
#pragma once

#include <memory>

#include "agents/core/device_channel.h"

namespace ferry {

// A cuda_ipc channel over the process's CUDA runtime (cuda_runtime()). Thread-safe.
std::shared_ptr<DeviceChannel> make_cuda_ipc_channel();

}  // namespace ferry
