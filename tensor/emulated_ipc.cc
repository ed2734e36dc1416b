#include "tensor/emulated_ipc.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace ferry::internal {
namespace {

constexpr uint64_t kArenaMagic = 0x666572727941524eULL;
constexpr uint64_t kEventsMagic = 0x6665727279455654ULL;
constexpr uint64_t kHeaderBytes = 4096;  // a page, so allocations keep their alignment

struct Header {
  uint64_t magic;
  uint64_t id;
  uint64_t size;  // arena: capacity in bytes; events: slots
};

std::string errno_text() { return std::strerror(errno); }

uint64_t fresh_id() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32 ^ rd()) + counter.fetch_add(1) * 0x9E3779B97F4A7C15ULL;
}

absl::StatusOr<std::pair<int, char*>> make_shared(const char* name, uint64_t bytes) {
  int fd = memfd_create(name, MFD_CLOEXEC);
  if (fd < 0) return absl::ResourceExhaustedError(absl::StrCat("memfd_create(", name, "): ", errno_text()));
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    std::string why = errno_text();
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("sizing ", name, " to ", bytes, " bytes: ", why));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) {
    std::string why = errno_text();
    close(fd);
    return absl::ResourceExhaustedError(absl::StrCat("mapping ", name, " (", bytes, " bytes): ", why));
  }
  return std::make_pair(fd, static_cast<char*>(p));
}

// Maps a peer's memfd after checking its header. `what` names it in errors.
absl::StatusOr<std::pair<char*, uint64_t>> map_peer(int fd, uint64_t magic, const char* what) {
  struct stat st;
  if (fstat(fd, &st) != 0) return absl::InvalidArgumentError(absl::StrCat(what, ": fstat: ", errno_text()));
  const uint64_t bytes = static_cast<uint64_t>(st.st_size);
  if (!S_ISREG(st.st_mode) || bytes < kHeaderBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": the descriptor is not an emulated CUDA export (", bytes, " bytes)"));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  if (p == MAP_FAILED) return absl::InvalidArgumentError(absl::StrCat(what, ": mmap: ", errno_text()));
  const Header* h = static_cast<const Header*>(p);
  if (h->magic != magic) {
    munmap(p, bytes);
    return absl::InvalidArgumentError(absl::StrCat(what, ": the descriptor is not an emulated CUDA export of that kind"));
  }
  return std::make_pair(static_cast<char*>(p), bytes);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MemfdArena>> MemfdArena::create(int device, uint64_t capacity) {
  std::string name = absl::StrCat("ferry-emulated-cuda", device);
  absl::StatusOr<std::pair<int, char*>> shared = make_shared(name.c_str(), kHeaderBytes + capacity);
  if (!shared.ok()) return shared.status();
  std::unique_ptr<MemfdArena> arena(new MemfdArena());
  arena->fd_ = shared->first;
  arena->base_ = shared->second;
  arena->mapped_ = kHeaderBytes + capacity;
  arena->id_ = fresh_id();
  *reinterpret_cast<Header*>(arena->base_) = Header{kArenaMagic, arena->id_, capacity};
  arena->free_.emplace(kHeaderBytes, capacity);
  return arena;
}

MemfdArena::~MemfdArena() {
  if (base_ != nullptr) munmap(base_, mapped_);
  if (fd_ >= 0) close(fd_);
}

void* MemfdArena::allocate(size_t bytes) {
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    const uint64_t offset = it->first, left = it->second - bytes;
    free_.erase(it);
    if (left > 0) free_.emplace(offset + bytes, left);
    return base_ + offset;
  }
  return nullptr;
}

void MemfdArena::release(void* p, size_t bytes) {
  uint64_t offset = offset_of(p), size = bytes;
  // The pages go back to the kernel, as memory a pool returns to the driver does.
  fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset), static_cast<off_t>(size));
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && next->first == offset + size) {
    size += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += size;
      return;
    }
  }
  free_.emplace(offset, size);
}

