// File: agents/tcp/protocol.h (not installed)
//
// What the tcp transport writes on a socket: the opener's hello, once, then frames
// both ways. Plain little-endian layouts with no behaviour; agents/tcp/conn.h speaks
// them. A frame is a FrameHead, one Entry per tensor, the tensors' targets one after
// another, the metadata, then each tensor's bytes: the bytes of a tensor are the last
// thing of their frame, so that they can be written from the tensor's memory and read
// into the landing buffer as they are.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ferry::internal::tcp {

inline constexpr uint32_t kHelloMagic = 0x70637466;  // "ftcp"
inline constexpr uint32_t kFrameMagic = 0x6d616c66;  // "flam"
inline constexpr uint16_t kVersion = 1;
// The opener's listening address ("host:port") it sends in its hello: longer is refused
// before anything is allocated for it.
inline constexpr uint16_t kMaxHelloAddress = 256;
// A frame announcing more tensors, a longer target or more target bytes in all is
// refused when its head arrives, before its table or anything else is allocated.
inline constexpr uint32_t kMaxTensors = 1 << 16;
inline constexpr uint32_t kMaxTargetBytes = 4096;
inline constexpr uint64_t kMaxAllTargetBytes = uint64_t{1} << 20;

// The opener's first bytes, followed by `address_bytes` of its listening address.
struct Hello {
  uint32_t magic = kHelloMagic;
  uint16_t version = kVersion;
  uint16_t address_bytes = 0;
};
static_assert(sizeof(Hello) == 8);

struct FrameHead {
  uint32_t magic = kFrameMagic;
  uint32_t tensors = 0;
  uint64_t metadata_bytes = 0;
  uint64_t target_bytes = 0;  // the sum of the entries' target_bytes
};
static_assert(sizeof(FrameHead) == 24);

struct Entry {
  uint64_t length = 0;
  uint32_t target_bytes = 0;
  uint32_t reserved = 0;
};
static_assert(sizeof(Entry) == 16);

}  // namespace ferry::internal::tcp
