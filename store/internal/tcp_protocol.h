// TCPStore's wire protocol, shared by the libuv server and the blocking client.
// Internal: not installed.
//
// Every message is a frame: a little-endian u32 length, then that many body bytes.
// A request body is an opcode byte and its fields; a response body is a status code
// byte (absl::StatusCode), then a message string when the code is not OK, else the
// op's result. Strings and byte values are a u32 length and the bytes; integers are
// little-endian. The first request on a connection must be kHello (magic, version,
// whether this connection counts as a worker, and, when the client has a job token,
// a string holding its nonce); the server answers with its version or an error, and
// closes the connection on a mismatch.
//
// With a job token (base/auth.h; docs/security.md) the hello starts a challenge-
// response: the client's hello carries nonce_c; the server answers OK, its version,
// nonce_s and proof_s = proof(token, "ferry-store-server", {nonce_c, nonce_s}); the
// client checks proof_s and sends kAuth with proof_c = proof(token,
// "ferry-store-client", {nonce_c, nonce_s}); the server answers OK and its version,
// or kUnauthenticated and closes. A client whose check of proof_s fails sends kAuth
// with an empty proof instead (a refusal: its real proof would let an impostor test
// token guesses offline) and closes; the server logs the wrong token. Only then does it serve requests (and count the
// connection as a worker). A server without a token answers a hello without a nonce
// as before: the protocol without tokens is unchanged. Requests on one connection are
// answered in order; a blocking request (get, wait, multi_get) carries its timeout and
// the server answers it with kDeadlineExceeded itself when it passes.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "base/logging.h"
#include "store/store.h"

namespace ferry::internal::tcp_store {

inline constexpr uint32_t kMagic = 0x53595246;  // "FRYS" on the wire
inline constexpr uint32_t kProtocolVersion = 1;
inline constexpr size_t kFrameHeaderBytes = 4;

enum class Op : uint8_t {
  kHello = 1,
  kSet = 2,
  kGet = 3,
  kAdd = 4,
  kCompareSet = 5,
  kCheck = 6,
  kWait = 7,
  kDeleteKey = 8,
  kNumKeys = 9,
  kMultiGet = 10,
  kMultiSet = 11,
  kAuth = 12,
};

// The op's name for logs and errors ("get"), or "unknown op N".
std::string op_name(uint8_t op);

// Appends little-endian fields to a frame; the frame's length is filled in by finish().
// A field longer than a u32 length can say is not appended; too_large() then tells the
// caller, which must refuse the message before finish().
class Writer {
 public:
  Writer() : buf_(kFrameHeaderBytes, 0) {}
  Writer& u8(uint8_t v) {
    buf_.push_back(v);
    logical_ += 1;
    return *this;
  }
  Writer& u32(uint32_t v) { return raw_le(v, 4); }
  Writer& u64(uint64_t v) { return raw_le(v, 8); }
  Writer& i64(int64_t v) { return raw_le(static_cast<uint64_t>(v), 8); }
  Writer& bytes(const void* data, size_t n) {
    if (n > UINT32_MAX) {
      logical_ += 4 + static_cast<uint64_t>(n);
      return *this;
    }
    u32(static_cast<uint32_t>(n));
    const uint8_t* p = static_cast<const uint8_t*>(data);
    buf_.insert(buf_.end(), p, p + n);
    logical_ += n;
    return *this;
  }
  Writer& str(std::string_view s) { return bytes(s.data(), s.size()); }
  Writer& bytes(const Bytes& b) { return bytes(b.data(), b.size()); }
  // The body's size as written so far, fields that did not fit included.
  uint64_t body_size() const { return logical_; }
  // Whether the body cannot be framed: a field or the whole body over 4 GiB - 1.
  bool too_large() const { return logical_ > UINT32_MAX || logical_ != buf_.size() - kFrameHeaderBytes; }
  // The whole frame, header included; leaves the writer empty. Callers check
  // too_large() and their message limit first: a frame length never wraps.
  Bytes finish() {
    FERRY_CHECK(!too_large()) << "store frame of " << logical_ << " bytes";
    uint32_t n = static_cast<uint32_t>(buf_.size() - kFrameHeaderBytes);
    for (int i = 0; i < 4; ++i) buf_[i] = static_cast<uint8_t>(n >> (8 * i));
    logical_ = 0;
    return std::move(buf_);
  }

 private:
  Writer& raw_le(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) buf_.push_back(static_cast<uint8_t>(v >> (8 * i)));
    logical_ += static_cast<uint64_t>(n);
    return *this;
  }
  Bytes buf_;
  uint64_t logical_ = 0;
};

// Reads fields from a frame body. Every read fails (returns false) past the end, so a
// truncated message is detected, never read beyond.
class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool u8(uint8_t* v) {
    if (left() < 1) return false;
    *v = *p_++;
    return true;
  }
  bool u32(uint32_t* v) {
    uint64_t x;
    if (!raw_le(&x, 4)) return false;
    *v = static_cast<uint32_t>(x);
    return true;
  }
  bool u64(uint64_t* v) { return raw_le(v, 8); }
  bool i64(int64_t* v) {
    uint64_t x;
    if (!raw_le(&x, 8)) return false;
    *v = static_cast<int64_t>(x);
    return true;
  }
  bool str(std::string* s) {
    uint32_t n;
    if (!u32(&n) || left() < n) return false;
    s->assign(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return true;
  }
  bool bytes(Bytes* b) {
    uint32_t n;
    if (!u32(&n) || left() < n) return false;
    b->assign(p_, p_ + n);
    p_ += n;
    return true;
  }
  // A count of following items, each at least `min_item_bytes` long: rejects counts
  // the remaining bytes cannot hold, so a hostile count cannot make us reserve memory.
  bool count(uint32_t* n, size_t min_item_bytes) {
    return u32(n) && static_cast<uint64_t>(*n) * min_item_bytes <= left();
  }
  size_t left() const { return static_cast<size_t>(end_ - p_); }
  bool done() const { return p_ == end_; }

 private:
  bool raw_le(uint64_t* v, int n) {
    if (left() < static_cast<size_t>(n)) return false;
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= static_cast<uint64_t>(p_[i]) << (8 * i);
    p_ += n;
    *v = x;
    return true;
  }
  const uint8_t* p_;
  const uint8_t* end_;
};

inline uint32_t read_frame_length(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}

}  // namespace ferry::internal::tcp_store