bool MemfdArena::contains(const void* p) const {
  const char* c = static_cast<const char*>(p);
  return c >= base_ + kHeaderBytes && c < base_ + mapped_;
}

absl::StatusOr<std::shared_ptr<ImportedArena>> ImportedArena::open(int fd) {
  absl::StatusOr<std::pair<char*, uint64_t>> mapped = map_peer(fd, kArenaMagic, "import_pool");
  if (!mapped.ok()) return mapped.status();
  std::shared_ptr<ImportedArena> arena(new ImportedArena());
  arena->base_ = mapped->first;
  arena->mapped_ = mapped->second;
  arena->id_ = reinterpret_cast<const Header*>(arena->base_)->id;
  return arena;
}

ImportedArena::~ImportedArena() {
  if (base_ != nullptr) munmap(base_, mapped_);
}

void* ImportedArena::at(uint64_t offset, uint64_t bytes) const {
  if (offset < kHeaderBytes || offset > mapped_ || bytes > mapped_ - offset) return nullptr;
  return base_ + offset;
}

absl::StatusOr<uintptr_t> ImportTable::import_pool(int fd) {
  absl::StatusOr<std::shared_ptr<ImportedArena>> opened = ImportedArena::open(fd);
  if (!opened.ok()) return opened.status();
  absl::MutexLock lock(&mu_);
  uintptr_t handle = ++next_;
  pools_.emplace(handle, *std::move(opened));
  return handle;
}

bool ImportTable::release_pool(uintptr_t handle) {
  absl::MutexLock lock(&mu_);
  return pools_.erase(handle) == 1;
}

absl::StatusOr<void*> ImportTable::import_pointer(uintptr_t handle, const void* data) {
  ArenaPointer x;
  std::memcpy(&x, data, sizeof(x));
  absl::MutexLock lock(&mu_);
  auto it = pools_.find(handle);
  if (it == pools_.end()) return absl::InvalidArgumentError("import_pointer: the pool is not an imported pool here");
  if (x.magic != kArenaPointerMagic || x.arena != it->second->id()) {
    return absl::InvalidArgumentError("import_pointer: the export data names an allocation of another pool");
  }
  void* p = it->second->at(x.offset, x.bytes);
  if (p == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("import_pointer: ", x.bytes, " bytes at offset ", x.offset, " lie outside the imported pool"));
  }
  auto& open = pointers_[reinterpret_cast<uintptr_t>(p)];
  open.first = it->second;
  ++open.second;
  return p;
}

bool ImportTable::has_pointer(const void* p) {
  absl::MutexLock lock(&mu_);
  return pointers_.count(reinterpret_cast<uintptr_t>(p)) == 1;
}

void ImportTable::release_pointer(const void* p) {
  absl::MutexLock lock(&mu_);
  auto it = pointers_.find(reinterpret_cast<uintptr_t>(p));
  if (it != pointers_.end() && --it->second.second == 0) pointers_.erase(it);
}

std::string encode_event_handles(const IpcEventHandles& handles) {
  std::vector<uint64_t> words{handles.segment, static_cast<uint64_t>(handles.count)};
  for (int slot : handles.slots) words.push_back(static_cast<uint64_t>(slot));
  return std::string(reinterpret_cast<const char*>(words.data()), words.size() * sizeof(uint64_t));
}

