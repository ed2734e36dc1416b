// File: agents/ring/ring.h (not installed)
//
// The shared-memory pieces of the ring transport: a single-producer single-consumer
// byte ring per direction of a connection, and a bell (a futex word) per endpoint that
// a peer rings after writing, so that an idle endpoint sleeps instead of polling.
//
// Every word here lives in memory a peer can write, so nothing read from it is
// trusted: a head or tail that cannot be right is reported as corrupt, never followed.
#pragma once

#include <chrono>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace ferry::internal::ring {

inline constexpr size_t kLine = 64;

// One direction of a connection: byte counts since the connection opened.
struct RingHeader {
  alignas(kLine) std::atomic<uint64_t> head{0};  // published by the producer
  alignas(kLine) std::atomic<uint64_t> tail{0};  // released by the consumer
  // Set by a producer that has more to write than fits; the consumer rings the
  // producer's bell once it frees space.
  alignas(kLine) std::atomic<uint32_t> producer_waiting{0};
};

// The first page of a connection's segment; the two rings' bytes follow it.
struct SegmentHeader {
  RingHeader forward;   // connector -> acceptor
  RingHeader backward;  // acceptor -> connector
  // Set by a side before it lets go of tensors the other side may still be reading in
  // place (index 0: the connector, 1: the acceptor).
  alignas(kLine) std::atomic<uint32_t> closed[2] = {0, 0};
  // Set by a side (indexed as `closed`) that told the other over the socket that it
  // wrote (a kWake packet: it has no bell of the other's yet), and cleared by the
  // other's control thread as the packet arrives: one such packet at a time each way.
  alignas(kLine) std::atomic<uint32_t> wake_sent[2] = {0, 0};
};
inline constexpr size_t kHeaderBytes = 4096;
static_assert(sizeof(SegmentHeader) <= kHeaderBytes);

inline constexpr size_t kBellBytes = 4096;
// Connections into one endpoint that can have a bit in its bell's news.
inline constexpr size_t kNewsWords = (kBellBytes - 2 * kLine) / sizeof(uint64_t);
inline constexpr uint32_t kSlots = static_cast<uint32_t>(kNewsWords * 64);
inline constexpr uint32_t kNoSlot = UINT32_MAX;

// An endpoint's wake-up word, in a page of its own that every authenticated peer maps
// (a peer gets it only once this worker's core found it a member: Connection::
// authenticated; before, it wakes this worker over the socket), and its news:
// one bit per connection into it (the connection's slot, chosen by this endpoint),
// which the peer sets after it writes, so that an endpoint with many connections
// reads only those with something new instead of checking every ring on each poll.
// Such a peer can set or clear any bit; the owner treats news as a hint and reads every
// ring again whenever it wakes from sleep.
struct Bell {
  alignas(kLine) std::atomic<uint32_t> seq{0};
  alignas(kLine) std::atomic<uint32_t> sleeping{0};
  alignas(kLine) std::atomic<uint64_t> news[kNewsWords] = {};
};
static_assert(sizeof(Bell) <= kBellBytes);

// Shared (inter-process) futex wait and wake on `word`; a wait with a positive
// `timeout` returns after at most that long.
void futex_wait(std::atomic<uint32_t>* word, uint32_t expected,
                std::chrono::microseconds timeout = std::chrono::microseconds(0));
void futex_wake(std::atomic<uint32_t>* word);

// Tells the owner of `bell` that connection `slot` (kNoSlot: none) has news, and wakes
// it if it sleeps or is about to; only one of several concurrent ringers pays for the
// system call. The fence orders what was published before it against both the news
// and the sleeping flag, which the owner reads after clearing or setting them: a bit
// found already set is left alone (no shared line written per message), since the
// owner reads the ring only after it clears the bit.
inline void ring(Bell* bell, uint32_t slot = kNoSlot) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (slot < kSlots) {
    std::atomic<uint64_t>& word = bell->news[slot / 64];
    const uint64_t bit = uint64_t{1} << (slot % 64);
    if ((word.load(std::memory_order_relaxed) & bit) == 0) word.fetch_or(bit, std::memory_order_seq_cst);
  }
  // seq_cst, not relaxed: ordered after the news written just above.
  if (bell->sleeping.load(std::memory_order_seq_cst) != 0 && bell->sleeping.exchange(0) != 0) {
    bell->seq.fetch_add(1, std::memory_order_release);
    futex_wake(&bell->seq);
  }
}

