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
#include "absl/strings/str_cat.h"
#include "agents/core/buffer_pool.h"
#include "agents/core/transport.h"
#include "base/future.h"
#include "base/logging.h"
#include "base/status.h"

namespace ferry::internal {

// Whether a TensorPipe descriptor is one that ferry's write_wire makes: no payloads,
// and tensors from and to CPU memory. kInvalidArgument naming what else it holds.
inline absl::Status describes_ferry_wire(const tensorpipe::Descriptor& descriptor) {
  if (!descriptor.payloads.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("a TensorPipe message with ", descriptor.payloads.size(),
                                                   " payload(s); ferry sends its metadata and tensors only"));
  }
  for (const tensorpipe::Descriptor::Tensor& t : descriptor.tensors) {
    const bool from_cpu = t.sourceDevice.type == tensorpipe::kCpuDeviceType;
    const bool to_cpu = !t.targetDevice.has_value() || t.targetDevice->type == tensorpipe::kCpuDeviceType;
    if (!from_cpu || !to_cpu) {
      return absl::InvalidArgumentError(absl::StrCat("a TensorPipe tensor from device ", t.sourceDevice.toString(),
                                                     "; ferry's TensorPipe transport carries CPU tensors only"));
    }
  }
  return absl::OkStatus();
}

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
    // TensorPipe throws, on its loop thread, when an allocation does not match its
    // descriptor, and a throw there ends the process. ferry sends no payloads and only
    // CPU tensors, so anything else is a peer that is not ferry, and it is refused
    // before any read is armed for it, authenticated or not.
    if (absl::Status matches = describes_ferry_wire(descriptor); !matches.ok()) {
      pipe->close();
      done(absl::StatusOr<Wire>(std::move(matches)));
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
