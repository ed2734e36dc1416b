// File: tensor/emulated_ipc.h (not installed)
//
// The shared memory under the emulated runtime's CUDA IPC (tensor/emulated_cuda.h):
// - MemfdArena: one emulated device pool's memory, a memfd mapped whole, so that
//   exporting the pool is handing out that memfd and an importer maps the very bytes;
// - ImportedArena: a peer's exported pool mapped here;
// - IpcEventSegment: inter-process events, each a pair of counters in a memfd (records
//   made, records passed), waited on with a futex that works across processes.
// Nothing here knows streams; the runtime's lock guards the arenas, and the event
// counters are atomics any thread or process may touch.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace ferry::internal {

// One emulated device pool's memory. Sparse: pages exist only once touched, and a
// released range gives its pages back. Not thread-safe (the runtime's lock guards it).
class MemfdArena {
 public:
  // A memfd of `capacity` bytes (plus a header page naming it), mapped shared.
  static absl::StatusOr<std::unique_ptr<MemfdArena>> create(int device, uint64_t capacity);
  ~MemfdArena();
  MemfdArena(const MemfdArena&) = delete;
  MemfdArena& operator=(const MemfdArena&) = delete;

  // `bytes` (a multiple of the alignment) from the free ranges, first fit; null when
  // none is large enough.
  void* allocate(size_t bytes);
  // Returns a range allocate() gave, its pages to the kernel.
  void release(void* p, size_t bytes);
  bool contains(const void* p) const;
  uint64_t offset_of(const void* p) const { return static_cast<uint64_t>(static_cast<const char*>(p) - base_); }
  int fd() const { return fd_; }
  uint64_t id() const { return id_; }

 private:
  MemfdArena() = default;
  int fd_ = -1;
  char* base_ = nullptr;   // the mapping, header page first
  uint64_t mapped_ = 0;    // bytes mapped: the header page and the capacity
  uint64_t id_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset -> bytes
};

// A peer's arena, mapped from the descriptor it exported. Immutable once open.
class ImportedArena {
 public:
  // Errors: a descriptor that is not an emulated pool's memfd.
  static absl::StatusOr<std::shared_ptr<ImportedArena>> open(int fd);
  ~ImportedArena();
  ImportedArena(const ImportedArena&) = delete;
  ImportedArena& operator=(const ImportedArena&) = delete;

  uint64_t id() const { return id_; }
  // The address of [offset, offset + bytes) here, or null when outside the pool.
  void* at(uint64_t offset, uint64_t bytes) const;

 private:
  ImportedArena() = default;
  char* base_ = nullptr;
  uint64_t mapped_ = 0;
  uint64_t id_ = 0;
};

// Pointer export data of the emulator (inside CudaPointerExport's 64 bytes).
struct ArenaPointer {
  uint64_t magic = 0;
  uint64_t arena = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
inline constexpr uint64_t kArenaPointerMagic = 0x6665727279505452ULL;

// The pools and pointers one runtime imported. Thread-safe. An imported pointer keeps
// its pool's mapping alive until released, even past the pool's release.
class ImportTable {
 public:
  // A handle for the pool the descriptor `fd` holds (it stays the caller's).
  absl::StatusOr<uintptr_t> import_pool(int fd);
  // False when `handle` is not an imported pool.
  bool release_pool(uintptr_t handle);
  // The address here of the allocation `data` (an ArenaPointer) names in pool `handle`.
  absl::StatusOr<void*> import_pointer(uintptr_t handle, const void* data);
  bool has_pointer(const void* p);
  void release_pointer(const void* p);

 private:
  absl::Mutex mu_;
  uintptr_t next_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uintptr_t, std::shared_ptr<ImportedArena>> pools_ ABSL_GUARDED_BY(mu_);     // by handle
  // By address: the pool's mapping, and how many imports of that pointer are open (the
  // same allocation may be imported again before an earlier import is released).
  std::map<uintptr_t, std::pair<std::shared_ptr<ImportedArena>, int>> pointers_ ABSL_GUARDED_BY(mu_);
};

// Inter-process event handles of the emulator: the segment's id and slot count, then
// each event's slot.
struct IpcEventHandles {
  uint64_t segment = 0;
  int count = 0;
  std::vector<int> slots;
};
std::string encode_event_handles(const IpcEventHandles& handles);
absl::StatusOr<IpcEventHandles> decode_event_handles(std::string_view bytes);

// One inter-process event: records made (by whichever process records it) and the
// highest record whose stream has passed it. 32 bits each, for the futex.
struct IpcSlot {
  std::atomic<uint32_t> recorded{0};
  std::atomic<uint32_t> completed{0};
};

class IpcEventSegment {
 public:
  static absl::StatusOr<std::shared_ptr<IpcEventSegment>> create(int count);
  // Maps a peer's segment; `id` and `count` as its export said. Errors: anything else.
  static absl::StatusOr<std::shared_ptr<IpcEventSegment>> open(int fd, uint64_t id, int count);
  ~IpcEventSegment();
  IpcEventSegment(const IpcEventSegment&) = delete;
  IpcEventSegment& operator=(const IpcEventSegment&) = delete;

  IpcSlot& slot(int i) const;
  int fd() const { return fd_; }  // -1 for one opened from a peer's descriptor
  uint64_t id() const { return id_; }
  int count() const { return count_; }

 private:
  IpcEventSegment() = default;
  int fd_ = -1;
  char* base_ = nullptr;
  size_t mapped_ = 0;
  uint64_t id_ = 0;
  int count_ = 0;
};

// Whether the record numbered `generation` has passed (counters wrap).
inline bool ipc_passed(const IpcSlot& slot, uint32_t generation) {
  return static_cast<int32_t>(slot.completed.load(std::memory_order_acquire) - generation) >= 0;
}
// Marks record `generation` passed (never lowering what a later record set) and wakes
// every waiter, in any process.
void ipc_complete(IpcSlot& slot, uint32_t generation);
// Blocks until record `generation` has passed, or `abandoned` is set (the event was
// destroyed here: its recorder may be gone for good).
void ipc_wait(IpcSlot& slot, uint32_t generation, const std::atomic<bool>& abandoned);

}  // namespace ferry::internal
