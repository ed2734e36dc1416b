// File: agents/ring/protocol.h (not installed)
//
// The ring transport's wire format, in one place: the two packets a connection's
// socket carries when it opens (the connector's hello, the acceptor's reply), the
// frames written into its rings, and the limits a receiver holds a peer to. Plain
// layouts with no behaviour; the endpoint (agents/ring/endpoint.h) speaks the packets,
// the pipe (agents/ring/pipe.h) the frames.
//
// Every field comes from a peer: a receiver checks it against these limits before it
// allocates or maps anything it names.
#pragma once

#include <cstddef>
#include <cstdint>

#include "agents/ring/ring.h"

namespace ferry::internal::ring {

inline constexpr uint32_t kMagic = 0x676e6972;  // "ring"
// 2: the bell's news; 3: the probe in the address, no verdict; 4: an acceptor may send its
// own calls on a connection (a worker of version 3 would take them for stray replies);
// 5: bells travel only once the core authenticated the peer (kBell), wakes before that
// over the socket (kWake).
inline constexpr uint32_t kVersion = 5;
inline constexpr size_t kMinRing = 4096;
inline constexpr size_t kMaxRing = size_t{1} << 30;
// A message announcing more tensors, or a longer target, is refused before anything is
// allocated for it.
inline constexpr uint32_t kMaxTensors = 1 << 16;
inline constexpr uint32_t kMaxTargetBytes = 4096;

// Socket packets: the hello (with the segment's memfd) and the reply. Each says whether
// its sender can read the other in place: the connector probes the acceptor before it
// connects, with the probe its address carries, so no third packet (and no third
// wake-up of the acceptor's control thread) is needed for that.
// kDescriptor: after the hello, either side may pass a descriptor (Connection::
// pass_descriptor): a Packet whose probe_addr is the tag and ring_bytes the length of
// the note that follows it in the same packet, with the descriptor, if any, attached.
// kBell: the sender's bell (its memfd attached), sent once its core authenticated the
// receiver (Connection::authenticated): every peer that holds a worker's bell can
// write it, so a stranger never gets it. kWake: the sender wrote and has no bell of
// the receiver's to ring (SegmentHeader::wake_sent); the receiver's control thread
// rings its own bell for it, for an unauthenticated peer a bounded number of times.
enum PacketKind : uint32_t { kHello = 1, kReply = 2, kDescriptor = 3, kBell = 4, kWake = 5 };
struct Packet {
  uint32_t magic = kMagic;
  uint32_t version = kVersion;
  uint32_t kind = 0;
  uint32_t pid = 0;
  uint32_t reads_you = 0;  // the sender could read the receiver's probe in place
  // The bit of the sender's bell (ring::Bell::news) that the receiver sets after
  // writing to this connection; ring::kNoSlot: none, the sender reads it on every poll.
  uint32_t slot = ring::kNoSlot;
  uint64_t ring_bytes = 0;
  uint64_t probe_addr = 0;
  uint64_t probe_value = 0;
};

// Ring frames: a fixed part, then per tensor an entry, then the targets, the metadata
// and the tensors' bytes (those not read in place).
enum FrameKind : uint32_t { kMessage = 1, kAck = 2 };
struct Fixed {
  uint32_t kind;
  uint32_t tensors;
  uint64_t metadata_bytes;
  uint64_t seq;  // kAck: the message whose in-place tensors the receiver is done with
};
struct Entry {
  uint64_t length;
  uint64_t address;  // in the sender's memory, to read in place; 0: the bytes follow
  uint32_t target_bytes;
  uint32_t pad;
};
static_assert(sizeof(Fixed) == 24 && sizeof(Entry) == 24);

}  // namespace ferry::internal::ring