// The writing side of a ring. Not thread-safe: one writer at a time.
class Producer {
 public:
  Producer() = default;
  Producer(RingHeader* header, uint8_t* data, uint64_t capacity)
      : header_(header), data_(data), capacity_(capacity), mask_(capacity - 1) {}

  // Bytes that can be written now (`free`), at least `want` of them if the consumer
  // has freed that much; false when the consumer's tail is impossible. The tail is
  // read only when the one last read leaves less than `want` free: the consumer
  // writes that line, and reading it for every message cost a cross-core miss each.
  // A stale tail only understates the room, since the consumer's tail only grows.
  bool space(uint64_t& free, uint64_t want = UINT64_MAX) {
    if (const uint64_t room = capacity_ - (head_ - tail_seen_); room >= want) {
      free = room;
      return true;
    }
    uint64_t tail = header_->tail.load(std::memory_order_acquire);
    uint64_t used = head_ - tail;
    if (used > capacity_) return false;
    tail_seen_ = tail;
    free = capacity_ - used;
    return true;
  }
  // Copies `n` bytes (n <= space) behind what was written; published by publish().
  void put(const void* src, uint64_t n) {
    uint64_t at = head_ & mask_;
    uint64_t first = n < capacity_ - at ? n : capacity_ - at;
    std::memcpy(data_ + at, src, first);
    std::memcpy(data_, static_cast<const uint8_t*>(src) + first, n - first);
    head_ += n;
  }
  bool unpublished() const { return header_->head.load(std::memory_order_relaxed) != head_; }
  void publish() { header_->head.store(head_, std::memory_order_release); }
  RingHeader* header() const { return header_; }

 private:
  RingHeader* header_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t mask_ = 0;
  uint64_t head_ = 0;
  uint64_t tail_seen_ = 0;  // the consumer's tail as last read
};

// The reading side of a ring. Not thread-safe: one reader.
class Consumer {
 public:
  Consumer() = default;
  Consumer(RingHeader* header, uint8_t* data, uint64_t capacity)
      : header_(header), data_(data), capacity_(capacity), mask_(capacity - 1) {}

  // Bytes readable now; false when the producer's head is impossible.
  bool available(uint64_t& n) {
    uint64_t head = header_->head.load(std::memory_order_acquire);
    n = head - tail_;
    return n <= capacity_;
  }
  bool has_data() const { return header_->head.load(std::memory_order_relaxed) != tail_; }
  // Bytes taken since the ring began, and the ring's size.
  uint64_t taken() const { return tail_; }
  uint64_t capacity() const { return capacity_; }
  // Copies `n` readable bytes out; released to the producer by release().
  void take(void* dst, uint64_t n) {
    uint64_t at = tail_ & mask_;
    uint64_t first = n < capacity_ - at ? n : capacity_ - at;
    std::memcpy(dst, data_ + at, first);
    std::memcpy(static_cast<uint8_t*>(dst) + first, data_, n - first);
    tail_ += n;
  }
  bool unreleased() const { return header_->tail.load(std::memory_order_relaxed) != tail_; }
  // Gives the bytes taken back to the producer; true when the producer waits for
  // them (its bell should ring).
  bool release() {
    header_->tail.store(tail_, std::memory_order_release);
    std::atomic_thread_fence(std::memory_order_seq_cst);
    return header_->producer_waiting.load(std::memory_order_relaxed) != 0 &&
           header_->producer_waiting.exchange(0) != 0;
  }

 private:
  RingHeader* header_ = nullptr;
  uint8_t* data_ = nullptr;
  uint64_t capacity_ = 0;
  uint64_t mask_ = 0;
  uint64_t tail_ = 0;
};

}  // namespace ferry::internal::ring