absl::StatusOr<IpcEventHandles> decode_event_handles(std::string_view bytes) {
  std::vector<uint64_t> words(bytes.size() / sizeof(uint64_t));
  if (bytes.size() % sizeof(uint64_t) != 0 || words.size() < 3) {
    return absl::InvalidArgumentError(
        absl::StrCat("import_ipc_events: ", bytes.size(), " bytes of handles (expected 8 per word, 3 words or more)"));
  }
  std::memcpy(words.data(), bytes.data(), bytes.size());
  IpcEventHandles out;
  out.segment = words[0];
  if (words[1] == 0 || words[1] > 65536) return absl::InvalidArgumentError("import_ipc_events: a malformed handle");
  out.count = static_cast<int>(words[1]);
  for (size_t i = 2; i < words.size(); ++i) {
    if (words[i] >= words[1]) return absl::InvalidArgumentError("import_ipc_events: a slot out of range");
    out.slots.push_back(static_cast<int>(words[i]));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<IpcEventSegment>> IpcEventSegment::create(int count) {
  if (count <= 0 || count > 65536) {
    return absl::InvalidArgumentError(absl::StrCat("create_ipc_events: ", count, " events (expected 1 to 65536)"));
  }
  const size_t bytes = kHeaderBytes + sizeof(IpcSlot) * static_cast<size_t>(count);
  absl::StatusOr<std::pair<int, char*>> shared = make_shared("ferry-emulated-cuda-events", bytes);
  if (!shared.ok()) return shared.status();
  std::shared_ptr<IpcEventSegment> seg(new IpcEventSegment());
  seg->fd_ = shared->first;
  seg->base_ = shared->second;
  seg->mapped_ = bytes;
  seg->id_ = fresh_id();
  seg->count_ = count;
  *reinterpret_cast<Header*>(seg->base_) = Header{kEventsMagic, seg->id_, static_cast<uint64_t>(count)};
  for (int i = 0; i < count; ++i) new (&seg->slot(i)) IpcSlot();
  return seg;
}

absl::StatusOr<std::shared_ptr<IpcEventSegment>> IpcEventSegment::open(int fd, uint64_t id, int count) {
  absl::StatusOr<std::pair<char*, uint64_t>> mapped = map_peer(fd, kEventsMagic, "import_ipc_events");
  if (!mapped.ok()) return mapped.status();
  std::shared_ptr<IpcEventSegment> seg(new IpcEventSegment());
  seg->base_ = mapped->first;
  seg->mapped_ = mapped->second;
  const Header* h = reinterpret_cast<const Header*>(seg->base_);
  if (h->id != id || h->size != static_cast<uint64_t>(count) || count <= 0 ||
      kHeaderBytes + sizeof(IpcSlot) * static_cast<size_t>(count) > seg->mapped_) {
    return absl::InvalidArgumentError(absl::StrCat("import_ipc_events: the handles name ", count,
                                                   " events of another segment than the descriptor's"));
  }
  seg->id_ = id;
  seg->count_ = count;
  return seg;
}

IpcEventSegment::~IpcEventSegment() {
  if (base_ != nullptr) munmap(base_, mapped_);
  if (fd_ >= 0) close(fd_);
}

IpcSlot& IpcEventSegment::slot(int i) const {
  return reinterpret_cast<IpcSlot*>(base_ + kHeaderBytes)[i];
}

void ipc_complete(IpcSlot& slot, uint32_t generation) {
  uint32_t now = slot.completed.load(std::memory_order_relaxed);
  while (static_cast<int32_t>(generation - now) > 0 &&
         !slot.completed.compare_exchange_weak(now, generation, std::memory_order_release)) {
  }
  // Not FUTEX_PRIVATE: the waiter may be another process.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(&slot.completed), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

void ipc_wait(IpcSlot& slot, uint32_t generation, const std::atomic<bool>& abandoned) {
  // A bounded sleep per round: a recorder that died never wakes us, and only a
  // destroy here (abandoned) ends the wait then.
  const timespec round{0, 5'000'000};
  for (;;) {
    uint32_t now = slot.completed.load(std::memory_order_acquire);
    if (static_cast<int32_t>(now - generation) >= 0 || abandoned.load(std::memory_order_acquire)) return;
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&slot.completed), FUTEX_WAIT, now, &round, nullptr, 0);
  }
}

}  // namespace ferry::internal
