// File: agents/tensorpipe/wire.h (not installed)
//
// Wire <-> TensorPipe message: a message's metadata is the sealed Message, its tensors
// TensorPipe tensors (CPU buffers) whose metadata carries each tensor's target. Reads
// ask `admit` before allocating anything for the tensors a peer announces.
#pragma once

#include <memory>
#include <vector>

#include <tensorpipe/tensorpipe.h>

#include "absl/status/statusor.h"
#include "agents/core/buffer_pool.h"
#include "agents/core/transport.h"
#include "base/future.h"
#include "base/logging.h"
#include "base/status.h"

namespace ferry::internal {

// Reads one whole message from `pipe`: the descriptor, then, if admit(metadata bytes,
// tensor lengths) allows it, the tensors into buffers allocated once each.
// done(StatusOr<Wire>) runs on the loop thread.
template <typename Admit, typename Done>
void read_wire(const std::shared_ptr<tensorpipe::Pipe>& pipe, const std::shared_ptr<BufferPool>& pool, Admit admit,
               Done done) {
  namespace tp = ::tensorpipe;
  pipe->readDescriptor([pipe, pool, admit = std::move(admit), done = std::move(done)](
                           const tp::Error& error, tp::Descriptor descriptor) mutable {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    if (error) {
      done(absl::StatusOr<Wire>(absl::UnavailableError(error.what())));
      return;
    }
    std::vector<uint64_t> lengths;
    lengths.reserve(descriptor.tensors.size());
    for (const tp::Descriptor::Tensor& t : descriptor.tensors) lengths.push_back(t.length);
    if (absl::Status fits = admit(descriptor.metadata.size(), lengths); !fits.ok()) {
      pipe->close();
      done(absl::StatusOr<Wire>(fits));
      return;
    }
    tp::Allocation allocation;
    Wire wire;
    wire.tensors.reserve(descriptor.tensors.size());
    wire.targets.reserve(descriptor.tensors.size());
    allocation.tensors.reserve(descriptor.tensors.size());
    for (const tp::Descriptor::Tensor& t : descriptor.tensors) {
      absl::StatusOr<Tensor> buffer = receive_buffer(pool, t.length);
      if (!buffer.ok()) {
        // Out of memory: the pipe cannot skip the bytes, so it is unusable from here.
        FERRY_LOG(ERROR) << "cannot allocate a " << t.length << "-byte receive buffer: " << buffer.status();
        pipe->close();
        done(absl::StatusOr<Wire>(buffer.status()));
        return;
      }
      allocation.tensors.push_back(tp::Allocation::Tensor{tp::CpuBuffer{buffer->data()}});
      wire.targets.push_back(t.metadata);
      wire.tensors.push_back(*std::move(buffer));
    }
    wire.metadata = std::move(descriptor.metadata);
    pipe->read(std::move(allocation), [wire = std::move(wire), done = std::move(done)](const tp::Error& error) mutable {
      TransportThreadScope transport_thread;
      AgentThreadScope agent_thread;
      if (error) {
        done(absl::StatusOr<Wire>(absl::UnavailableError(error.what())));
        return;
      }
      done(absl::StatusOr<Wire>(std::move(wire)));
    });
  });
}

// Writes `wire` on `pipe`; the tensors' storage lives until TensorPipe is done with it.
template <typename Done>
void write_wire(const std::shared_ptr<tensorpipe::Pipe>& pipe, Wire wire, Done done) {
  namespace tp = ::tensorpipe;
  tp::Message out;
  out.metadata = std::move(wire.metadata);
  out.tensors.reserve(wire.tensors.size());
  for (size_t i = 0; i < wire.tensors.size(); ++i) {
    tp::Message::Tensor t;
    t.buffer = tp::CpuBuffer{wire.tensors[i].data()};
    t.length = wire.tensors[i].nbytes();
    if (i < wire.targets.size()) t.metadata = std::move(wire.targets[i]);
    out.tensors.push_back(std::move(t));
  }
  pipe->write(std::move(out), [tensors = std::move(wire.tensors), done = std::move(done)](const tp::Error& error) mutable {
    TransportThreadScope transport_thread;
    AgentThreadScope agent_thread;
    done(error);
  });
}

}  // namespace ferry::internal
